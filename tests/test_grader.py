"""The grader never passes what did not run (issue #23, item 5), and a learner's hanging code is
stopped by the check's own limit (item 3).

Each kind holds the issue's example and members built here; each gives FAIL and one line saying
what happened: the file exited at import (exit(), sys.exit(0), os._exit(0), killed), a rank exited
inside the learner's function, the learner's function never ran or a step was not compared (a
file that rewrites the checker at import), a call hung (on the ranks, or in the judge that grades
without ranks). The learner's code runs in the check's children only (sandbox.py), so none of
these can end the checking process, and no process of a check outlives it.
"""
from __future__ import annotations

import os
import textwrap
import time

import pytest

from conftest import run_zerolab
from zerolab.course.exercises import checker

RIGHT_DDP = ("def all_reduce_bucket(comm, unit, world_size):\n"
             "    unit.grad_flat.div_(world_size)\n"
             "    return comm.all_reduce(unit.grad_flat, what='grads', unit=unit.name, "
             "async_op=True)\n")


def _file(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _one_failure(r, *says):
    assert not r.ok and len(r.lines) == 1, r.text()
    assert "Traceback" not in r.text() and "usual mistakes" not in r.text(), r.text()
    for piece in says:
        assert piece in r.lines[0], r.text()


# --- exited ------------------------------------------------------------------------------------
def test_exit_at_import_is_a_failure_that_says_so(tmp_path):
    """The issue's example on the command line (`exit()` at import: the check exited 0 with no
    verdict), then sys.exit(0), os._exit(0) and a SIGKILL of its own process at import."""
    res = run_zerolab(["check", "zero1", "--impl",
                       _file(tmp_path, "exits.py", "exit()\n\ndef own_gradient(unit):\n"
                             "    return None\n\ndef publish_update(comm, unit):\n"
                             "    return None\n")], timeout=120)
    assert res.returncode == 1 and "\nFAIL\n" in res.stdout, res.stdout + res.stderr
    assert "exits.py exited while it was being imported (exit())" in res.stdout
    cases = {"sys_exit": ("import sys\nsys.exit(0)\n", "exited", "(sys.exit(0))"),
             "os_exit": ("import os\nos._exit(0)\n", "exited", "(exit code 0)"),
             "sigkill": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
                         "was killed", "(killed by SIGKILL)")}
    for stem, (source, verb, how) in cases.items():
        r = checker.run_check("ddp", _file(tmp_path, f"{stem}.py", source + RIGHT_DDP))
        _one_failure(r, f"{stem}.py {verb} while it was being imported {how}", "remove the exit")
        assert r.seconds < 10, r.seconds            # no rank was started


@pytest.mark.timeout(120)
def test_a_rank_that_exits_inside_the_function_is_named(tmp_path):
    """Built here: os._exit(0) inside the learner's function on rank 1 only (the rank ends with
    exit code 0 and no report; the other rank waits for it in a collective)."""
    impl = _file(tmp_path, "exits_on_one_rank.py", """
        import os
        import torch.distributed as dist
        def all_reduce_bucket(comm, unit, world_size):
            if dist.get_rank() == 1:
                os._exit(0)
            unit.grad_flat.div_(world_size)
            return comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True)
    """)
    r = checker.run_check("ddp", impl, nproc=2, timeout=60)
    _one_failure(r, "rank 1 exited inside your all_reduce_bucket (exit code 0)")


# --- never called, not compared -----------------------------------------------------------------
@pytest.mark.timeout(150)
def test_what_did_not_run_is_not_graded(tmp_path):
    """Files that rewrite zerolab or the checker at import, graded in one group of 2 ranks: one
    ends the check's loop after its first step, one keeps its (wrong) function out of the
    strategy, so that zerolab's own runs instead; both passed before."""
    skips = _file(tmp_path, "skips_steps.py", "import zerolab.course.exercises.checker as c\n"
                  "c._any_rank = lambda flag: True\n\n" + RIGHT_DDP)
    never = _file(tmp_path, "never_called.py", """
        import sys, types
        import zerolab.ddp
        class Keep(types.ModuleType):           # the checker's setattr no longer lands
            def __setattr__(self, name, value):
                if name != "all_reduce_bucket":
                    super().__setattr__(name, value)
        sys.modules["zerolab.ddp"].__class__ = Keep
        def all_reduce_bucket(comm, unit, world_size):
            return None
    """)
    short, unrun = checker.run_checks([("ddp", skips), ("ddp", never)], nproc=2, timeout=100)
    _one_failure(short, "ranks 0, 1 compared 1 of the 3 steps with the reference")
    _one_failure(unrun, "your all_reduce_bucket was never called on ranks 0, 1")


# --- hung ----------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_hanging_function_is_stopped_by_the_call_timeout_and_named(tmp_path):
    """The issue's kind: the learner's function never returns (time.sleep(1e6)) on every rank;
    the check stops at --call-timeout with one line naming the function and its line, and no
    process it started is left."""
    flags = tmp_path / "flags"
    flags.mkdir()
    impl = _file(tmp_path, "sleeps.py", f"""
        import os, time
        def all_reduce_bucket(comm, unit, world_size):
            open(os.path.join({str(flags)!r}, str(os.getpid())), "w").close()
            time.sleep(1e6)
    """)
    t0 = time.monotonic()
    r = checker.run_check("ddp", impl, nproc=2, timeout=100, call_timeout=3)
    _one_failure(r, "your all_reduce_bucket did not return within 3 s on rank",
                 "(sleeps.py line 5)", "--call-timeout")
    assert time.monotonic() - t0 < 90
    ranks = {int(f.name) for f in flags.iterdir()}
    assert len(ranks) == 2 and os.getpid() not in ranks
    deadline = time.monotonic() + 3
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _running(pid)], "a rank outlived the check"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_hang_in_the_judge_is_named_too(tmp_path):
    """Built here: exercise (h)'s ring_time spins (`while True: pass`) in the judge, the fork
    that grades without ranks."""
    impl = _file(tmp_path, "spins.py", """
        def ring_time(op, size_bytes, n, link):
            while True:
                pass
    """)
    r = checker.run_check("timing", impl, call_timeout=2)
    _one_failure(r, "your ring_time did not return within 2 s (spins.py line ")
    assert r.seconds < 10
