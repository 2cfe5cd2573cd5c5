"""Commit the code a notebook shows: the outputs of its `nb.show(...)` and `diff` cells.

What it is for: a notebook shows the package's own code with `nb.show(X)` (zerolab/course/nb.py:
Markdown with the file, the line and the source), and some cells show a unified diff of two
strategy files (notebooks 05, 06). A reader who browses the course - the web site renders the
committed outputs only, and so does GitHub - must see that code, so these cells are tagged
`shown-code` and keep their Markdown display outputs (scripts/nb_policy.py keeps them). This script
makes those outputs without executing the notebook, so they are the same on every machine:

  - a shown cell is found by its source: a call to `show(...)` / `nb.show(...)`, or to
    difflib's `unified_diff` / `context_diff` / `ndiff` (a comment naming them is not a call);
  - its output is recomputed in a fresh namespace: the notebook's import lines up to and
    including that cell (top-level `import` / `from ... import` of every code cell before it; one
    that fails to import is skipped), then the cell's own statements up to its last show or
    display, with IPython's `display` captured (IPython's DisplayFormatter gives the same
    text/markdown and text/plain data as a kernel). Statements after the last one (a cell that
    goes on to read a run) are not executed, and a cell that would launch ranks
    (`nb.launch...`) before its show is refused. The diff cells are recomputed the same way: their
    source reads the two package files and displays the diff as Markdown, labelled with relative
    paths (`zerolab/zero1.py`);
  - kept: display outputs' text/markdown and text/plain only, in nbformat's list-of-lines form;
    an output naming an absolute path (this checkout, the interpreter's prefix, site-packages,
    the home folder) or a memory address (0x...) is refused.

The package is imported from this checkout (the script's parent folder), not from wherever pip
installed it, so the outputs show the code next to the notebooks. Cells are matched by their
source on every run, so cells that moved or were added are handled; a tagged cell that no longer
shows code loses the tag and its outputs. Other cells and the notebook's format are untouched.

    python scripts/nb_shown.py --write notebooks/*.ipynb notebooks/exercises/*.ipynb labs/*.ipynb
    python scripts/nb_shown.py --check notebooks/*.ipynb notebooks/exercises/*.ipynb labs/*.ipynb

`--check` changes nothing and exits 1 naming each cell that is untagged, or whose committed output
differs from what the package's code shows now, or that cannot be recomputed without running the
notebook (a show of a name only the kernel's state holds). nbval does not compare these cells
(unless a cell is also tagged `nbval-check-output`, as some of notebooks 08 and 13 are: a kernel's
data equals this script's byte for byte): this check is the authority. It takes about 8 s for the
whole course on 2 busy cores, most of it importing torch.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))               # this checkout's zerolab, not the installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import nb_policy  # noqa: E402

TAG = nb_policy.SHOWN_TAG
DIFF_CALLS = {"unified_diff", "context_diff", "ndiff"}
DISPLAY_CALLS = {"display"}
LAUNCH_CALLS = {"launch", "launch_module", "launch_demo"}     # zerolab.nb's: they start ranks
KEPT_MIME = ("text/markdown", "text/plain")
ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
# where this machine keeps things: a listing naming one is machine-specific
MACHINE = tuple({str(ROOT), sys.prefix, sys.base_prefix, str(Path.home()), "site-packages"})
FIX = "run python scripts/nb_shown.py --write"


class NotRecomputable(Exception):
    """A shown cell whose output cannot be made without running the notebook."""


def _called(node: ast.AST) -> set[str]:
    """Names of the functions called anywhere in `node` (attribute or bare name)."""
    return {getattr(n.func, "attr", getattr(n.func, "id", None)) for n in ast.walk(node)
            if isinstance(n, ast.Call)}


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:                     # a cell with IPython magics (%%writefile)
        return None


def _is_show(node: ast.AST) -> bool:
    """A call of zerolab's show: `nb.show(X)` (`zerolab.course.nb.show(X)`) or a bare `show(X)`;
    not pyplot's `plt.show()`."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id == "show"
    return (isinstance(f, ast.Attribute) and f.attr == "show"
            and getattr(f.value, "attr", getattr(f.value, "id", None)) == "nb")


def _shows(node: ast.AST) -> bool:
    """Does `node` show code: a call of zerolab's show, or of a difflib diff?"""
    return any(_is_show(n) for n in ast.walk(node)) or bool(_called(node) & DIFF_CALLS)


def shows_code(source: str) -> bool:
    """Does this code cell show the package's code: a show(...) call or a diff?"""
    tree = _parse(source)
    return tree is not None and _shows(tree)


def _imports(tree: ast.Module | None) -> list[ast.stmt]:
    return [n for n in (tree.body if tree else []) if isinstance(n, (ast.Import, ast.ImportFrom))]


class _Capture:
    """Stands in for IPython.display.display: formats each object as a kernel would."""

    def __init__(self):
        from IPython.core.formatters import DisplayFormatter
        self.formatter = DisplayFormatter()
        self.outputs: list[dict] = []

    def __call__(self, *objs, **kwargs):
        for obj in objs:
            data, _ = self.formatter.format(obj)
            data = {k: data[k] for k in sorted(data) if k in KEPT_MIME}    # nbformat's key order
            if data:
                self.outputs.append({"data": data, "metadata": {}, "output_type": "display_data"})


@contextlib.contextmanager
def _captured_display():
    import IPython.core.display_functions as functions
    import IPython.display as display_module
    capture = _Capture()
    saved = display_module.display, functions.display
    display_module.display = functions.display = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()):     # a cell's prints are not kept
            yield capture
    finally:
        display_module.display, functions.display = saved


def _lines(text: str) -> list[str]:
    """nbformat's form of a multiline string: a list of lines, each with its newline."""
    return text.splitlines(keepends=True)


def recompute(import_lines: list[ast.stmt], source: str) -> list[dict]:
    """The display outputs of a shown cell (nbformat dicts), from its source alone."""
    tree = _parse(source)
    body = tree.body
    last = max(i for i, stmt in enumerate(body) if _shows(stmt) or _called(stmt) & DISPLAY_CALLS)
    launches = set().union(*map(_called, body[:last + 1])) & LAUNCH_CALLS
    if launches:
        raise NotRecomputable(f"it calls {', '.join(sorted(launches))} before its last show")
    namespace: dict = {"__name__": "__shown__"}
    with _captured_display() as capture:
        for stmt in import_lines:
            try:
                exec(compile(ast.Module([stmt], []), "<imports>", "exec"), namespace)  # noqa: S102
            except ImportError:             # (a helper of the repo that is not importable here)
                pass
        try:
            cell = compile(ast.Module(body[:last + 1], []), "<cell>", "exec")
            exec(cell, namespace)           # noqa: S102 - the cell's statements up to its show
        except Exception as err:  # noqa: BLE001 - any failure means: not recomputable alone
            hint = "; show a name the notebook imports" if isinstance(err, NameError) else ""
            raise NotRecomputable(f"{type(err).__name__}: {err}{hint}") from None
    outputs = capture.outputs
    if not outputs:
        raise NotRecomputable("it displays nothing")
    for out in outputs:
        for mime, text in out["data"].items():
            if any(place in text for place in MACHINE) or ADDRESS.search(text):
                raise NotRecomputable(f"its {mime} output is machine-specific (an absolute path, "
                                      "an installed file or a memory address)")
            out["data"][mime] = _lines(text)
    return outputs


def _joined(outputs: list[dict]) -> list[dict]:
    """Outputs with every list of lines joined, to compare regardless of how they were split."""
    def join(v):
        return "".join(v) if isinstance(v, list) else v
    return [{**o, "data": {k: join(v) for k, v in o.get("data", {}).items()}}
            if "data" in o else o for o in outputs]


def process(nb: dict, name: str) -> list[str]:
    """Tag and refresh the shown cells of `nb` in place; return the problems found (a cell that
    was untagged, stale or not recomputable), each as one line naming the cell."""
    problems, import_lines = [], []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tree = _parse(source)
        import_lines += _imports(tree)
        tags = cell.get("metadata", {}).get("tags", [])
        where = f"{name} cell {i}"
        if not shows_code(source):
            if TAG in tags:
                problems.append(f"{where}: tagged {TAG} but shows no code")
                tags.remove(TAG)
                if not {nb_policy.TAG, nb_policy.KEEP_TAG, nb_policy.FIGURE_TAG} & set(tags):
                    cell["outputs"], cell["execution_count"] = [], None
            continue
        try:
            outputs = recompute(import_lines, source)
        except NotRecomputable as err:
            problems.append(f"{where}: its shown code cannot be made without running the "
                            f"notebook ({err})")
            continue
        if TAG not in tags:
            problems.append(f"{where}: shows code but is not tagged {TAG}")
            tags = cell.setdefault("metadata", {})["tags"] = [*tags, TAG]
        kept = [o for o in cell["outputs"] if o.get("output_type") != "display_data"] \
            if nb_policy.TAG in tags or nb_policy.KEEP_TAG in tags else []
        new = outputs + kept
        if _joined(cell["outputs"]) != _joined(new):
            if not any(p.startswith(where + ":") for p in problems):
                problems.append(f"{where}: its committed output differs from the code it shows now")
            cell["outputs"] = new
        cell["execution_count"] = 1
    return problems


def main(argv: list[str]) -> int:
    write = "--write" in argv
    check = "--check" in argv
    paths = [a for a in argv if not a.startswith("--")]
    if write == check or not paths:
        print("usage: nb_shown.py (--write | --check) NOTEBOOK...", file=sys.stderr)
        return 2
    found = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        nb = json.loads(text)
        before = copy.deepcopy(nb)
        problems = process(nb, path)
        if write:
            if nb != before:
                Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
            found += [p for p in problems if "cannot be made" in p]
        else:
            found += problems
    if found:
        print("\n".join(found))
        if check:
            print(f"({FIX})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
