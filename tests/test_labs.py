"""Labs' parameter checks and the launcher's handling of interrupts and signals.

A lab (and `zerolab labs -p ...`) must stop on a bad parameter with one line naming it, before
any process starts; interrupting a launch (Ctrl-C in a notebook kernel) must stop every rank.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import sigint_default
from zerolab.course.labs import LabParameterError, check_parameters


@pytest.mark.parametrize("params, named", [
    ({"nproc": 0}, "nproc = 0"),
    ({"nproc": "4"}, "'4'"),
    ({"nproc": True}, "True"),
    ({"stages": "0,5"}, "5"),
    ({"stages": [0, "x"]}, "'x'"),
    ({"preset": "huge"}, "'huge'"),
    ({"steps": 0}, "steps = 0"),
    ({"nproc": 4, "backend": "nccl", "device": "cuda", "gpus": 1}, "4"),
    ({"backend": "mpi"}, "'mpi'"),
    ({"world_sizes": [1, 0]}, "0"),
    ({"colour": "red"}, "colour"),
])
def test_bad_lab_parameter_is_one_line_naming_it(params, named):
    with pytest.raises(LabParameterError) as err:
        check_parameters(**{"gpus": 0, **params})
    message = str(err.value)
    assert named in message and "\n" not in message


def test_lab7_model_parameter_is_one_line_naming_it():
    """Lab 7's own parameter: a model its demo does not have stops the lab in one line."""
    from zerolab.course import wrappers
    assert wrappers.check_model("cnn") == "cnn"
    for bad in ("resnet50", None, ["cnn"]):
        with pytest.raises(LabParameterError) as err:
            wrappers.check_model(bad)
        assert repr(bad) in str(err.value) and "transformer" in str(err.value)
        assert "\n" not in str(err.value)


LAB9 = dict(muon_world_sizes=[2, 4], layouts=["owner", "a2a", "replicate"], preset="tiny", steps=4,
            muon_link_gbps=1.0, link_latency_us=100.0, out=None)


@pytest.mark.parametrize("change, named", [
    ({"muon_world_sizes": [1, 4]}, "muon_world_sizes = [1, 4] must be a list of integers 2-8"),
    ({"muon_world_sizes": "2,4"}, "muon_world_sizes = '2,4'"),
    ({"layouts": ["owner", "zero3"]}, "layouts = ['owner', 'zero3'] must be a list of owner, a2a, replicate"),
    ({"steps": 2}, "steps = 2 must be >= 3"),
    ({"muon_link_gbps": 0}, "muon_link_gbps = 0 must be a number > 0"),
    ({"link_latency_us": -1.0}, "link_latency_us = -1.0 must be a number >= 0"),
    ({"preset": "huge"}, "'huge'"),
])
def test_lab9_parameters_are_one_line_naming_the_bad_one(change, named):
    from zerolab.course import wholematrix
    with pytest.raises(LabParameterError, match=None) as err:
        wholematrix.lab_parameters(**{**LAB9, **change})
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)
    p, sizes, layouts = wholematrix.lab_parameters(**{**LAB9, "layouts": "owner, a2a",
                                                      "muon_world_sizes": 3})
    assert (p.nproc, sizes, layouts) == (3, [3], ["owner", "a2a"])


def test_good_lab_parameters_resolve_to_cpu_gloo_without_gpus():
    p = check_parameters(nproc="auto", stages=[0, 3], preset="nano", steps=2, gpus=0)
    assert (p.nproc, p.backend, p.device, p.stage_list) == (2, "gloo", "cpu", [0, 3])
    assert p.batch_size % p.nproc == 0


def test_zerolab_labs_refuses_a_bad_override_before_running_any_lab(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "zerolab", "labs", "--out", str(tmp_path / "o"),
                           "-p", "nproc=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nproc = 0" in proc.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    assert time.monotonic() - t0 < 60          # no papermill kernel was started


def _train_pids(marker: str) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if "zerolab.run.train" in line and marker in line]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig, says", [(signal.SIGINT, "interrupted"),
                                       (signal.SIGTERM, "terminated"), (signal.SIGKILL, None)])
def test_interrupt_stops_every_rank(tmp_path, sig, says):
    """SIGINT to the launching process (what Jupyter's interrupt sends to a kernel) or SIGTERM
    ends the run with a LaunchError saying so; SIGKILL gives the launcher no chance to speak, and
    still no rank may remain (the kernel asks Linux to signal torchrun when its parent dies)."""
    out = tmp_path / "interrupted"
    script = textwrap.dedent(f"""
        from zerolab.run.launch import LaunchError, run_torchrun
        try:
            run_torchrun(["--stages", "0", "--preset", "nano", "--steps", "100000",
                          "--no-allocator", "--out", {str(out)!r}], 2, timeout=170)
        except LaunchError as err:
            print("LAUNCH ERROR:", str(err).splitlines()[0], flush=True)
            raise SystemExit(3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_default)
    seen = []
    for line in proc.stdout:                 # wait until the ranks are training
        seen.append(line)
        if "step 2/" in line:
            break
    assert _train_pids(str(out)), "no rank was running:\n" + "".join(seen)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    if says:
        assert proc.returncode == 3, "".join(seen) + rest
        assert says in rest
    else:
        assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _train_pids(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _train_pids(str(out))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks left running: {left}"
