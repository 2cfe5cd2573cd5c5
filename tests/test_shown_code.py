"""The notebooks show the package's code, and their prose says what the code shown says.

Every `nb.show(X)` of a notebook or lab must name something that exists (the notebook's own
imports, run on their own, resolve X), and the prose just before it - the markdown cell that
introduces the code - may quote the lesson's members only where the code shown holds them: a
quoted unit attribute (`param_shard`, `bucket`, ...) or strategy method (`_open_bucket`, ...)
that the shown source does not contain is prose that no longer matches the code (what notebook
07 had: a constructor described line by line that had become another one).

Members are the names the lesson's files (zerolab/*.py,
loop/, variants/, wholematrix/) assign on a unit or a strategy
(`u.NAME = `, `unit.NAME = `, `self.NAME = `) and the methods their classes define. A quoted
call (`strategy.gathered()`) is the reader's API, not a description of the shown lines, and a
class or module name (`FlatUnit`, `zerolab.sharding`) is not a member: neither is checked.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSON_DIRS = [ROOT / "zerolab", *(ROOT / "zerolab" / g for g in ("loop", "variants", "wholematrix"))]
NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("notebooks/exercises/*.ipynb"),
                    *ROOT.glob("labs/*.ipynb")])
QUOTED = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)(\(\))?`")


def lesson_members() -> set[str]:
    """Unit / strategy attributes assigned in the lesson's files, and their classes' methods."""
    names = set()
    for path in (p for d in LESSON_DIRS for p in d.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for t in targets:
                for sub in ast.walk(t):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id in ("u", "unit", "self")):
                        names.add(sub.attr)
    return {n for n in names if not n.startswith("__")}


def imports(cells) -> list[str]:
    out = []
    for c in cells:
        if c["cell_type"] != "code":
            continue
        try:
            tree = ast.parse("".join(c["source"]))
        except SyntaxError:                 # (a cell with IPython magics)
            continue
        out += [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def shown(source: str) -> list[str]:
    """The first argument of every show(...) / nb.show(...) call in a code cell."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [ast.unparse(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", None)) == "show" and n.args]


def show_cells():
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                targets = shown("".join(cell["source"]))
                if targets:
                    yield path, cells, i, targets


CASES = list(show_cells())


def test_there_are_shows_to_check():
    assert len(CASES) > 40 and len({p for p, *_ in CASES}) > 15


def problems(cells: list[dict]) -> list[str]:
    """What is wrong with a notebook's shows (its cells): a name that resolves to nothing, or
    prose before a show of lesson code that quotes a member the shown code does not hold."""
    members = lesson_members()
    namespace: dict = {}
    for line in imports(cells):
        try:
            exec(line, namespace)           # noqa: S102 - the notebook's own import lines
        except ImportError:                 # (a helper script of the repo: scripts/)
            pass
    found = []
    for i, cell in enumerate(cells):
        targets = shown("".join(cell["source"])) if cell["cell_type"] == "code" else []
        sources, lesson = [], False
        for target in targets:
            try:
                obj = eval(target, namespace)   # noqa: S307 - a dotted name the notebook shows
            except AttributeError as err:
                found.append(f"cell {i}: show({target}) names nothing: {err}")
                continue
            sources.append(inspect.getsource(obj))
            lesson |= Path(inspect.getsourcefile(obj)).parent in LESSON_DIRS
        before = cells[i - 1] if i else None
        if not lesson or not before or before["cell_type"] != "markdown":
            continue
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(sources)))
        for m in QUOTED.finditer("".join(before["source"])):
            name = m.group(1).split(".")[-1]
            if not m.group(2) and name in members and name not in words:
                found.append(f"cell {i - 1} quotes `{m.group(1)}`, which the code it "
                             f"introduces ({', '.join(targets)}) does not hold")
    return found


@pytest.mark.parametrize("path", sorted({p for p, *_ in CASES}),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shown_name_exists_and_the_prose_quotes_what_it_shows(path):
    found = problems(json.loads(path.read_text())["cells"])
    assert not found, "\n".join(found)


def _cell(kind: str, text: str) -> dict:
    return {"cell_type": kind, "source": [text], "metadata": {}}


def test_a_made_up_mismatch_is_found():
    """Members of the kind the test is for, made up: prose describing a bucket above the code
    that holds none, and a show of a method that does not exist; the matching pair passes."""
    imports_cell = _cell("code", "from zerolab import nb\nfrom zerolab.zero3 import ZeRO3")
    said = "Just before a block's backward, `_open_bucket` allocates its `bucket`."
    assert problems([imports_cell, _cell("markdown", said), _cell("code", "nb.show(ZeRO3.hold)")]) \
        == ["cell 1 quotes `_open_bucket`, which the code it introduces (ZeRO3.hold) does not hold",
            "cell 1 quotes `bucket`, which the code it introduces (ZeRO3.hold) does not hold"]
    assert problems([imports_cell, _cell("markdown", said),
                     _cell("code", "nb.show(ZeRO3._open_bucket)")]) == []
    gone = problems([imports_cell, _cell("code", "nb.show(ZeRO3.step_old)")])
    assert len(gone) == 1 and "show(ZeRO3.step_old) names nothing" in gone[0]
