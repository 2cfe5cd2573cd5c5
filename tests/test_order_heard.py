"""Every rank hears the one line: a rank that proves the ranks out of step posts its line to the
group's store and waits (a few seconds at most) until the others read it, so each rank raises
the same line within seconds whether the proving rank then exits, goes on, or sleeps. A store
that stops answering (its host, rank 0, left) is read as a peer that left.

The kind is every check that compares ranks. The cases: the mixture of experts whose experts run
in the order of each rank's tokens (ZeRO-3, one expert per unit: the stall comparison and the
"called again or out of order" confirm), a rank that runs an extra micro-step (DDP: the step's
confirm and the forward-pass counts), and one made up here: rank 0 alone runs a validation
forward through ZeRO-3 (`if rank == 0: strategy.forward(val)`, as logging code does), whose
gathers the other rank never issues. The threaded process group (torch's FSDP2 tests) cannot
wait with a timeout: the order check is off there, said once, and the loop still runs.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import run_ranks
from test_order import MICRO, MoE, MoEToy, batch
from zerolab.course.testing import LR, WD

SLEEP_S = 6
MODES = ("exit", "continue", "sleep")      # what the rank that proved the fault does next
CASES = ("zero3-experts", "ddp-extra-micro", "zero3-rank0-validates")


def loop(s, case, rank):
    for step in range(2):
        if case == "ddp-extra-micro":
            for m in range(MICRO + (rank == 0 and step == 0)):
                s.backward(s.forward(*batch(10 * step + m, rank)) / MICRO)
        else:
            if case == "zero3-rank0-validates" and rank == 0 and step == 1:
                with torch.no_grad():
                    s.forward(*batch(99, rank))
            s.backward(s.forward(*batch(step, rank)))
        s.step()


def heard_worker(rank, n, case, mode, folder):
    from zerolab import make_strategy, set_leaf_modules
    from zerolab.comm import Comm
    torch.manual_seed(0)
    model = MoEToy()
    if case != "zero3-experts":
        set_leaf_modules(model, [MoE])
    s = make_strategy(0 if case.startswith("ddp") else 3, model, Comm(), lr=LR, weight_decay=WD,
                      find_unused_parameters=True)
    t0 = time.perf_counter()
    try:
        loop(s, case, rank)
        out = {"after_s": time.perf_counter() - t0}
    except RuntimeError as e:
        out = {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0,
               "proved": bool(getattr(e, "proved", False))}
    Path(folder, f"{rank}.json").write_text(json.dumps(out))
    if out.get("proved"):
        if mode == "exit":                  # the store (hosted by rank 0) goes with it
            os._exit(0)
        if mode == "sleep":
            time.sleep(SLEEP_S)
        if mode == "continue":              # a loop that retries the step
            try:
                loop(s, case, rank)
            except RuntimeError as e:
                out["retry"] = f"{type(e).__name__}: {e}"
                Path(folder, f"{rank}.json").write_text(json.dumps(out))
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_rank_raises_the_same_line_within_seconds(case, mode, tmp_path):
    t0 = time.perf_counter()
    run_ranks(heard_worker, 2, case, mode, str(tmp_path), timeout=90)
    wall = time.perf_counter() - t0
    said = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    print(case, mode, [(round(r["after_s"], 1), r.get("proved"), r.get("error", "")[:60])
                       for r in said], f"wall {wall:.1f}")
    lines = {r.get("error") for r in said}
    assert len(lines) == 1 and None not in lines, said
    line = lines.pop()
    assert line.startswith("CollectiveOrderError") and "\n" not in line, line
    assert all(r["after_s"] < 10 for r in said), said
    if mode == "sleep":                     # the others did not wait for the sleeper
        assert min(r["after_s"] for r in said) < SLEEP_S, said
    if mode == "continue":                  # the retry hears the same line at once
        prover = [r for r in said if r["proved"]]
        assert prover and prover[0]["retry"] == line, said


def left_worker(rank, n, folder):
    """Rank 0 (the store's host) leaves in step 1 without a word; rank 1 waits in a collective."""
    from zerolab import make_strategy
    from zerolab.comm import Comm
    torch.manual_seed(0)
    s = make_strategy(3, MoEToy(), Comm(), lr=LR, weight_decay=WD, find_unused_parameters=True)
    t0 = time.perf_counter()
    try:
        for step in range(2):
            if step == 1 and rank == 0:
                os._exit(0)
            s.backward(s.forward(*batch(step, 0)))
            s.step()
    except RuntimeError as e:
        Path(folder, f"{rank}.json").write_text(json.dumps(
            {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0}))


def test_a_store_that_vanishes_is_read_as_a_peer_that_left(tmp_path):
    run_ranks(left_worker, 2, str(tmp_path), timeout=90)
    said = json.loads((tmp_path / "1.json").read_text())
    assert said["error"].startswith("PeerLeftError: a peer of rank 1 left while it waited in "), said
    assert "\n" not in said["error"] and said["after_s"] < 15, said


THREADED = """
import copy, threading, warnings, torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg
from zerolab.torchlike import fully_shard
out, errs = {}, {}
_install_threaded_pg()
store = dist.HashStore()
torch._C._distributed_c10d._set_thread_isolation_mode(True)
torch.manual_seed(0)                    # built once: the ranks are threads of one process, and
INIT = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # share its global RNG
def model():
    return copy.deepcopy(INIT)
def batch(step, rank):
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
def worker(rank):
    try:
        dist.init_process_group(backend="threaded", rank=rank, world_size=2, store=store)
        m = model()
        for part in (m[0], m[2], m):
            fully_shard(part)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):
            m(batch(step, rank)).square().mean().backward()
            opt.step(); opt.zero_grad()
        out[rank] = {k: v.detach().clone() for k, v in m.full_state_dict().items()}
    except BaseException as e:
        errs[rank] = repr(e)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    [t.start() for t in threads]; [t.join(60) for t in threads]
ref = model()                                   # torch alone, the two ranks' batches averaged
opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for step in range(2):
    sum(ref(batch(step, r)).square().mean() / 2 for r in range(2)).backward()
    opt.step(); opt.zero_grad()
diff = max((out[r][k] - v).abs().max().item() for r in out for k, v in ref.state_dict().items())
print(repr(errs), len(out), diff, [str(w.message) for w in said if "zerolab.loop.order" in str(w.message)])
"""


def test_the_threaded_process_group_runs_with_the_order_check_off_said_once():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", THREADED], capture_output=True, text=True,
                         timeout=120)
    errs, ranks, diff, said = run.stdout.strip().splitlines()[-1].split(" ", 3)
    assert errs == "{}" and ranks == "2" and float(diff) <= 1e-6, run.stdout + run.stderr
    assert said.count("Work.wait() takes no timeout") == 1, said
