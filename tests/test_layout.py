"""The package's shape: the lesson at the top level of zerolab/, the wings it never imports, no
import circles.

The rules are import-linter contracts in pyproject.toml (`lint-imports` checks them): these tests
run it on the package as it is, show that each contract fails when an import breaks it (so a kept
contract means something), and hold docs/package.md's tree and the files' length to the disk.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zerolab"
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(no_cache=True, no_logo=True))")
HOUSE = ("loop -> lesson -> whole-matrix optimizers -> variants -> timing, torchlike -> run -> "
         "course -> cli")   # the layers' contract (pyproject.toml)
MAX_LINES = 450             # the aim is ~400: one concern per file, readable top to bottom


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the contracts of pyproject.toml, on the package found under `root`."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_contracts_hold():
    res = lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "6 kept, 0 broken" in res.stdout, res.stdout


@pytest.fixture
def copy(tmp_path):
    """A copy of the package's code (no data) and of the contracts, to break on purpose."""
    shutil.copytree(PACKAGE, tmp_path / "zerolab",
                    ignore=shutil.ignore_patterns("__pycache__", "reference_runs"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("file, line, broken, says", [
    # the lesson reaching into a wing (what comm -> trace and sharding -> preflight were)
    ("theory.py", "from .run import preflight", HOUSE,
     "zerolab.theory is not allowed to import zerolab.run"),
    # a wing reaching up into a higher one (what train -> report was)
    ("timing/whatif.py", "from ..course import results", HOUSE,
     "zerolab.timing is not allowed to import zerolab.course"),
    # a strategy importing another: the strategies stay independent (diff them, don't chain them)
    ("zero3.py", "from . import zero2", HOUSE,
     "zerolab.zero3 is not allowed to import zerolab.zero2"),
    # a variant reaching into a stage's file (what ZeRO-1/2's offload and gather branches were)
    ("zero2.py", "from .variants import placement", "import no variant",
     "zerolab.zero2 is not allowed to import zerolab.variants"),
    # the loop support reaching up into the lesson that stands on it
    ("loop/guards.py", "from .. import comm", "the loop support (loop/) imports nothing else",
     "zerolab.loop is not allowed to import zerolab.comm"),
    # a whole-matrix optimizer reaching into the variants that build it
    ("wholematrix/wholeopt.py", "from ..variants import compose", "import no variant",
     "zerolab.wholematrix is not allowed to import zerolab.variants"),
    # a circle inside one wing (what labs -> nb -> cli -> labs was)
    ("course/results.py", "from . import plots", "no import circles",
     "It could be made acyclic"),
    # the lesson importing a notebook tool
    ("memory.py", "import matplotlib", "import no plotting", "zerolab.memory is not allowed to import matplotlib"),
])
def test_each_contract_fails_when_an_import_breaks_it(copy, file, line, broken, says):
    path = copy / "zerolab" / file
    text = path.read_text()
    head = text.index("\nfrom __future__ import annotations\n") + 1 if "from __future__" in text else 0
    cut = text.index("\n", head) + 1 if head else 0
    path.write_text(text[:cut] + line + "  # noqa\n" + text[cut:])
    res = lint(copy)
    assert res.returncode != 0, res.stdout
    out = " ".join(res.stdout.split())
    assert f"{broken}" in out and "BROKEN" in out, res.stdout
    assert says in out, res.stdout


def readme_tree() -> set[str]:
    """The folders docs/package.md's tree ("The package's layout") names, as paths from the
    checkout's root."""
    text = (ROOT / "docs" / "package.md").read_text()
    section = text[text.index("## The package"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    folders, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"^([│├└─ ]*)(\S+/)\s", line + " ")
        if not m:
            continue
        depth = len(m.group(1)) // 4
        stack[depth:] = [m.group(2).rstrip("/")]
        folders.add("/".join(stack))
    return folders


def disk_tree() -> set[str]:
    """zerolab/ and every folder inside one of its packages (data folders too), from the disk."""
    out = {"zerolab"}
    for d in PACKAGE.rglob("*"):
        if (d.is_dir() and d.name != "__pycache__" and (d.parent / "__init__.py").exists()
                and not any(p.name == "__pycache__" for p in d.parents)):
            out.add(d.relative_to(ROOT).as_posix())
    return out


def test_readme_tree_matches_the_disk():
    assert readme_tree() == disk_tree()


def test_the_top_of_the_package_is_the_lesson():
    """Only the lesson's modules (and the package's two doors) lie at the top of zerolab/, at most
    15 files; the rest of the lesson is in three folders, each with its map: its __init__'s
    docstring names every module it holds, and the package's docstring names every folder."""
    lesson = {"theory", "model", "data", "comm", "sharding", "optim", "memory", "strategy", "ddp",
              "zero1", "zero2", "zero3", "zero3loop"}
    groups = {"loop": {"guards", "hooks", "order", "leaves", "replicas"},
              "variants": {"zero1rs", "placement", "prefetch", "offload", "quant", "tiers",
                           "hybrid", "loopstep", "compose"},
              "wholematrix": {"wholeopt", "muon_theory", "muon_owner", "muon_a2a",
                              "muon_replicate", "lamb", "factored"}}
    import ast
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert top == lesson and len(top) + 2 <= 15
    doc = (PACKAGE / "__init__.py").read_text()
    assert all(re.search(rf"\b{name}\b", doc) for name in lesson)
    assert all(re.search(rf"\b{group}/", doc) for group in groups)
    for group, modules in groups.items():
        folder = PACKAGE / group
        assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == modules, group
        map_ = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        missing = [m for m in modules if not re.search(rf"^ +{m} ", map_, re.M)]
        assert not missing, f"{group}/__init__.py's map does not name {missing}"


def test_every_optimizer_is_reachable():
    """LAMB, like the Muon layouts, is one import away: `zerolab.wholematrix` exports them."""
    import torch

    from zerolab.wholematrix import Lamb, MuonAllToAll, MuonOwner, MuonReplicate
    assert all(issubclass(c, torch.optim.Optimizer)
               for c in (Lamb, MuonAllToAll, MuonOwner, MuonReplicate))


def test_every_file_stays_readable():
    long = {p.relative_to(ROOT).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_learners_doors_still_open():
    """`from zerolab import nb, theory` (the notebooks' first line) and `python -m zerolab`."""
    res = subprocess.run([sys.executable, "-c", "from zerolab import nb, theory; "
                          "import sys; print(nb.__name__, theory.__name__, "
                          "'zerolab.course.nb' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["zerolab.course.nb", "zerolab.theory", "True"], res.stderr
    res = subprocess.run([sys.executable, "-c", "import zerolab, sys; "
                          "print(sorted(m for m in sys.modules if m.startswith('zerolab.')))"],
                         capture_output=True, text=True, timeout=60)
    assert not re.search(r"zerolab\.(course|run|timing|torchlike|cli)", res.stdout), res.stdout
    res = subprocess.run([sys.executable, "-m", "zerolab", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "compare" in res.stdout


def door_imports(package: Path) -> list[str]:
    """`from . import NAME` lines, in any package under `package`, whose NAME is not one of that
    package's modules (so it is something its __init__ defines: an import back through the door)."""
    import ast
    found = []
    for init in package.rglob("__init__.py"):
        folder = init.parent
        modules = {p.stem for p in folder.glob("*.py")} | {d.name for d in folder.iterdir()
                                                           if (d / "__init__.py").exists()}
        for path in folder.glob("*.py"):
            if path.name == "__init__.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                    found += [f"{path.relative_to(package.parent)}: from . import {a.name}"
                              for a in node.names if a.name not in modules]
    return found


def test_no_module_imports_its_own_packages_door():
    """A package's __init__ is its door: it imports its modules, never the other way round (what
    course/exercises was: its checker, hints and track imported EXERCISES from the package's
    __init__, which imports the checker - a circle import-linter's sibling contract does not
    see). So `from . import X` inside a package names one of its modules, never a name its
    __init__ defines."""
    assert not door_imports(PACKAGE), door_imports(PACKAGE)


def test_an_import_back_through_another_door_is_found(copy):
    """Another member of the kind, made up: a torchlike module taking a name from torchlike's
    __init__ (which imports that module)."""
    path = copy / "zerolab" / "torchlike" / "ddp.py"
    path.write_text(path.read_text() + "\nfrom . import fully_shard  # noqa\n")
    assert door_imports(copy / "zerolab") == ["zerolab/torchlike/ddp.py: from . import fully_shard"]
