"""A step's collectives replayed alone: the part of a bench ratio that communication sets.

Idea: a bench ratio (`zerolab bench`, course/bench.py) mixes compute, Python and communication.
Replaying one step's collectives - the same ops, sizes, dtypes and order, on the same process
group, with no model around them - measures the communication by itself. On a CPU machine the
copies and sums gloo does run on the cores the model computes on (2 ranks on 2 cores: no idle
core to overlap into), so their CPU seconds add to the step's whatever the overlap: the
difference between two systems' replayed collectives is a floor under the difference between
their steps wherever the rest of the two steps costs the same. It need not: a ZeRO stage's AdamW
covers 1/N of the elements (torch's AdamW over `small`'s 2.7M fp32 elements takes about 8 ms of
one core, 5 % of a 150 ms step, so about 0.03 of the ratio on 2 ranks), and the two medians are
noisy (on the GPU machine's 16 idle cores ZeRO-1 once measured cpu 0.96 against comm 1.05).
ZeRO-3 moves 1.5x DDP's logical bytes (the notes' 3 x (n-1)/n · 2Ψ against 2 x; on gloo twice,
its reduce_scatter running as an all_reduce), and on `small` with 2 gloo ranks on 2
cores its replayed collectives cost 8-17 % of torch DDP's step CPU more than torch DDP's own
(`comm` 1.08-1.17, docs/measured.md): a ratio to torch DDP
below 1 + (extra collective CPU) / (torch DDP's step CPU) is out of reach there for any ZeRO-3
that issues this schedule - one all_gather per block in forward and in backward, one
reduce_scatter per block - through gloo.

The schedule comes from what the step really issued (`count_traffic`: zerolab's
ledger, torch's c10d ops seen by a dispatch counter). A reduce_scatter replays as gloo runs it (an
in-place all_reduce: zerolab's Comm and gloo's own reduce_scatter both do; on NCCL a real
reduce_scatter). Each op is issued and waited for in turn, so the replay's wall time is the sum
of the latencies (an upper bound on the exposed time); its CPU seconds (the process's, gloo's
threads included) are what the overlap cannot hide on a machine without spare cores.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import theory

# torch 2.13 names them *_single (the *_tensor names warn); older torch: the *_tensor ones
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REPLAYED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def replay(schedule: list[tuple[str, int, torch.dtype]], repeats: int = 7,
           device: torch.device | str = "cpu") -> dict:
    """Issue `schedule` - [(op, numel S of the full tensor, dtype)] in order, on the default group
    - `repeats` times after one untimed pass; return {"wall_s", "cpu_s"} (medians over the
    repeats, seconds, this rank) and {"ops"}: how many were replayed. An op outside `REPLAYED`
    (all_to_all, say) raises ValueError naming it. Every rank must call it with the same
    schedule (a collective)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    bufs = []
    for op, numel, dtype in schedule:
        if op not in REPLAYED:
            raise ValueError(f"replay: op {op!r} is not replayed; it takes {', '.join(REPLAYED)}")
        if op in ("all_gather", "reduce_scatter"):   # whole chunks, as the strategies pad
            numel = max(n, numel - numel % n)
        full = torch.zeros(numel, dtype=dtype, device=device)
        bufs.append((op, full, full.narrow(0, rank * (numel // n), numel // n).clone()
                     if op in ("all_gather", "reduce_scatter") else None))
    on_gloo = dist.get_backend() == "gloo"
    walls, cpus = [], []
    for k in range(repeats + 1):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for op, full, chunk in bufs:
            if op == "all_reduce" or (op == "reduce_scatter" and on_gloo):
                dist.all_reduce(full)
            elif op == "reduce_scatter":
                _reduce_scatter(chunk, full)
            elif op == "all_gather":
                _all_gather(full, chunk)
            else:
                dist.broadcast(full, 0)
        if k:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "ops": len(bufs)}


def count_traffic(system, x, y) -> tuple[float, int, list | None]:
    """(per-rank ring bytes, collectives, schedule) of one step: torch's systems seen by a c10d
    dispatch counter, zerolab's from its ledger (logical ring bytes: on gloo zerolab issues a
    reduce_scatter as an in-place all_reduce plus a slice, which the counter would count as an
    all_reduce; gloo's own reduce_scatter, which FSDP2 uses, is the same all_reduce underneath).
    schedule: [(op, numel, dtype)] in issue order for `commfloor.replay`; None when an op ran on
    a group smaller than the world (not replayed)."""
    comm = system.strategy.comm if system.strategy is not None else system.comm
    n = dist.get_world_size()
    if comm is not None:                    # zerolab's, and zerolab's behind torch's names
        first = len(comm.records)
        system.step(x, y)
        rows = comm.records[first:]
        schedule = [(r.op, r.numel, getattr(torch, r.dtype.split(".")[1])) for r in rows]
        whole = all(r.group_size == n for r in rows)
        return sum(r.bytes for r in rows), len(rows), schedule if whole else None
    from .demos.fsdp import CollectiveCounter
    with CollectiveCounter() as counter:
        system.step(x, y)
    total, schedule = 0.0, []
    for row in counter.rows:
        size = len(row["group"]) if row["group"] else n
        dtype = getattr(torch, row["dtype"].split(".")[1])
        total += row["numel"] * dtype.itemsize * theory.RING_FACTOR[row["op"]](size)
        if size != n:                       # a subgroup's collective: not replayed
            schedule = None
        elif schedule is not None:
            schedule.append((row["op"], row["numel"], dtype))
    return total, len(counter.rows), schedule


def slowest_replay(per_rank: list) -> dict | None:
    """The replayed collectives' seconds of the slowest rank (None: not replayed)."""
    if any(r is None for r in per_rank):
        return None
    return {"wall_s": max(r["wall_s"] for r in per_rank),
            "cpu_s": max(r["cpu_s"] for r in per_rank), "ops": per_rank[0]["ops"]}


def comm_floor(row: dict, ddp: dict | None) -> float | None:
    """x torch DDP in CPU seconds if everything but the collectives cost what torch DDP's step
    does: 1 + (this system's replayed collectives - torch DDP's) / torch DDP's step CPU."""
    if ddp is None or row["comm_alone"] is None or ddp["comm_alone"] is None:
        return None
    return 1 + (row["comm_alone"]["cpu_s"] - ddp["comm_alone"]["cpu_s"]) / ddp["cpu_median_s"]
