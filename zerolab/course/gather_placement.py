"""Where ZeRO-1/2's all_gather goes, measured: step time after the step vs before the next forward.

Idea: ZeRO-1 and ZeRO-2 all_gather the updated weights either at the end of
the step (gather="after_step", the notes': nothing is left to compute, so nothing hides them) or
just before each unit's next forward, one unit ahead, so that each gather runs while the unit
before it computes (gather="before_forward", FSDP's SHARD_GRAD_OP). Same bytes, same memory;
only the time can differ, and only where the link is slow enough for a gather to matter: both
are timed here on the emulated link (zerolab/timing/linkemu.py: a collective ends no sooner than
the α-β model says, the rank *sleeping* meanwhile, so compute issued in between runs as it would
beside a network card), next to DDP, as lab 6 times the stages.

Two ways, one table:
- `measure` (the default rests on it): one torchrun group builds DDP and ZeRO-1 / ZeRO-2 in both
  modes from the same seed and runs them round by round, one bf16 step of each per round in an
  order rotated every round, a barrier before each step (as `zerolab bench`); a step's time is
  the slowest rank's. Each system's ratio to DDP is taken per round (the two steps ran seconds
  apart, so a shared machine's load drifts out of it), then the median and spread over rounds.
  In before_forward a step's time holds the previous step's gathers: the steady state.
  compute="real": the `tiny` GPT itself. compute="sleep": a stand-in whose units have tiny's
  sizes (the same bytes on the link) and whose compute is tiny's, measured first in this process
  (`costmodel.measure_units`, as lab 6 does) and then *slept* in each unit's forward and
  backward, so that a loaded machine cannot stretch it (tests/test_linkemu.py's SleepNet).
- `measure_launches` (lab 6's way): `nb.launch` of stages 0,1,2 per mode, `repeats` times; the
  slowest rank's step times, the first (warm-up) and last (it samples memory) left out; ratios
  per launch. On a loaded 2-core machine launches seconds apart drift by more than the effect.

    python -m zerolab.course.gather_placement --link-gbps 0.1,1 --rounds 40
    python -m zerolab.course.gather_placement --launches --repeats 5 --steps 12
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import theory
from ..variants.compose import make_strategy
from ..comm import Comm
from ..data import get_batch, load_tokens, rank_slice
from ..variants.placement import GATHER_MODES
from ..model import GPT, get_config
from ..sharding import build_units
from ..timing import costmodel, linkemu
from . import nb

MODULE = "zerolab.course.gather_placement"
STAGES = (0, 1, 2)
#: (label, stage, gather mode) of every system one round runs
SYSTEMS = (("DDP", 0, None),) + tuple((f"{theory.STAGE_NAMES[s]} {m}", s, m)
                                      for s in (1, 2) for m in GATHER_MODES)


# --- compute the machine's load cannot stretch: tiny's units, sleeping tiny's compute ------------
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepUnit(torch.nn.Module):
    """`numel` weights (all get a gradient), `fwd_s` / `bwd_s` seconds slept in forward /
    backward."""

    def __init__(self, numel: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.w, self.fwd_s, self.bwd_s = torch.nn.Parameter(torch.zeros(numel)), fwd_s, bwd_s

    def forward(self, h):
        return _Sleep.apply(h + self.w[:h.shape[-1]], self.fwd_s, self.bwd_s)


class SleepGPT(torch.nn.Module):
    """`units` [(name, numel, fwd_s, bwd_s)] as `unit_profile` gives them: the root's weights used
    first and last, its compute (head and loss) last in forward, first in backward, as
    `costmodel.Unit` places it; one SleepUnit per block."""

    def __init__(self, units, dim: int = 64):
        super().__init__()
        root = next(u for u in units if u[0] == "root")
        self.root = SleepUnit(*root[1:])
        self.blocks = torch.nn.ModuleList(SleepUnit(*u[1:]) for u in units if u[0] != "root")
        self.dim = dim

    def zero_units(self):
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x, y):
        h = x + self.root.w[:self.dim]
        for b in self.blocks:
            h = b(h)
        return (self.root(h) - y).pow(2).mean()


def unit_profile(preset: str = "tiny", batch_size: int = 8, nproc: int = 2, calls: int = 5):
    """[(name, numel, fwd_s, bwd_s)] of `preset`'s units: sizes as the strategies build them,
    seconds of one rank's micro-batch through each (`costmodel.measure_units`, one thread, the
    median of 3 passes), the least of `calls` such measurements: the closest this machine gets
    to its unloaded speed (a shared machine stretches compute by 1-2x from one call to the next)."""
    torch.manual_seed(0)
    cfg = get_config(preset)
    model = GPT(cfg).to(torch.bfloat16)
    numel = {u.name: u.numel for u in build_units(model, nproc, 0)}
    x = torch.randint(0, cfg.vocab_size, (batch_size // nproc, cfg.block_size))
    runs = [costmodel.measure_units(model, x, x, nproc, repeats=3) for _ in range(calls)]
    return [(u.name, numel[u.name], min(r[i].fwd_s for r in runs), min(r[i].bwd_s for r in runs))
            for i, u in enumerate(runs[0])]


# --- interleaved, in one group of ranks -----------------------------------------------------------
def rank_measure(args) -> dict | None:
    """Every rank: per link, build the systems, run warmup + rounds rounds; rank 0 returns
    {"records": [...], settings}: one record per (link, round, system), the slowest rank's time."""
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = get_config(args.preset)
    tokens, _ = load_tokens(None, cfg.block_size)
    records = []
    profile = json.loads(args.sleep) if args.sleep else None
    for g in args.link_gbps:
        link = linkemu.from_args(g, args.link_latency_us, n)
        systems = []
        for label, stage, mode in SYSTEMS:
            torch.manual_seed(args.seed)
            model = (SleepGPT(profile) if profile else GPT(cfg)).to(torch.bfloat16)
            comm = Comm()
            comm.link = link                # one emulated link: the systems take turns on it
            kwargs = {"gather": mode} if mode else {}
            systems.append((label, stage, mode, make_strategy(
                stage, model, comm, max_grad_norm=1.0, lr=1e-3, weight_decay=0.1, **kwargs)))
        mine = []                           # (round, label, seconds) on this rank
        for r in range(args.warmup + args.rounds):
            x, y = get_batch(tokens, r, args.batch_size, cfg.block_size, args.seed)
            x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
            if profile:
                x = y = torch.ones(args.batch_size // n, 64, dtype=torch.bfloat16)
            k = r % len(systems)
            for label, _, _, s in systems[k:] + systems[:k]:     # rotated every round
                dist.barrier()
                t0 = time.perf_counter()
                s.comm.step = r
                s.backward(s.forward(x, y))
                s.step()
                if r >= args.warmup:
                    mine.append((r, label, time.perf_counter() - t0))
                s.comm.settle()
                s.comm.records.clear()
        for _, _, _, s in systems:
            s.close()
        everyone = [None] * n
        dist.all_gather_object(everyone, mine)
        for i, (r, label, _) in enumerate(mine):
            stage, mode = next((st, m) for lb, st, m in SYSTEMS if lb == label)
            records.append({"link_gbps": g, "unit": r, "pair": r, "label": label,
                            "stage": stage, "mode": mode or "-",
                            "times_s": [max(e[i][2] for e in everyone)]})
    if rank != 0:
        return None
    return {"how": "interleaved", "compute": "sleep" if profile else "real", "profile": profile,
            "preset": args.preset, "world_size": n,
            "batch_size": args.batch_size, "precision": "bf16", "rounds": args.rounds,
            "warmup": args.warmup, "link_latency_us": args.link_latency_us, "records": records}


def rank_main(argv) -> int:
    """A rank of `measure`'s group: rank 0 writes OUT/gather_placement.json."""
    import datetime
    args = parser().parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        summary = rank_measure(args)
        if summary is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gather_placement.json").write_text(json.dumps(summary, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure(*, nproc: int = 2, preset: str = "tiny", batch_size: int = 8, link_gbps=(0.1, 1.0),
            link_latency_us: float = 100.0, rounds: int = 40, warmup: int = 3, seed: int = 0,
            compute: str = "real", out: str = "runs/gather_placement", timeout: float = 1200,
            echo=print) -> dict:
    """Start `nproc` gloo ranks that interleave the systems (module docstring); return the
    summary rank 0 wrote to OUT/gather_placement.json ({"records": [...], settings}).
    compute: "real" (the GPT) or "sleep" (SleepGPT with `unit_profile(preset)`, measured here)."""
    if compute not in ("real", "sleep"):
        raise ValueError(f"compute {compute!r} is not one of 'real', 'sleep'")
    argv = ["--preset", preset, "--batch-size", str(batch_size), "--link-gbps",
            ",".join(map(str, link_gbps)), "--link-latency-us", str(link_latency_us),
            "--rounds", str(rounds), "--warmup", str(warmup), "--seed", str(seed), "--out", out]
    if compute == "sleep":
        argv += ["--sleep", json.dumps(unit_profile(preset, batch_size, nproc))]
    nb.launch_module(MODULE, argv, nproc=nproc, timeout=timeout, echo=echo)
    return json.loads((Path(out) / "gather_placement.json").read_text())


# --- lab 6's way: one launch per mode --------------------------------------------------------------
def measure_launches(*, nproc: int = 2, preset: str = "tiny", steps: int = 12, batch_size: int = 8,
                     link_gbps=(0.1,), link_latency_us: float = 100.0, repeats: int = 5,
                     out: str = "runs/gather_placement", echo=print) -> dict:
    """`nb.launch` stages 0,1,2 once per mode, `repeats` times per link (the modes' order
    alternating); records as `measure`'s, one per (link, launch, stage)."""
    if steps < 4:
        raise ValueError(f"steps {steps} must be >= 4 (warm-up and last step are left out)")
    records = []
    for g in link_gbps:
        for rep in range(repeats):
            for mode in (GATHER_MODES if rep % 2 == 0 else GATHER_MODES[::-1]):
                if echo:
                    echo(f"link {g} Gb/s, repeat {rep + 1}/{repeats}: zero12_gather={mode}")
                runs = nb.launch(stages=",".join(map(str, STAGES)), nproc=nproc, preset=preset,
                                 steps=steps, out=f"{out}/link{g}_rep{rep}_{mode}",
                                 backend="gloo", device="cpu", batch_size=batch_size,
                                 link_gbps=g, link_latency_us=link_latency_us,
                                 no_allocator=True, zero12_gather=mode, echo=None)
                for stage, ranks in sorted(runs.items()):
                    label = "DDP" if stage == 0 else f"{theory.STAGE_NAMES[stage]} {mode}"
                    records.append({"link_gbps": g, "unit": f"{rep} {mode}", "pair": rep,
                                    "label": label, "stage": stage,
                                    "mode": "-" if stage == 0 else mode,
                                    "times_s": [max(r["step_times_s"][i] for r in ranks)
                                                for i in range(1, steps - 1)]})
    return {"how": "launches", "preset": preset, "world_size": nproc, "batch_size": batch_size,
            "precision": "bf16", "steps": steps, "repeats": repeats,
            "link_latency_us": link_latency_us, "records": records}


# --- the table -----------------------------------------------------------------------------------
def _quantile(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _spread(xs) -> dict:
    return {"median": statistics.median(xs), "q1": _quantile(xs, 0.25), "q3": _quantile(xs, 0.75),
            "min": min(xs), "max": max(xs), "n": len(xs)}


def table(records: list[dict]) -> list[dict]:
    """One row per (link, system): step time (seconds: median, quartiles, min-max over every
    timed step) and the ratio to DDP, taken per pairing unit (a round, or a launch) against that
    unit's DDP, then its median, quartiles and min-max over units."""
    rows = []
    for g in sorted({r["link_gbps"] for r in records}):
        at = [r for r in records if r["link_gbps"] == g]
        ddp = {r["unit"]: statistics.median(r["times_s"]) for r in at if r["stage"] == 0}
        for label in [lb for lb, _, _ in SYSTEMS if any(r["label"] == lb for r in at)]:
            mine = [r for r in at if r["label"] == label]
            rows.append({"link_gbps": g, "label": label, "stage": mine[0]["stage"],
                         "mode": mine[0]["mode"],
                         "time_s": _spread([t for r in mine for t in r["times_s"]]),
                         "ratio_ddp": _spread([statistics.median(r["times_s"]) / ddp[r["unit"]]
                                               for r in mine])})
    return rows


def mode_ratios(records: list[dict]) -> list[dict]:
    """before_forward / after_step per (link, stage), per pair (a round; a repeat of the two
    launches), then its median, quartiles and min-max."""
    out = []
    for g in sorted({r["link_gbps"] for r in records}):
        for stage in STAGES[1:]:
            med = {(r["pair"], r["mode"]): statistics.median(r["times_s"]) for r in records
                   if r["link_gbps"] == g and r["stage"] == stage}
            pairs = sorted({p for p, _ in med})
            out.append({"link_gbps": g, "stage": stage, "ratio": _spread(
                [med[p, "before_forward"] / med[p, "after_step"] for p in pairs])})
    return out


def format_table(summary: dict) -> str:
    """The measured table (ms; ratios to DDP; before_forward / after_step)."""
    records, profile = summary["records"], summary.get("profile")
    lines = [f"{summary['preset']} GPT, {summary['world_size']} gloo ranks, {summary['precision']}, "
             f"batch {summary['batch_size']}, emulated link + {summary['link_latency_us']:g} us, "
             + ("interleaved rounds" if summary["how"] == "interleaved" else "one launch per mode")
             + (", compute slept: " + ", ".join(f"{u[0]} {u[2] * 1e3:.1f}+{u[3] * 1e3:.1f} ms"
                                                for u in profile) if profile else ""),
             f"{'link':<10}{'system':<24}{'median ms':>10}{'IQR':>12}{'min-max':>12}{'n':>5}"
             f"{'x DDP':>8}{'IQR':>14}{'min-max':>14}"]
    for r in table(records):
        t, q = r["time_s"], r["ratio_ddp"]
        link = f"{r['link_gbps']} Gb/s"
        cells = (f"{t['q1'] * 1e3:.0f}-{t['q3'] * 1e3:.0f}", f"{t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f}",
                 f"{q['q1']:.3f}-{q['q3']:.3f}", f"{q['min']:.2f}-{q['max']:.2f}")
        lines.append(f"{link:<10}{r['label']:<24}{t['median'] * 1e3:>10.1f}{cells[0]:>12}"
                     f"{cells[1]:>12}{t['n']:>5}{q['median']:>8.3f}{cells[2]:>14}{cells[3]:>14}")
    for r in mode_ratios(records):
        q = r["ratio"]
        lines.append(f"{r['link_gbps']} Gb/s {theory.STAGE_NAMES[r['stage']]}: before_forward / "
                     f"after_step = {q['median']:.3f} (IQR {q['q1']:.3f}-{q['q3']:.3f}, min-max "
                     f"{q['min']:.2f}-{q['max']:.2f}, {q['n']} pairs)")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--link-gbps", default=[0.1, 1.0],
                   type=lambda s: [float(g) for g in s.split(",") if g.strip()],
                   help="comma list, Gb/s per rank (default 0.1,1: lab 6's links)")
    p.add_argument("--link-latency-us", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=40, help="interleaved: timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="interleaved: untimed rounds first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute", choices=("real", "sleep"), default="real",
                   help="sleep: tiny's units sleeping tiny's compute (the load cannot stretch it)")
    p.add_argument("--sleep", help=argparse.SUPPRESS)      # the ranks: unit_profile as JSON
    p.add_argument("--launches", action="store_true", help="lab 6's way: one launch per mode")
    p.add_argument("--repeats", type=int, default=5, help="--launches: launches per mode")
    p.add_argument("--steps", type=int, default=12, help="--launches: steps per launch")
    p.add_argument("--out", default="runs/gather_placement")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.launches:
        summary = measure_launches(nproc=args.nproc, preset=args.preset, steps=args.steps,
                                   batch_size=args.batch_size, link_gbps=args.link_gbps,
                                   link_latency_us=args.link_latency_us, repeats=args.repeats,
                                   out=args.out)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gather_placement_launches.json").write_text(json.dumps(summary))
    else:
        summary = measure(nproc=args.nproc, preset=args.preset, batch_size=args.batch_size,
                          link_gbps=args.link_gbps, link_latency_us=args.link_latency_us,
                          rounds=args.rounds, warmup=args.warmup, seed=args.seed,
                          compute=args.compute, out=args.out, echo=None)
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:                # a rank of `measure`'s torchrun group
        from ..run.rank import rank_entry
        rank_entry(lambda: rank_main(sys.argv[1:]))
    else:
        raise SystemExit(main())
