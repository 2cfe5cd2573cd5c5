"""The course as a web site (docs/tests.md, "The course as a web site"), built and walked in a browser.

Builds the site with the command README.md documents (parsed from README.md, so the documented
command is what is tested; only its output folders are moved to the test's temp dir), with no
network: in a network namespace of its own where `unshare -n` works (as root, as in CI), else
with every proxy variable pointing at a closed port. Then, without a browser:
- every .ipynb under notebooks/ and labs/, the glossary, the workshop guide and README are in
  site/_toc.yml (its globs expanded as Sphinx does), in course order, and each has a page;
- no built page or stylesheet fetches anything from the network (script / link / img / iframe
  with an http(s) address, CSS url(http...) or @import of one), and MathJax is inside the site;
- the publishing recipe (.github/workflows/site.yml) builds with README's command.
In headless Chromium (Debian's `chromium` + `chromium-driver`, as tests/test_browser.py), from a
local HTTP server on 127.0.0.1 that records every request, the test walks every page from the
site's root, following its links, and fails on:
- a console error (JavaScript error, failed load), a request the server answered with 4xx/5xx,
  or any request that left the local server (the Resource Timing entries of every page);
- an <img> that is not loaded and decoded (naturalWidth 0);
- a link to a page or file that is not in the site, or to an #anchor the page does not have;
- math MathJax did not typeset, or typeset with an error (mjx-merror);
- a page the walk could not reach from the root (every built page is walked);
- a page without its "Run this yourself" box linking to README's three commands.
It also checks that a notebook's figure (notebook 02's first cell tagged "figure") is visible on
screen: an element screenshot with ink and colour, not a blank box; and that the glossary's Chinese
terms are in the page, as in glossary.md, and drawn as glyphs (two different characters draw
differently: a missing font draws the same empty box for both).

Skipped when Sphinx / myst-nb (the `dev` extra) or Chromium, chromedriver or Selenium is missing,
unless ZEROLAB_REQUIRE_BROWSER=1 (set by .ci/run, which installs them): then it fails instead.
Measured on 2 cores: 37 s in all (build 14 s, the walk of 39 pages 16 s); 84 s while other jobs
kept the machine busy (load average 6-8: build 43 s, walk 30 s).
"""
from __future__ import annotations

import functools
import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
WORKSHOP = ROOT / "docs" / "workshop.md"
TOC = ROOT / "site" / "_toc.yml"
TOC_FOLDERS = ("notebooks", "labs", "docs", "site")                 # where the site's pages live
WORKFLOW = ROOT / ".github" / "workflows" / "site.yml"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FIGURE_PAGE = "notebooks/02_memory.html"
NOT_PAGES = {"genindex.html", "search.html", "index.html"}      # not in the toc (index: a redirect)
FETCH = re.compile(r"""<(?:script|link|img|iframe|source|embed|object)\b[^>]*?"""
                   r"""\b(?:src|href|data)\s*=\s*["']?(?:https?:)?//""", re.IGNORECASE)
CSS_FETCH = re.compile(r"""url\(\s*["']?(?:https?:)?//|@import\s+(?:url\()?\s*["']?(?:https?:)?//""",
                       re.IGNORECASE)


def _fail_or_skip(why: str):
    if os.environ.get("ZEROLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"site test required but {why}", pytrace=False)
    pytest.skip(why)


def readme_site_command() -> list[str]:
    """README's command that builds the site (a line starting `sphinx-build`), as words."""
    found = re.search(r"^(sphinx-build\b[^\n#`]*)", README.read_text(encoding="utf-8"), re.MULTILINE)
    assert found, "README.md shows no `sphinx-build ...` line that builds the course's site"
    return shlex.split(found.group(1))


def toc_files() -> list[str]:
    """site/_toc.yml's pages, root first, in course order (paths without suffix): each `file:`,
    and each `glob:` expanded as Sphinx does (`*` inside one folder, in name order)."""
    docs = sorted(p.relative_to(ROOT).with_suffix("").as_posix() for folder in TOC_FOLDERS
                  for suffix in ("md", "ipynb") for p in (ROOT / folder).rglob(f"*.{suffix}")
                  if not {".ipynb_checkpoints", "runs"} & set(p.parts))
    pages = []
    for kind, value in re.findall(r"^\s*(root|- file|- glob):\s*([^\s#]+)",
                                  TOC.read_text(encoding="utf-8"), re.MULTILINE):
        if kind != "- glob":
            pages.append(value)
            continue
        pattern = re.compile(re.escape(value).replace(r"\*", "[^/]*").replace(r"\[", "[")
                             .replace(r"\]", "]").replace(r"\-", "-") + "$")
        pages += [d for d in docs if pattern.match(d) and d not in pages]
    return pages


def _offline_prefix() -> list[str]:
    """`unshare -n` (a network namespace with no network at all) where it works, else nothing."""
    unshare = shutil.which("unshare")
    works = unshare and subprocess.run([unshare, "-n", "true"], capture_output=True, check=False)
    return [unshare, "-n"] if works and works.returncode == 0 else []


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built with README's command into a temp dir, offline."""
    for module in ("sphinx", "myst_nb", "sphinx_external_toc", "sphinx_book_theme", "mathjax"):
        try:
            __import__(module)
        except ImportError:
            _fail_or_skip(f"{module} is not installed (pip install -e '.[cpu,dev]')")
    words = readme_site_command()
    tmp = tmp_path_factory.mktemp("site")
    out, doctrees = tmp / "html", tmp / "doctrees"
    assert "-d" in words and not words[-1].startswith("-"), words
    words[words.index("-d") + 1], words[-1] = str(doctrees), str(out)
    dead = "http://127.0.0.1:9"                     # the discard port: nothing listens
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", http_proxy=dead, https_proxy=dead,
               HTTP_PROXY=dead, HTTPS_PROXY=dead, ALL_PROXY=dead, no_proxy="", NO_PROXY="")
    bindir = Path(sys.executable).parent             # this Python's sphinx-build
    exe = str(bindir / words[0]) if (bindir / words[0]).exists() else words[0]
    start, offline = time.monotonic(), _offline_prefix()
    proc = subprocess.run([*offline, exe, *words[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, (f"{shlex.join(words)} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(f"site built in {seconds:.1f} s ({'unshare -n' if offline else 'proxies closed'}): {out}")
    return out


def _pages(site: Path) -> set[str]:
    return {p.relative_to(site).as_posix() for p in site.rglob("*.html")
            if p.parts[len(site.parts)] not in ("_static", "_sources", "_images")
            and p.relative_to(site).as_posix() not in NOT_PAGES}


# --- without a browser --------------------------------------------------------------------------
def test_readme_documents_the_site_and_its_recipe():
    """README's command builds into build/site; docs/tests.md documents the site and its recipe;
    the Pages workflow builds with it, installs the dev extra's site tools and deploys build/site;
    the workshop guide shows the site."""
    words = readme_site_command()
    assert words[0] == "sphinx-build" and "-W" in words and words[-2:] == [".", "build/site"], words
    assert "docs/tests.md#the-course-as-a-web-site" in README.read_text(encoding="utf-8")
    text = (ROOT / "docs" / "tests.md").read_text(encoding="utf-8")
    assert "The course as a web site" in text and ".github/workflows/site.yml" in text
    flow = WORKFLOW.read_text(encoding="utf-8")
    assert " ".join(words) in " ".join(flow.split()), "site.yml does not build with README's command"
    for step in ("actions/upload-pages-artifact", "actions/deploy-pages", "path: build/site"):
        assert step in flow, step
    tools = re.findall(r'"((?:sphinx|myst|django-static-mathjax)[^"]*)"',
                       (ROOT / "pyproject.toml").read_text())        # the dev extra's site tools
    assert len(tools) == 5 and all(f'"{r}"' in flow for r in tools), (tools, "site.yml's pip line")
    assert "build/site" in WORKSHOP.read_text(encoding="utf-8"), "docs/workshop.md: the site"


def course_notebooks() -> list[str]:
    """Every .ipynb under notebooks/ and labs/, as a path without suffix."""
    return sorted(p.relative_to(ROOT).with_suffix("").as_posix()
                  for folder in ("notebooks", "labs") for p in (ROOT / folder).rglob("*.ipynb")
                  if not {".ipynb_checkpoints", "runs"} & set(p.parts))


def test_every_notebook_is_in_the_toc_in_course_order():
    """site/_toc.yml lists every notebook and lab (no build needed to say which one is missing),
    the numbered notebooks first and in order, then the exercises, then the labs."""
    files = toc_files()
    missing = [n for n in course_notebooks() if n not in files]
    assert not missing, (f"not in site/_toc.yml (add a `- file:` line in course order, or name it "
                         f"as its globs expect, e.g. notebooks/13_*.ipynb): {missing}")
    for page in ["README", "labs/README", "notebooks/glossary", "docs/workshop"]:
        assert page in files, page
    assert files[0] == "README" and len(set(files)) == len(files), files
    numbered = [f for f in files if re.match(r"notebooks/\d\d_", f)]
    assert numbered == sorted(numbered) and files.index(numbered[0]) == 1, numbered
    labs = [int(m.group(1)) for f in files if (m := re.match(r"labs/lab(\d+)_", f))]
    assert labs == sorted(labs), f"labs out of order (a glob sorts lab10 before lab2): {labs}"
    order = [f.split("/")[0] + ("/exercises" if "/exercises/" in f else "") for f in files[1:]]
    blocks = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert blocks[:3] == ["notebooks", "notebooks/exercises", "labs"], blocks


def test_every_page_is_built(site):
    """Each page of the toc, and no other, is a page of the built site."""
    files = toc_files()
    for page in files:
        assert (site / f"{page}.html").is_file(), f"{page}.html was not built"
    assert set(files) == {p[:-5] for p in _pages(site)}, "pages built but not in the toc"


def test_nothing_is_fetched_from_the_network(site):
    """No page loads a script, stylesheet, image, font or frame from an http(s) address."""
    bad = []
    for path in site.rglob("*"):
        if path.suffix == ".html":
            bad += [f"{path.relative_to(site)}: {m.group(0)[:80]}"
                    for m in FETCH.finditer(path.read_text(encoding="utf-8", errors="replace"))]
        elif path.suffix == ".css":
            bad += [f"{path.relative_to(site)}: {m.group(0)}"
                    for m in CSS_FETCH.finditer(path.read_text(encoding="utf-8", errors="replace"))]
    assert not bad, "fetched from the network:\n" + "\n".join(bad[:20])
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert (site / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()
    assert 'src="../_static/mathjax/tex-chtml.js"' in (site / "site" / "formulas.html").read_text()


# --- in the browser ----------------------------------------------------------------------------
class _Quiet(http.server.SimpleHTTPRequestHandler):
    """Serves the site; records (status, path) of every request instead of logging it."""

    log: ClassVar[list] = []

    def log_request(self, code="-", size="-"):
        self.log.append((int(code) if str(code).isdigit() else 0, self.path))

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass                                    # the browser hung up (a broken pipe): not a fault


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory):
    """(driver, base URL, request log) for the built site on a local server."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        _fail_or_skip("chromium / chromedriver not found (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _fail_or_skip("selenium is not installed (pip install -e '.[cpu,dev]')")
    handler = type("Handler", (_Quiet,), {"log": []})
    server = _Server(("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    user_dir = tmp_path_factory.mktemp("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100", f"--user-data-dir={user_dir}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(20)
    try:
        yield driver, f"http://127.0.0.1:{server.server_address[1]}/", handler.log
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


# what a page reports once loaded and typeset: links, images, math, requests, the run box
REPORT = """
const done = arguments[arguments.length - 1];
const report = () => done({
  url: location.href,
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  badImages: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
                                 .map(i => i.getAttribute('src')),
  images: document.images.length,
  math: document.querySelectorAll('.math').length,
  untypeset: [...document.querySelectorAll('span.math, div.math')]
               .filter(m => !m.querySelector('mjx-container')).map(m => m.textContent.slice(0, 60)),
  mathErrors: [...document.querySelectorAll('mjx-merror, [data-mjx-error]')]
               .map(e => e.getAttribute('data-mjx-error') || e.textContent),
  resources: performance.getEntriesByType('resource').map(r => r.name),
  run: [...document.querySelectorAll('#run-this-yourself a')].map(a => a.href),
});
const start = Date.now();
const wait = () => {
  if (document.readyState !== 'complete') return setTimeout(wait, 50);
  if (!document.querySelector('.math')) return report();
  const mj = window.MathJax;
  if (mj && mj.startup && mj.startup.promise) return mj.startup.promise.then(report, report);
  if (Date.now() - start > 15000) return report();
  setTimeout(wait, 50);
};
wait();
"""


def _ids(site: Path, page: str, cache: dict) -> set[str]:
    if page not in cache:
        text = (site / page).read_text(encoding="utf-8", errors="replace")
        cache[page] = set(re.findall(r"""\b(?:id|name)=["']([^"']+)["']""", text))
    return cache[page]


def test_walk_every_page(site, browser):
    """From the root, every page: no console error, no broken link, image or math; all local."""
    driver, base, requests = browser
    from selenium.webdriver.support.ui import WebDriverWait
    driver.get(base)                                    # index.html: a redirect to README.html
    WebDriverWait(driver, 10).until(lambda d: d.current_url == base + "README.html")
    # the pages, from the root; and the search page with a query (its index, its script)
    todo, seen, problems, ids = ["README.html", "search.html?q=all_gather"], set(), [], {}
    typeset = 0
    while todo:
        page = todo.pop(0)
        if page in seen:
            continue
        seen.add(page)
        driver.get(base + page)
        if page.startswith("search.html?q="):
            WebDriverWait(driver, 15).until(
                lambda d: d.find_elements("css selector", "#search-results li"),
                "search.html?q=all_gather found nothing")
        r = driver.execute_async_script(REPORT)
        logs = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        problems += [f"{page}: console: {e['message'][:200]}" for e in logs]
        problems += [f"{page}: image not loaded: {src}" for src in r["badImages"]]
        problems += [f"{page}: math not typeset: {t!r}" for t in r["untypeset"]]
        problems += [f"{page}: math error: {t!r}" for t in sorted(set(r["mathErrors"]))]
        problems += [f"{page}: fetched from outside: {u}" for u in r["resources"]
                     if not u.startswith(base)]
        if not page.startswith("search.html") and not any(   # (the search page: its own layout)
                urllib.parse.urldefrag(u)[0] == base + "README.html" and u.endswith("#three-commands")
                for u in r["run"]):
            problems.append(f"{page}: no 'Run this yourself' link to README's three commands")
        typeset += r["math"] - len(r["untypeset"])
        for link in r["links"]:
            url, fragment = urllib.parse.urldefrag(link)
            if not url.startswith(base):
                if urllib.parse.urlsplit(url).scheme not in ("http", "https", "mailto", ""):
                    problems.append(f"{page}: odd link {link}")
                continue                                # an outside page: linked, not fetched
            target = urllib.parse.unquote(urllib.parse.urlsplit(url).path)[1:] or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if not (site / target).is_file():
                problems.append(f"{page}: broken link {link}")
                continue
            if fragment and target.endswith(".html") and fragment not in _ids(site, target, ids):
                problems.append(f"{page}: link to a missing anchor {link}")
            if target.endswith(".html") and target not in seen and target != "index.html":
                todo.append(target)
    failed = sorted({f"{code} {path}" for code, path in requests if code >= 400})
    problems += [f"server answered {f}" for f in failed]
    unreached = sorted(_pages(site) - seen)
    problems += [f"page not reached from the root: {p}" for p in unreached]
    assert typeset > 0, "no math typeset on any page (site/formulas.md has some)"
    assert not problems, f"{len(problems)} problem(s) in {len(seen)} pages:\n" + "\n".join(problems[:40])
    print(f"walked {len(seen)} pages, {len(requests)} requests, {typeset} formulas typeset")


def _ink(png: bytes) -> tuple[float, int]:
    """(fraction of non-white pixels, number of coloured pixels) of a PNG."""
    import io

    import matplotlib.image
    rgb = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    ink = (rgb < 0.9).any(axis=-1)
    coloured = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.25
    return float(ink.mean()), int(coloured.sum())


def test_a_figure_is_visible(browser, tmp_path):
    """Notebook 02's first figure (its committed output) is on screen with ink and colour."""
    from selenium.webdriver.common.by import By
    driver, base, _ = browser
    driver.get(base + FIGURE_PAGE)
    figures = driver.find_elements(By.CSS_SELECTOR, ".tag_figure .cell_output img")
    assert figures, f"{FIGURE_PAGE}: no output image in a cell tagged 'figure'"
    img = figures[0]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", img)
    size = driver.execute_script(
        "const i = arguments[0], b = i.getBoundingClientRect();"
        "return [i.naturalWidth, b.width, b.height, getComputedStyle(i).visibility];", img)
    assert size[0] > 0 and size[1] > 200 and size[2] > 100 and size[3] == "visible", size
    png = img.screenshot_as_png
    (tmp_path / "figure.png").write_bytes(png)
    ink, coloured = _ink(png)
    print(f"figure screenshot: {tmp_path / 'figure.png'} ({ink:.1%} ink, {coloured} coloured px)")
    assert ink > 0.02 and coloured > 200, f"the figure looks blank: {ink:.1%} ink, {coloured} px"


def test_chinese_terms_render(browser):
    """The glossary's Chinese terms are in its page as written, and drawn as glyphs."""
    driver, base, _ = browser
    driver.get(base + "notebooks/glossary.html")
    text = driver.execute_script("return document.body.innerText")
    source = (ROOT / "notebooks" / "glossary.md").read_text(encoding="utf-8")
    terms = set(re.findall(r"[\u4e00-\u9fff]+", source))
    assert len(terms) > 20 and not [t for t in terms if t not in text], "Chinese terms lost"
    draws = driver.execute_script("""
        const el = [...document.querySelectorAll('td')].find(t => t.textContent.includes('模型状态'));
        const font = '40px ' + getComputedStyle(el).fontFamily;
        return ['模', '型', '态'].map(ch => {
          const c = document.createElement('canvas'); c.width = c.height = 48;
          const x = c.getContext('2d'); x.font = font; x.fillText(ch, 2, 40);
          return Array.from(x.getImageData(0, 0, 48, 48).data).join(',');
        });""")
    if len(set(draws)) < len(draws):
        _fail_or_skip("Chinese characters draw as one empty box: no CJK font in this browser's "
                      "machine (apt-get install fonts-wqy-microhei; a reader's system has one)")
