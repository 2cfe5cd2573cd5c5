"""The four collectives ZeRO is built from, on tiny tensors whose every value can be read.

Idea (notebook 03): rank r starts from x_r = [10r, 10r + 1, ..., 10r + S - 1] (S = 2N elements,
fp32) and runs all_reduce, reduce_scatter, all_gather and broadcast through `zerolab.comm.Comm`,
so the ledger records each call with its per-rank ring bytes. It then checks that
reduce_scatter followed by all_gather gives exactly what all_reduce gives, and (optionally)
times each op on a larger array to show algbw / busbw - and that gloo's reduce_scatter costs
about as much time as its all_reduce, because on gloo it *is* an all_reduce plus a local slice.
Each rank writes OUT/rank{r}.json: inputs, outputs, ledger records, timings.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m zerolab.course.demos.collectives --out runs/collectives --timing-numel 262144
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from ...comm import Comm
from .rankfiles import write_rank_json

TIMED_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def small_demo(comm: Comm) -> tuple[dict, dict]:
    """Run each collective once on x_r = 10r + [0, 1, ..., 2N-1]; return (inputs, outputs)."""
    r, n = comm.rank, comm.world_size
    x = 10.0 * r + torch.arange(2 * n, dtype=torch.float32)             # [S] = [2N] fp32
    chunk = x.numel() // n                                               # S/N elements a rank
    outputs = {}
    # --- all_reduce: every rank ends with the element-wise sum -------------------------------
    ar = x.clone()
    comm.all_reduce(ar, what="demo", unit="all_reduce")
    outputs["all_reduce"] = ar.tolist()
    # --- reduce_scatter: the same sum, but rank r keeps only chunk r -------------------------
    rs = torch.empty(chunk)
    comm.reduce_scatter(rs, x.clone(), what="demo", unit="reduce_scatter")
    outputs["reduce_scatter"] = rs.tolist()
    # --- all_gather: every rank contributes its chunk r of x; everyone gets the concatenation -
    mine = x[r * chunk:(r + 1) * chunk].clone()                          # [S/N]
    ag = torch.empty(x.numel())
    comm.all_gather(ag, mine, what="demo", unit="all_gather")
    outputs["all_gather"] = ag.tolist()
    # --- broadcast: rank 0's x everywhere ------------------------------------------------------
    bc = x.clone()
    comm.broadcast(bc, 0, what="demo", unit="broadcast")
    outputs["broadcast"] = bc.tolist()
    # --- reduce_scatter then all_gather == all_reduce ----------------------------------------
    both = torch.empty(x.numel())
    comm.all_gather(both, rs, what="demo", unit="rs+ag")
    outputs["reduce_scatter+all_gather"] = both.tolist()
    inputs = {"x": x.tolist(), "all_gather_input": mine.tolist()}
    return inputs, outputs


def timing_demo(comm: Comm, numel: int, repeats: int) -> dict:
    """Time each op on an fp32 array of `numel` elements (S = 4·numel bytes); median seconds."""
    n = comm.world_size
    numel = max(n, numel // n * n)
    full, part = torch.ones(numel), torch.ones(numel // n)
    calls = {"all_reduce": lambda: comm.all_reduce(full, what="timing", unit="all_reduce"),
             "reduce_scatter": lambda: comm.reduce_scatter(part, full, what="timing",
                                                           unit="reduce_scatter"),
             "all_gather": lambda: comm.all_gather(full, part, what="timing", unit="all_gather")}
    out = {}
    for op in TIMED_OPS:
        calls[op]()                                   # warm-up, not counted
        times = []
        for _ in range(repeats):
            dist.barrier()
            record = calls[op]().record
            comm.settle()                             # its own duration (comm.TIME_SOURCES)
            times.append(record.time_s)
        out[op] = {"numel": numel, "size_bytes": numel * 4, "median_s": statistics.median(times)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zerolab.course.demos.collectives", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/collectives")
    p.add_argument("--timing-numel", type=int, default=0, help="elements of the timed array (0: skip)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        comm = Comm()
        inputs, outputs = small_demo(comm)
        timing = timing_demo(comm, args.timing_numel, args.repeats) if args.timing_numel > 0 else {}
        result = {"rank": comm.rank, "world_size": comm.world_size, "backend": dist.get_backend(),
                  "inputs": inputs, "outputs": outputs, "timing": timing,
                  "records": comm.to_json()}
        write_rank_json(args.out, comm.rank, result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ...run.rank import rank_entry
    rank_entry(main)
