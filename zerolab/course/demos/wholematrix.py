"""Optimizers that see the whole matrix, on gloo ranks: distributed Muon's three layouts, and
Adafactor on fully_shard's rows (notebook 08b, lab 9).

Part 1, Muon (`--layouts owner,a2a,replicate`): each layout (zerolab/wholematrix/muon_owner.py, muon_a2a.py,
muon_replicate.py) trains the course's GPT (`--preset`, fp32, torch.optim.Muon on the hidden
matrices + AdamW on the rest, muon_param_groups) for `--steps` steps from the same weights on
the same batches, over an emulated link (`--link-gbps`, `--link-latency-us`: every collective
lasts at least the α-β model's time for its bytes, zerolab/timing/linkemu.py). Per rank and
layout it records the ledger's bytes of the last step by collective next to muon_theory's
formula by collective, the Newton-Schulz FLOPs this rank ran (the formula), the bytes held
(optimizer state + the layout's buffers, `held_bytes()`) next to the formula, the step's
transient peak above them (MemTracker), the seconds of each `opt.step()` after the first, the
model's seconds for this rank's collectives on the link (the floor the emulator sleeps to), and
the largest difference of the trained weights to the first layout's.

Part 2, Adafactor (`--adafactor`): a user's 3-layer MLP (7 outputs) under
`zerolab.torchlike.fully_shard`; torch.optim.Adafactor over its shards is refused at its first
step (the message, and whether anything changed); zerolab.torchlike.Adafactor trains 3 steps:
the ledger's bytes of its two all_reduces (what "optim_stats") against factored.stats_bytes,
and the largest difference of the full weights to single-process torch.optim.Adafactor.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m zerolab.course.demos.wholematrix --out runs/wholematrix --adafactor

Every rank writes OUT/rank{r}.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .rankfiles import write_rank_json

PROGRAM = "zerolab.course.demos.wholematrix"
LAYOUTS = ("owner", "a2a", "replicate")
ADAFACTOR_KW = {"lr": 0.02, "weight_decay": 0.1}     # tests/test_factored.py's: every term runs
ADAFACTOR_STEPS = 3


# --- part 1: Muon's layouts ---------------------------------------------------------------------
def muon_layout(layout, rank, n, args, first=None):
    from ...comm import Comm
    from ...variants.compose import make_muon
    from ...memory import transient_peak
    from ...model import GPT, get_config
    from ...theory import RING_FACTOR
    from ...timing import costmodel, hardware
    from ...timing.linkemu import from_args
    from ...wholematrix.wholeopt import muon_param_groups
    cfg = get_config(args.preset)
    torch.manual_seed(args.seed)
    model, comm = GPT(cfg), Comm()
    comm.all_reduce(torch.ones(1), what="metric")        # gloo connects on the first call
    comm.link = from_args(args.link_gbps, args.link_latency_us, n)
    opt = make_muon(muon_param_groups(model, muon=dict(lr=0.02), adamw=dict(lr=3e-4)), layout,
                    comm=comm)
    g = torch.Generator().manual_seed(1000 + rank)
    times, peak = [], 0
    for step in range(args.steps):
        comm.step = step
        x = torch.randint(0, cfg.vocab_size, (args.rows, cfg.block_size), generator=g)
        model(x, x).backward()
        if step == args.steps - 1:
            _, peak = transient_peak(opt.step, torch.device("cpu"), external=(model, *opt.buffers))
        else:
            t0 = time.perf_counter()
            opt.step()
            if step:                                     # the first step is warm-up
                times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    last = [r for r in comm.records if r.step == args.steps - 1 and r.what in ("grads", "params")]
    sent: dict[str, int] = {}
    for r in last:
        sent[r.op] = sent.get(r.op, 0) + r.bytes
    cost = opt.costs()[rank]
    link = hardware.get_link(gbps=args.link_gbps, latency_us=args.link_latency_us)
    floor = sum(costmodel.collective_time(op, b / RING_FACTOR[op](n), n, link)
                for op, b in cost["bytes"].items() if b)
    held = opt.held_bytes()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"bytes": sent, "formula": {op: b for op, b in cost["bytes"].items() if b},
            "ns_flops": cost["ns_flops"], "held": held["state"] + held["buffers"],
            "held_formula": cost["state_bytes"] + cost["buffer_bytes"], "peak": peak,
            "step_s": times, "link_floor_s": floor,
            "diff_vs_first": 0.0 if first is None else float((params - first).abs().max())}, params


# --- part 2: Adafactor on fully_shard's rows -----------------------------------------------------
def issue_mlp() -> nn.Module:
    """The issue's MLP: 16 -> 32 -> 32 -> 7 (7 output rows: uneven on 2 or 4 ranks)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 7))


def issue_batch(step: int):
    """The global batch of `step`: 8 rows of 16 inputs, 7 targets."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 7, generator=g)


def adafactor_part(rank, n):
    from ... import torchlike as tl
    from ...wholematrix.factored import STATS, stats_bytes
    from ...theory import RING_FACTOR
    # torch's class over the shards: refused at the first step, nothing changed
    model = issue_mlp()
    for m in model[::2]:
        tl.fully_shard(m)
    tl.fully_shard(model)
    opt = torch.optim.Adafactor(model.parameters(), **ADAFACTOR_KW)
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    per = 8 // n
    x, y = issue_batch(0)
    F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
    try:
        opt.step()
        refused = None
    except (ValueError, RuntimeError) as err:
        refused = f"{type(err).__name__}: {err}"
    after = model.full_state_dict()
    changed = max(float((after[k] - v).abs().max()) for k, v in before.items())
    # zerolab's Adafactor over the same shards, against torch's in one process
    model = issue_mlp()
    for m in model[::2]:
        tl.fully_shard(m)
    tl.fully_shard(model)
    opt = tl.Adafactor(model.parameters(), **ADAFACTOR_KW)
    shapes = [tuple(p._zerolab_full_shape) for p in model.parameters()]
    ref = issue_mlp()
    ref_opt = torch.optim.Adafactor(ref.parameters(), **ADAFACTOR_KW)
    for step in range(ADAFACTOR_STEPS):
        model.comm.step = step
        x, y = issue_batch(step)
        F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = model.full_state_dict(), ref.state_dict()
    last = [r for r in model.comm.records if r.what == STATS and r.step == ADAFACTOR_STEPS - 1]
    return {"refused": refused, "changed_when_refused": changed,
            "stats_bytes": sum(r.bytes for r in last), "stats_ops": [r.op for r in last],
            "stats_formula": RING_FACTOR["all_reduce"](n) * stats_bytes(shapes),
            "payload_formula": stats_bytes(shapes),
            "diff_vs_torch": max(float((got[k] - want[k]).abs().max()) for k in want),
            "moved": max(float((want[k] - v).abs().max()) for k, v in issue_mlp().state_dict().items())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="the course's GPT preset")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (>= 3: warm-up, timed, peak)")
    p.add_argument("--rows", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--link-gbps", type=float, default=1.0, help="emulated link, Gbit/s per rank")
    p.add_argument("--link-latency-us", type=float, default=100.0, help="α per ring step, µs")
    p.add_argument("--adafactor", action="store_true", help="also part 2 (Adafactor on shards)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/wholematrix")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    layouts = [k.strip() for k in args.layouts.split(",") if k.strip()]
    bad = [k for k in layouts if k not in LAYOUTS]
    if bad or args.steps < 3:
        raise SystemExit(f"--layouts {args.layouts!r} must name some of {', '.join(LAYOUTS)} and "
                         f"--steps {args.steps} be >= 3 (warm-up, timed, peak)")
    dist.init_process_group("gloo")
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        result = {"demo": PROGRAM, "rank": rank, "world_size": n, "preset": args.preset,
                  "steps": args.steps, "rows": args.rows, "link_gbps": args.link_gbps,
                  "link_latency_us": args.link_latency_us, "precision": "fp32",
                  "backend": "gloo", "muon": {}}
        first = None
        for layout in layouts:
            result["muon"][layout], params = muon_layout(layout, rank, n, args, first)
            first = params if first is None else first
            dist.barrier()
        if args.adafactor:
            result["adafactor"] = adafactor_part(rank, n)
        write_rank_json(args.out, rank, result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
