"""What the instruments cost a step: the memory meter (sampling, idle, absent, interleaved round by
round) and the training-loop guards, timed inside `zerolab train`'s step of each zerolab stage
(`zerolab bench --meter-cost`).

Idea: the meter (zerolab.memory.MemoryMeter) walks every storage a strategy holds, 10-47 times a
step; a measurement of memory must not be paid for in time without saying how much. Each round
runs one step of every variant of every stage, in an order rotated each round, after a barrier;
a step's time is the slowest rank's. Two measures: the seconds spent inside `sample` per step,
and the A/B ratio of a step to the same round's step without a meter. The guards
(zerolab.loop.guards: what a PyTorch loop may do - zero_grad, edits, placeholders of sharded values,
ranks that must agree) run in every step, with or without a meter: their seconds per step are
timed in the steps without a meter by wrapping each guard the frame and the stages call
(`GUARD_CALLS`, a perf_counter pair per call, ~1 us each, included). The bench's options
(`bench.parser`) and checks apply; rank 0 writes OUT/meter_cost.json.

    zerolab bench --preset small --meter-cost --rounds 21
"""
from __future__ import annotations

import contextlib
import importlib
import statistics
import time

import torch
import torch.distributed as dist

from .. import STRATEGIES
from ..comm import Comm
from ..data import get_batch, load_tokens, rank_slice
from ..memory import MemoryMeter
from ..model import GPT, get_config
from ..run.rank import rank_entry
from .bench import METER_STAGES, check_args, rank_main, slowest_rank

MODULE = "zerolab.course.metercost"
METER_VARIANTS = ("none", "idle", "sampling")
# the guards (zerolab.loop.guards) the frame and the stages call, by the module whose names they are
GUARD_CALLS = {"zerolab.strategy": ("check_trainable", "claim_grads", "check_all_used",
                                    "check_step", "adopt_edits"),
               "zerolab.zero2": ("claim_grads", "claim_shard_grads", "shard_grads"),
               "zerolab.zero3": ("agree", "check_untouched", "claim_grads", "claim_shard_grads",
                                 "shard_grads"),
               "zerolab.loop.guards": ("shard_params", "unshard_param")}   # ZeRO-3's placeholders


@contextlib.contextmanager
def timed_guards():
    """Inside: every guard of GUARD_CALLS adds its seconds to the yielded {name: seconds}."""
    spent, saved = {}, []

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return call
    for module_name, names in GUARD_CALLS.items():
        module = importlib.import_module(module_name)
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, timed(name, getattr(module, name)))
    try:
        yield spent
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


class _TimedMeter(MemoryMeter):
    """A MemoryMeter that counts `sample` calls and the seconds spent inside them."""

    def __init__(self):
        super().__init__()
        self.calls, self.seconds = 0, 0.0

    def sample(self, strategy, tag=""):
        t0 = time.perf_counter()
        super().sample(strategy, tag)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def meter_cost(args) -> dict | None:
    """Every rank: for each zerolab stage, one strategy (bf16, as `zerolab train` runs it) whose
    steps alternate, in an order rotated every round, between the meter variants of
    METER_VARIANTS: "none" (no meter), "idle" (a meter with enabled = False, as `zerolab train`
    runs every step but the last), "sampling" (the meter samples at every point of the step, as
    in the last step, whose memory is reported; before the meter could be idle, every step).
    A step is run/stage.py's: reset_peaks + sample at the start, forward, backward, optimizer step;
    its time is the slowest rank's, after a barrier.
    Two measures of the meter's cost: the seconds spent inside `MemoryMeter.sample` in a step
    (the slowest rank's; against the median step without a meter), and the A/B ratio of a
    step's time to the same round's step without a meter (noisy on a shared machine). Rank 0
    returns {"rows": [{"system", "variant", "median_s", "min_s", "max_s", "times_s",
    "ratio_median", "ratio_min", "ratio_max", "meter_s", "meter_min_s", "meter_max_s",
    "samples_per_step", "meter_share"}], ...}; meter_share = meter_s / "none"'s median_s."""
    torch.set_num_threads(1)
    comm = Comm()
    rank, n = comm.rank, comm.world_size
    cfg = get_config(args.preset)
    names = [s for s in check_args(args, n) if s in METER_STAGES]
    tokens, _ = load_tokens(None, cfg.block_size)
    built = {}
    for name in names:
        torch.manual_seed(args.seed)
        model = GPT(cfg).to(torch.bfloat16)
        meter = _TimedMeter()
        built[name] = (STRATEGIES[METER_STAGES[name]](model, comm, max_grad_norm=1.0, lr=args.lr,
                                                      weight_decay=0.1, meter=meter), meter)
    times = {(s, v): [] for s in names for v in METER_VARIANTS}
    inside = {(s, v): [] for s in names for v in METER_VARIANTS}    # (seconds, calls) per step
    guards = {s: [] for s in names}                     # {guard: seconds} per step, no meter
    for r in range(args.warmup + args.rounds):
        x, y = get_batch(tokens, r, args.batch_size, cfg.block_size, args.seed)
        x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
        for name in names:
            strategy, meter = built[name]
            k = r % len(METER_VARIANTS)
            for variant in METER_VARIANTS[k:] + METER_VARIANTS[:k]:
                strategy.meter = None if variant == "none" else meter
                meter.enabled = variant == "sampling"
                meter.seconds, meter.calls = 0.0, 0
                dist.barrier()
                t0 = time.perf_counter()
                with (timed_guards() if variant == "none" else contextlib.nullcontext({})) as spent:
                    if strategy.meter is not None:          # run/stage.py's step start
                        meter.reset_peaks()
                        meter.sample(strategy, "step start")
                    strategy.backward(strategy.forward(x, y))
                    strategy.step()
                if r >= args.warmup:
                    times[name, variant].append(time.perf_counter() - t0)
                    inside[name, variant].append((meter.seconds, meter.calls))
                    if variant == "none":
                        guards[name].append(dict(spent))
    gathered = [None] * n
    dist.all_gather_object(gathered, (times, inside, guards))
    if rank != 0:
        return None
    rows = []
    for name in names:
        slowest = {v: slowest_rank([g[0] for g in gathered], (name, v), args.rounds)
                   for v in METER_VARIANTS}
        base = statistics.median(slowest["none"])
        for v in METER_VARIANTS:
            ratios = [a / b for a, b in zip(slowest[v], slowest["none"])]
            meter_s = [max(g[1][name, v][i][0] for g in gathered) for i in range(args.rounds)]
            rows.append({"system": name, "variant": v, "median_s": statistics.median(slowest[v]),
                         "min_s": min(slowest[v]), "max_s": max(slowest[v]), "times_s": slowest[v],
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "meter_s": statistics.median(meter_s),
                         "meter_min_s": min(meter_s), "meter_max_s": max(meter_s),
                         "samples_per_step": gathered[0][1][name, v][0][1],
                         "meter_share": statistics.median(meter_s) / base})
    guard_rows = []
    for name in names:                  # per guard, the slowest rank's seconds in a step
        base = statistics.median(slowest_rank([g[0] for g in gathered], (name, "none"),
                                              args.rounds))
        per = {k: statistics.median(max(g[2][name][i].get(k, 0.0) for g in gathered)
                                    for i in range(args.rounds))
               for k in sorted({k for g in gathered for step in g[2][name] for k in step})}
        guard_rows.append({"system": name, "step_s": base, "guards_s": per,
                           "total_s": sum(per.values()), "share": sum(per.values()) / base})
    return {"preset": args.preset, "world_size": n, "rounds": args.rounds, "warmup": args.warmup,
            "batch_size": args.batch_size, "precision": "bf16", "backend": dist.get_backend(),
            "rows": rows, "guards": guard_rows}


def format_meter_cost(summary: dict) -> str:
    """The meter-cost table: per stage and variant, the step's median ms and spread, its ratio to
    the step without a meter, and the ms spent inside MemoryMeter.sample (and its % of a step)."""
    lines = [f"memory meter cost: {summary['preset']} GPT, {summary['world_size']} ranks, "
             f"{summary['backend']}, {summary['precision']}, {summary['rounds']} rounds (median, "
             "min-max of the slowest rank)",
             f"{'system':<16}{'meter':<10}{'step ms':>9}{'min-max':>11}{'x no meter':>11}"
             f"{'min-max':>13}{'samples':>9}{'in meter ms':>13}{'min-max':>13}{'% of step':>10}"]
    for r in summary["rows"]:
        spread = f"{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}"
        ratios = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        inside = f"{r['meter_min_s'] * 1e3:.2f}-{r['meter_max_s'] * 1e3:.2f}"
        lines.append(f"{r['system']:<16}{r['variant']:<10}{r['median_s'] * 1e3:>9.1f}{spread:>11}"
                     f"{r['ratio_median']:>11.3f}{ratios:>13}{r['samples_per_step']:>9}"
                     f"{r['meter_s'] * 1e3:>13.3f}{inside:>13}{r['meter_share'] * 100:>9.2f}%")
    lines.append("the training-loop guards (zerolab.loop.guards), ms in a step without a meter (median "
                 "of the slowest rank; % of that step):")
    for g in summary.get("guards", []):
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in g["guards_s"].items() if v >= 5e-6)
        lines.append(f"{g['system']:<16}{g['total_s'] * 1e3:>6.2f} ms of {g['step_s'] * 1e3:.1f} "
                     f"({g['share'] * 100:.1f}%): {parts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return rank_main(argv, meter_cost, format_meter_cost, "meter_cost.json", prog=MODULE)


if __name__ == "__main__":
    rank_entry(main)
