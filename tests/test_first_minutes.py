"""The first minutes of a new user (issue #31): the README's commands typed where a fresh clone
leaves you.

- A command typed in the clone's parent, which holds the checkout `zerolab/` (a folder without
  __init__.py: `python -m` imports it as an empty namespace package, ahead of an editable
  install), trains: every process a launch starts imports the zerolab the command imported
  (`preflight.child_env`). The other member of the kind, made up here: a learner's `torch.py`
  (`zerolab doctor`'s cases below).
  On Python 3.10, which cannot keep the current folder off a child's path, the launch is refused
  in one line instead.
- `zerolab doctor` there names the shadowing entry and the fix, and no longer blames the kernel;
  the expected verdict comes from Python itself (what `python -c` started in the folder finds).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import zerolab
from zerolab.course import doctor
from zerolab.run import launch, preflight

INSTALLED = Path(zerolab.__file__).resolve().parent


def console_script(tmp: Path) -> list[str]:
    """The `zerolab` command as pip installs it (bin/zerolab beside this Python), else a script
    that does what it does: the script's folder, not the current one, is first on sys.path."""
    script = Path(sys.executable).parent / "zerolab"
    if not script.is_file():
        script = tmp / "bin" / "zerolab"
        script.parent.mkdir(exist_ok=True)
        script.write_text("import sys\nfrom zerolab.cli import main\nsys.exit(main())\n")
    return [sys.executable, str(script)]


def zerolab_in(folder: Path, args: list[str], tmp: Path, timeout: float = 150):
    """`zerolab ARGS` typed in `folder`; the whole session is killed on timeout."""
    proc = subprocess.Popen([*console_script(tmp), *args], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"zerolab {' '.join(args)} timed out after {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def found_from(folder: Path, name: str, with_folder: bool = True) -> list[Path]:
    """Where Python started in `folder` finds module `name` (its file, or its folders for a
    package): with the folder first on sys.path, as `python -c` and `python -m` put it, or
    without it (`with_folder=False`)."""
    code = ("import importlib.util, json, sys\n"
            "if sys.argv[2] == '0': del sys.path[0]\n"
            "s = importlib.util.find_spec(sys.argv[1])\n"
            "print(json.dumps([] if s is None else list(s.submodule_search_locations or []) "
            "or [s.origin]))")
    res = subprocess.run([sys.executable, "-c", code, name, str(int(with_folder))], cwd=folder,
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
    assert res.returncode == 0, res.stderr
    return [Path(p).resolve() for p in json.loads(res.stdout)]


def fooled(folder: Path, name: str) -> bool:
    """Python started in `folder` imports `name` from it, and something else without it."""
    first = found_from(folder, name)
    return (any(p == folder or folder in p.parents for p in first)
            and found_from(folder, name, with_folder=False) not in ([], first))


def clone_parent(d: Path) -> Path:
    """The folder `git clone` leaves you in: it holds the checkout, `zerolab/`, whose top has
    no __init__.py."""
    checkout = d / "zerolab"
    (checkout / "zerolab").mkdir(parents=True)
    (checkout / "zerolab" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text('[project]\nname = "zerolab"\n')
    (checkout / "README.md").write_text("# ZeroLab\n")
    return d


# --- 1. the folder a command is typed in -----------------------------------------------------
@pytest.fixture(scope="module")
def beside_the_clone(tmp_path_factory):
    """`zerolab train --preset nano --steps 3 --nproc 2` typed in the clone's parent whose
    `zerolab/` is the bare folder a fresh clone's top is to Python: (result, out folder)."""
    tmp = tmp_path_factory.mktemp("first")
    here = tmp / "here"
    (here / "zerolab").mkdir(parents=True)      # `python -c` there is fooled with an editable
    out = tmp / "out"                           # install (pip install -e), as the README's
    res = zerolab_in(here, ["train", "--preset", "nano", "--steps", "3", "--nproc", "2",
                            "--out", str(out)], tmp)
    return res, out


@pytest.mark.timeout(200)
def test_a_command_typed_in_the_clones_parent_trains(beside_the_clone):
    """Both ranks train (before the fix, with the README's editable install: `cannot import
    name 'STRATEGIES' from 'zerolab' (unknown location)` in every rank)."""
    res, out = beside_the_clone
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cannot import name" not in res.stdout + res.stderr
    ranks = [json.loads((out / "stage0" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(len(r["losses"]) == 3 for r in ranks)


def test_on_python_310_a_shadowing_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    """Without PYTHONSAFEPATH (3.10) the ranks would import the folder's torch.py: `run`
    refuses in one line naming it, and nothing is started (the marker is never written)."""
    (tmp_path / "torch.py").write_text("raise ImportError('the torch.py of the current folder')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(preflight, "SAFE_PATH", False)
    marker = tmp_path / "started"
    with pytest.raises(ValueError) as err:
        launch.run([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], timeout=30, echo=None)
    line = str(err.value)
    assert "\n" not in line and "torch.py" in line and str(tmp_path) in line
    assert "cd to another folder" in line and not marker.exists()


# --- `zerolab doctor` names what shadows what --------------------------------------------------
FOLDERS = {        # a folder's entries -> the module names to ask Python about
    "the clone's parent": (clone_parent, ["zerolab"]),
    "a learner's torch.py": (lambda d: (d / "torch.py").write_text("x = 1\n"), ["torch"]),
    "a stray zerolab.py": (lambda d: (d / "zerolab.py").write_text("x = 1\n"), ["zerolab"]),
    "a scratch random.py": (lambda d: (d / "random.py").write_text("x = 1\n"), ["random"]),
    "notes and data only": (lambda d: ((d / "notes.txt").write_text("mine"),
                                       (d / "data").mkdir()), ["notes", "data"]),
}


@pytest.mark.parametrize("case", FOLDERS)
def test_doctor_names_the_entry_that_shadows_a_module_and_the_fix(case, tmp_path):
    make, names = FOLDERS[case]
    here = tmp_path / "here"
    here.mkdir()
    make(here)
    shadowed = [n for n in names if fooled(here, n)]
    ok, line = doctor.check_here(here)
    assert ok == (not shadowed), line
    if shadowed:
        assert str(here) in line and "cd " in line, line
        if "zerolab" in shadowed:
            assert f"zerolab is found at {INSTALLED}" in line, line
    if case == "the clone's parent" and shadowed:
        assert f"cd {here / 'zerolab'} (the checkout's root" in line, line


@pytest.mark.timeout(200)
def test_doctor_in_the_clones_parent_blames_the_folder_not_the_kernel(tmp_path):
    here = clone_parent(tmp_path / "here")
    res = zerolab_in(here, ["doctor"], tmp_path, timeout=180)
    fixes = [ln for ln in res.stdout.splitlines() if ln.startswith("FIX")]
    assert res.returncode == 1 and len(fixes) == 1, res.stdout + res.stderr
    assert fixes[0].startswith(f"FIX  the current folder {here} holds zerolab/"), fixes
    assert f"cd {here / 'zerolab'}" in fixes[0], fixes
    assert any(ln.startswith("OK") and "kernel 'python3'" in ln for ln in res.stdout.splitlines())
    assert any(ln.startswith("OK") and "gloo ranks started" in ln for ln in res.stdout.splitlines())
