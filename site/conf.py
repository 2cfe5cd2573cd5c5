"""Sphinx configuration of the course's web site (docs/tests.md, "The course as a web site").

Build from the repository's root (the source is the repository itself, so the notebooks'
`../images/*.png` and their links to each other resolve as they do in JupyterLab):

    sphinx-build -W --keep-going -c site -d build/doctrees . build/site

The pages and their order are site/_toc.yml (sphinx-external-toc). Notebooks are rendered with
myst-nb from their committed outputs, never executed. Nothing is fetched, at build time or by the
built pages: math is typeset by a copy of MathJax 3 shipped inside the site (from the
django-static-mathjax wheel, which is MathJax's own release files), the theme's fonts and icons are
its own, ipywidgets' CDN scripts are off. tests/test_site.py walks every page in Chromium.
"""
from __future__ import annotations

import posixpath
import re
import shutil
from pathlib import Path

from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

ROOT = Path(__file__).resolve().parent.parent

project = "ZeroLab"
author = "ZeroLab"
copyright = "ZeroLab authors, MIT licence"
html_title = "ZeroLab: ZeRO-1/2/3 and FSDP, measured"

extensions = ["myst_nb", "sphinx_external_toc"]
external_toc_path = "site/_toc.yml"         # relative to the source dir, the repository's root
templates_path = ["_templates"]             # relative to this folder
html_static_path = ["_static"]
html_css_files = ["zerolab.css"]
html_favicon = "_static/favicon.svg"          # (a browser asks for one: no 404)
html_extra_path = ["_extra"]                # index.html: the site's root, a redirect to README

# only the course's pages are read; the folders that are not course (and can be big) are skipped
include_patterns = ["README.md", "docs/*.md", "labs/*.md", "labs/*.ipynb", "notebooks/*.md",
                    "notebooks/*.ipynb", "notebooks/exercises/*.ipynb", "site/*.md"]
exclude_patterns = ["build", "runs", "**/runs", "out", "wheelhouse", ".*", "**/.*",
                    "zerolab", "zerolab.egg-info", "tests", "scripts", "**/.ipynb_checkpoints"]

# --- notebooks and Markdown (myst-nb / myst-parser) -----------------------------------------------
nb_execution_mode = "off"                   # the committed outputs (the CPU reference runs) only
nb_ipywidgets_js = {}                       # no require.js / widget manager from a CDN
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3                    # `glossary.md#symbols`: GitHub's heading anchors
myst_dmath_double_inline = True

# --- math: MathJax 3 from files inside the site ----------------------------------------------------
mathjax_path = "mathjax/tex-chtml.js"       # relative to _static/
mathjax3_config = {"tex": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]},
                   "options": {"enableMenu": False}}
# what tex-chtml.js loads at run time: its fonts, TeX extensions it autoloads (\cancel, \boldsymbol)
MATHJAX_PARTS = ["tex-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions"]


def mathjax_dir() -> Path:
    """MathJax 3's es5 folder inside the installed django-static-mathjax wheel (no Django needed)."""
    import mathjax
    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def copy_mathjax(app, exception):
    """Copy the MathJax files a page needs into the built site's _static/mathjax/."""
    if exception is not None or app.builder.format != "html":
        return
    src, dst = mathjax_dir(), Path(app.outdir) / "_static" / "mathjax"
    for part in MATHJAX_PARTS:
        if (src / part).is_dir():
            shutil.copytree(src / part, dst / part, dirs_exist_ok=True)
        else:
            (dst / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / part, dst / part)
    shutil.copy2(src.parent / "LICENSE", dst / "LICENSE")


# --- "run this yourself" on every page (_templates/layout.html) ------------------------------------
def open_command() -> str:
    """README's command that opens the course in JupyterLab, without the notebook it opens:
    `jupyter lab --notebook-dir=.` (each notebook's page appends its own path)."""
    found = re.search(r"`(jupyter lab\b[^`]*)`", (ROOT / "README.md").read_text(encoding="utf-8"))
    words = found.group(1).split() if found else ["jupyter", "lab"]
    return " ".join(w for w in words if not w.endswith(".ipynb"))


html_context = {"open_command": open_command(),
                "default_mode": "auto"}     # the reader's light or dark (pydata-sphinx-theme's own
                                            # default "" logs a console error on a first visit)

# --- theme: sphinx-book-theme (pydata-sphinx-theme: system fonts, its own icons, no CDN) ----------
html_theme = "sphinx_book_theme"
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "use_download_button": True,        # the page's source: the .ipynb or .md itself
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "launch_buttons": {},
    "show_toc_level": 2,
}
html_last_updated_fmt = None
html_show_sphinx = False
html_copy_source = True


# --- a link to a folder (`[exercises](exercises/)`, as JupyterLab opens it) goes to its first page -
class FolderLinks(SphinxPostTransform):
    """Before myst resolves links (priority 9): `[text](folder/)` -> the folder's first page by
    name (its first in site/_toc.yml's globs), instead of a broken link."""

    default_priority = 8

    def run(self, **kwargs):
        for node in self.document.findall(addnodes.pending_xref):
            target = node.get("reftarget", "")
            if node.get("reftype") != "myst" or node.get("refdomain") or not target.endswith("/"):
                continue
            refdoc = node.get("refdoc", self.env.docname)
            folder = posixpath.normpath(posixpath.join(posixpath.dirname(refdoc), target))
            first = min((d for d in self.env.found_docs if d.startswith(folder + "/")), default=None)
            if first is not None:
                node["refdomain"], node["reftarget"], node["reftargetid"] = "doc", first, None


def setup(app):
    app.connect("build-finished", copy_mathjax)
    app.add_post_transform(FolderLinks)
