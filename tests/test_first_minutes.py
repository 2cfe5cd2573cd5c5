"""The first minutes of a new user (issue #31): the README's commands typed where a fresh clone
leaves you, a run that will take long, more ranks than cores.

- A command typed in the clone's parent, which holds the checkout `zerolab/` (a folder without
  __init__.py: `python -m` imports it as an empty namespace package, ahead of an editable
  install), trains: every process a launch starts imports the zerolab the command imported
  (`preflight.child_env`). The other member of the kind, made up here: a learner's `torch.py`
  (a Slurm job's submit folder holds one in tests/test_slurm.py; `zerolab doctor`'s cases below).
  On Python 3.10, which cannot keep the current folder off a child's path, the launch is refused
  in one line instead.
- `zerolab doctor` there names the shadowing entry and the fix, and no longer blames the kernel;
  the expected verdict comes from Python itself (what `python -c` started in the folder finds).
- Before a run on CPU one line says what it will cost and, when long, how to shorten it; after
  the first step one line says what the whole will take at that pace. Far more ranks than cores
  are refused in one line naming the cores and the accepted range; somewhat more are warned of.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zerolab
from conftest import run_zerolab
from zerolab import cli
from zerolab.course import doctor
from zerolab.run import job, launch, options, preflight

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
    return run_zerolab(args, timeout, cmd=console_script(tmp), cwd=folder)


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


def checkout_root(d: Path) -> Path:
    """The root of a checkout other than the installed one (a second clone)."""
    (d / "zerolab").mkdir(parents=True)
    (d / "zerolab" / "__init__.py").write_text("")
    (d / "pyproject.toml").write_text('[project]\nname = "zerolab"\n')
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


@pytest.mark.timeout(60)
def test_the_rendezvous_probe_recognises_a_store_from_a_folder_holding_torch_py(tmp_path,
                                                                               monkeypatch):
    """Another process a launch starts: the probe that tells a torch rendezvous store from
    another program on --rdzv-endpoint's port (a `python -c` that imports torch). Typed in a
    folder holding a learner's torch.py, a real store is still recognised (before: the probe
    imported torch.py, failed, and the endpoint was refused as held by another program)."""
    import datetime

    import torch.distributed as dist
    from zerolab.course.testing import free_port
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    (tmp_path / "torch.py").write_text("raise ImportError('the torch.py of the current folder')\n")
    monkeypatch.chdir(tmp_path)
    assert preflight.check_rdzv_endpoint(f"127.0.0.1:{port}", probe_seconds=20) == ("127.0.0.1", port)
    del store


# --- `zerolab doctor` names what shadows what --------------------------------------------------
FOLDERS = {        # a folder's entries -> the module names to ask Python about
    "the clone's parent": (clone_parent, ["zerolab"]),
    "a learner's torch.py": (lambda d: (d / "torch.py").write_text("x = 1\n"), ["torch"]),
    "a stray zerolab.py": (lambda d: (d / "zerolab.py").write_text("x = 1\n"), ["zerolab"]),
    "another checkout's root": (lambda d: checkout_root(d), ["zerolab"]),
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
    if case == "another checkout's root" and shadowed:
        assert f"pip install -e {here} to use this checkout" in line, line


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


# --- 3. what a run will cost, and more ranks than cores ----------------------------------------
def test_what_the_run_will_cost_is_said_before_and_after_its_first_step(beside_the_clone):
    """Before: one line with the estimate. After step 1: one line whose numbers are the rank's
    own step time x the steps left (2 of 3), as rank 0 printed it."""
    res, _ = beside_the_clone
    lines = res.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("[stage 0] step 1/3"))
    before = [ln for ln in lines[:first] if ln.startswith("zerolab: about ")]
    assert len(before) == 1 and "the first step tells" in before[0], lines[:first]
    ms = int(re.search(r"(\d+) ms$", lines[first]).group(1))
    pace = lines[first + 1]
    assert pace.startswith(f"zerolab: step 1 took {job.format_seconds(ms / 1e3)};"), pace
    assert f"the 2 step(s) left take ~{job.format_seconds(2 * ms / 1e3)}," in pace, pace


def test_the_estimate_is_near_the_measured_step_time(beside_the_clone):
    """The estimate's step (cost model FLOPs at this machine's measured speed) is within a
    factor of 5 of the steps the ranks measured (the middle ones: the first warms up, the last
    cross-checks memory)."""
    res, out = beside_the_clone
    measured = json.loads((out / "stage0" / "rank0.json").read_text())["step_times_s"][1]
    said = re.search(r"step\(s\) of ~(\S+) (s|min)", res.stdout)
    assert said, res.stdout
    est = float(said.group(1)) * (60 if said.group(2) == "min" else 1)
    assert measured / 5 < est < measured * 5, (est, measured)


@pytest.mark.parametrize("preset, steps, long", [("gpt2", "50", True), ("nano", "5", False)])
def test_a_long_run_is_told_how_to_be_shorter(preset, steps, long):
    """(gpt2 for 50 steps: minutes on any laptop; at its default 5 steps the estimate, from this
    machine's measured speed, came to 100 s on a fast idle core, near the 120 s line.)"""
    args = options.parser("train").parse_args(["--preset", preset, "--nproc", "2",
                                               "--steps", steps])
    line = job.estimate(args, "cpu")
    seconds = job.estimate_seconds(options.model_config(args), steps=args.steps, stages=1,
                                         batch_size=args.batch_size, nproc=2)["total"]
    assert (seconds > job.LONG) == long, seconds
    assert ("shorter: --steps" in line and "--preset small" in line) == long, line


def test_far_more_ranks_than_cores_are_refused_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("a launch started"))
    cores = len(os.sched_getaffinity(0))
    nproc = preflight.MAX_PER_CORE * cores + 1
    code = cli.main(["train", "--preset", "nano", "--nproc", str(nproc), "--batch-size",
                     str(nproc), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert (f"--nproc {nproc} " in err[0] and f"{cores} core(s)" in err[0]
            and f"--nproc 1-{preflight.MAX_PER_CORE * cores} is accepted" in err[0]), err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_ranks_per_core_quiet_then_warned_then_refused(cores):
    quiet, most = preflight.QUIET_PER_CORE * cores, preflight.MAX_PER_CORE * cores
    for nproc in (1, quiet):
        assert preflight.check_cores(nproc, cores=cores) == "", nproc
    for nproc in (quiet + 1, most):
        line = preflight.check_cores(nproc, cores=cores)
        assert line and "\n" not in line, nproc
        assert f"--nproc {nproc} " in line and f"{cores} CPU core(s)" in line, line
    with pytest.raises(ValueError, match=rf"--nproc {most + 1} is more than .* {cores} core"):
        preflight.check_cores(most + 1, cores=cores)


@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "150000 100000\n"}, 150000 / 100000),                      # cgroup v2, --cpus 1.5
    ({"cpu.max": "max 100000\n"}, None),                                    # v2, no quota
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 300000 / 100000),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),      # v1, none
    ({}, None),                                                             # no cgroup files
])
def test_a_containers_cpu_quota_is_read_as_cores(tmp_path, files, cores):
    """A container limited with `docker run --cpus` sees every core in its affinity mask; the
    quota in its cgroup (quota / period microseconds) is what its ranks share."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert preflight.cgroup_cpus(str(tmp_path)) == cores


def test_the_pace_is_said_again_at_each_stages_first_step():
    """compare runs DDP first, then slower stages: each stage's first step says the run's time
    again at its own pace (steps left x that stage's step time), the last stage's last step
    says nothing."""
    said = []
    pace = job.Pace(said.append, [0, 3])
    for line in ("[stage 0] step 1/2 loss 4.1 10 ms", "[stage 0] step 2/2 loss 4.0 10 ms",
                 "[stage 3] step 1/2 loss 4.1 40 ms", "[stage 3] step 2/2 loss 4.0 40 ms"):
        pace(line)
    notes = [s for s in said if s.startswith("zerolab: step")]
    assert len(notes) == 2, said
    assert f"the 3 step(s) left take ~{job.format_seconds(0.03)}," in notes[0], notes
    assert f"the 1 step(s) left take ~{job.format_seconds(0.04)}," in notes[1], notes
