"""Shared test helpers: run a worker function on N gloo CPU ranks, each in its own process; the
toy models the tests train.

The runner, the models and the batches live in `zerolab.course.testing`, so that the exercise checker
(`zerolab check`) grades a learner's code with the same ones. `run_ranks(worker, world_size,
*args)` starts `world_size` processes, initialises a gloo process group over a free TCP port,
calls `worker(rank, world_size, *args)` on every rank and returns the ranks' return values as a
list indexed by rank. If any rank raises, the others are stopped and the test fails showing every
rank's traceback; after `timeout` seconds every rank dumps its Python stack, all are killed, and
the test fails showing where each one was stuck.

`worker` must be a module-level function (it is pickled by name); test modules are importable
in the children because pytest puts tests/ on sys.path and multiprocessing passes sys.path on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from zerolab.course import testing
from zerolab.course.testing import (Bias3, CondToy, OddToy, TiedToy, ToyBlock,  # noqa: F401
                                    _context, free_port, global_batch, make_model,
                                    vocab_and_context)


def run_ranks(worker, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `worker(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank."""
    try:
        return testing.run_ranks(worker, world_size, *args, timeout=timeout, preload=["conftest"])
    except testing.RanksFailed as err:
        pytest.fail(str(err), pytrace=False)


def case_results(ranks, case) -> list[dict]:
    """Case `case` of every rank's {case: result} (a worker that ran several cases), failing
    with the traceback of a rank on which it raised ({"error": traceback})."""
    out = [r[case] for r in ranks]
    for rank, r in enumerate(out):
        assert "error" not in r, f"{case} raised on rank {rank}:\n{r['error']}"
    return out


def run_zerolab(args: list[str], timeout: float = 150, cmd=None,
                cwd=None) -> subprocess.CompletedProcess:
    """`python -m zerolab ARGS` (or `cmd` ARGS, typed in `cwd`) in its own session; the whole
    session is killed on timeout."""
    proc = subprocess.Popen([*(cmd or [sys.executable, "-m", "zerolab"]), *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"zerolab {' '.join(args)} timed out after {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def sigint_default():
    """Popen's preexec_fn for a child that must react to Ctrl-C: SIGINT back to its default.
    A shell without job control (a CI script started in the background, `cmd &`) starts its
    children with SIGINT ignored, they inherit it, and Python then installs no KeyboardInterrupt
    handler: the child would sleep through the SIGINT a test sends, as a terminal's or Jupyter's
    process never does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
