"""The low-precision state ladder, measured: bytes per parameter and loss against fp32 states.

Idea: the optimizer states of bf16 training cost 16 bytes per parameter
(2 + 2 + 4 + 4 + 4); storing the moments in bf16 gives 12, making the bf16 weights their own
master gives 8, and a bf16 Kahan compensation buffer buys back most of the lost precision for 2
bytes more: 10 (zerolab.optim, `theory.state_ladder`; Megatron's 20 / 18 / 16 table next to it).
What each rung costs in accuracy is measured here, against the fp32-state baseline on the very
same batches: one torchrun group builds every rung from the same seed and steps them in turn,
step by step, on the `tiny` GPT. Per rung: the measured model-state bytes after the last step on
every rank (equal to the formula, exactly) and per parameter, and the loss difference to the
baseline - at the last step, averaged over the last 50 steps, the largest over the run - plus
the held-out loss. Nearest and Kahan rounding draw no random bits, so one run says all; stochastic
rounding runs with several rounding seeds (the model and the batches unchanged): median and
spread. The baseline's own step-to-step scatter (sd of its last 50 losses) is given to judge them.

Measured (tiny, DDP on 2 gloo CPU ranks, 200 steps, lr 1e-3; 16 min on a loaded 2-core machine;
loss differences to fp32 states, mean over the last 50 steps / largest over the run): bf16
moments -0.0002 / 0.0035; Kahan 0.0000 / 0.0021; nearest +0.018 / 0.043 (held-out +0.023);
stochastic (3 seeds) +0.0004 [0.000, 0.002] / 0.006 [0.003, 0.012]; bytes exactly 16 / 12 / 10 /
8 / 8 per parameter. The baseline's own scatter: sd 0.18 over its last 50 steps.

    python -m zerolab.course.ladder --steps 200 --out runs/ladder
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .. import STRATEGIES, theory
from ..comm import Comm
from ..data import get_batch, load_tokens, rank_slice
from ..memory import MemoryMeter
from ..model import GPT, get_config
from . import nb

MODULE = "zerolab.course.ladder"
TAIL = 50                                   # steps averaged at the end of the run


def configurations(sr_seeds=(0, 1, 2)) -> list[dict]:
    """The baseline and every rung of `theory.LADDER`; stochastic rounding once per seed."""
    out = []
    for states, rounding in theory.LADDER:
        for seed in (sr_seeds if rounding == "stochastic" else (0,)):
            out.append({"states": states, "rounding": rounding, "rounding_seed": seed})
    return out


def rank_measure(args) -> dict | None:
    """Every rank: build every configuration, step them in turn for args.steps steps; rank 0
    returns the losses (mean over ranks), held-out losses and measured bytes of each."""
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = get_config(args.preset)
    tokens, val_tokens = load_tokens(None, cfg.block_size)
    runs = []
    for c in configurations(args.sr_seeds):
        torch.manual_seed(args.seed)
        model = GPT(cfg).to(torch.bfloat16)
        meter = MemoryMeter(enabled=False)
        extra = {} if c["states"] == "fp32" else {
            "optimizer_states": c["states"], "master_rounding": c["rounding"],
            "rounding_seed": c["rounding_seed"]}
        s = STRATEGIES[args.stage](model, Comm(), max_grad_norm=1.0, lr=args.lr,
                                   weight_decay=0.1, meter=meter, **extra)
        runs.append((c, s, meter, []))
    for step in range(args.steps):
        x, y = get_batch(tokens, step, args.batch_size, cfg.block_size, args.seed)
        x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
        for c, s, meter, losses in runs:
            meter.enabled = step == args.steps - 1          # bytes after the last step
            s.comm.step = step
            loss = s.forward(x, y)
            s.backward(loss)
            s.step()
            losses.append(float(loss))
            s.comm.records.clear()
    x, y = get_batch(val_tokens, 0, args.batch_size, cfg.block_size, args.seed + 1)
    x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
    mine = []
    for c, s, meter, losses in runs:
        with torch.no_grad():
            val = float(s.forward(x, y))
        mine.append({"losses": losses, "val_loss": val,
                     "measured": {k: meter.current.get(k, 0) for k in theory.STATES}})
        s.close()
    everyone = [None] * n
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    psi_padded = sum(u.padded_numel for u in runs[0][1].units)
    psi = sum(u.numel for u in runs[0][1].units)
    out = []
    for i, (c, _, _, _) in enumerate(runs):
        per_rank = [e[i] for e in everyone]
        out.append({**c, "losses": [statistics.fmean(r["losses"][t] for r in per_rank)
                                    for t in range(args.steps)],
                    "val_loss": statistics.fmean(r["val_loss"] for r in per_rank),
                    "measured": [r["measured"] for r in per_rank],
                    "formula": theory.model_state_bytes(psi_padded, n, args.stage, "bf16",
                                                        states=c["states"], rounding=c["rounding"])})
    return {"preset": args.preset, "stage": args.stage, "world_size": n, "steps": args.steps,
            "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "psi": psi,
            "psi_padded": psi_padded, "runs": out}


def rank_main(argv) -> int:
    """A rank of `measure`'s group: rank 0 writes OUT/ladder.json."""
    import datetime
    args = parser().parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3600))
    try:
        summary = rank_measure(args)
        if summary is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "ladder.json").write_text(json.dumps(summary))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure(*, nproc: int = 2, preset: str = "tiny", stage: int = 0, steps: int = 300,
            batch_size: int = 8, lr: float = 1e-3, seed: int = 0, sr_seeds=(0, 1, 2),
            out: str = "runs/ladder", timeout: float = 7200, echo=print) -> dict:
    """Start `nproc` gloo ranks that train every rung side by side (module docstring); return
    what rank 0 wrote to OUT/ladder.json."""
    theory.check_stage(stage)
    argv = ["--preset", preset, "--stage", str(stage), "--steps", str(steps), "--batch-size",
            str(batch_size), "--lr", str(lr), "--seed", str(seed), "--sr-seeds",
            ",".join(map(str, sr_seeds)), "--out", str(out)]
    nb.launch_module(MODULE, argv, nproc=nproc, timeout=timeout, echo=echo)
    return json.loads((Path(out) / "ladder.json").read_text())


def _spread(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def table(summary: dict) -> list[dict]:
    """One row per rung of `theory.LADDER`: bytes per parameter (formula; measured on rank 0 at
    the padded Ψ, sharded states times N), exact (measured == formula on every rank), and the
    loss differences to the fp32 baseline, each {"median", "min", "max", "n"} over the rung's
    runs: final (last step), tail (mean over the last TAIL steps), max_abs (over the run), val."""
    n, stage, psi = summary["world_size"], summary["stage"], summary["psi_padded"]
    base = next(r for r in summary["runs"] if r["states"] == "fp32")
    rows = []
    for states, rounding in theory.LADDER:
        mine = [r for r in summary["runs"] if (r["states"], r["rounding"]) == (states, rounding)]
        diffs = [[a - b for a, b in zip(r["losses"], base["losses"])] for r in mine]
        m0 = mine[0]["measured"][0]
        rows.append({
            "states": states, "rounding": rounding,
            "bytes_per_param": sum(theory.bytes_per_param("bf16", None, states, rounding).values()),
            "measured_per_param": sum(m0[k] * (n if theory.is_sharded(k, stage) else 1)
                                      for k in theory.STATES) / psi,
            "measured_per_rank": sum(m0.values()), "formula_per_rank": sum(mine[0]["formula"].values()),
            "exact": all(m == r["formula"] for r in mine for m in r["measured"]),
            "final": _spread([d[-1] for d in diffs]),
            "tail": _spread([statistics.fmean(d[-TAIL:]) for d in diffs]),
            "max_abs": _spread([max(abs(v) for v in d) for d in diffs]),
            "val": _spread([r["val_loss"] - base["val_loss"] for r in mine])})
    return rows


def format_state_ladder(psi: float, world_size: int, unit: float = 1e9) -> str:
    """`theory.state_ladder` as text (bytes per parameter per state, then GB per rank per stage;
    `zerolab memory` prints it), Megatron's table under it."""
    short = {"params": "weights", "master_weights": "master", "exp_avg_sq": "exp_sq"}
    lines = [f"{'optimizer states':<26}" + "".join(f"{short.get(s, s):>8}" for s in theory.STATES)
             + f"{'B/param':>8}" + "".join(f"{theory.STAGE_NAMES[s]:>9}" for s in theory.STAGES)]
    for r in theory.state_ladder(psi, world_size):
        lines.append(f"{_rung(r):<26}" + "".join(f"{r[s]:>8g}" for s in theory.STATES)
                     + f"{r['bytes_per_param']:>8g}"
                     + "".join(f"{r['per_rank'][s] / unit:>9.4g}" for s in theory.STAGES))
    return "\n".join([*lines, megatron_line()])


def megatron_line() -> str:
    """Megatron's distributed-optimizer bytes per parameter (`theory.MEGATRON_BYTES`), one line."""
    return "Megatron's distributed optimizer (params/grads): " + "; ".join(
        f"{p}/{g}: {a + b} = {a} + {b}/d" for (p, g), (a, b) in theory.MEGATRON_BYTES.items())


def _rung(r: dict) -> str:
    return r["states"] + (f" ({r['rounding']})" if r["states"] == "bf16-master" else "")


def format_table(summary: dict) -> str:
    """The ladder table as text (loss differences: median [min, max] where a rung ran several
    times), the baseline's scatter, and Megatron's bytes."""
    base = next(r for r in summary["runs"] if r["states"] == "fp32")
    tail = base["losses"][-TAIL:]
    lines = [f"{summary['preset']}, {theory.STAGE_NAMES[summary['stage']]} on "
             f"{summary['world_size']} gloo ranks, {summary['steps']} steps, lr {summary['lr']}; "
             f"fp32 baseline: final loss {base['losses'][-1]:.4f}, last {TAIL} steps "
             f"{statistics.fmean(tail):.4f} ± {statistics.stdev(tail):.4f} (sd), held-out "
             f"{base['val_loss']:.4f}",
             f"{'rung':<26}{'B/param':>8}{'measured':>9}{'exact':>6}{'Δ final':>25}"
             f"{'Δ last ' + str(TAIL):>25}{'max |Δ|':>25}{'Δ held-out':>25}"]

    def cell(s):
        text = f"{s['median']:+.4f}"
        return text + (f" [{s['min']:+.3f},{s['max']:+.3f}]" if s["n"] > 1 else "")
    for r in table(summary):
        lines.append(f"{_rung(r):<26}{r['bytes_per_param']:>8g}{r['measured_per_param']:>9.3f}"
                     f"{'yes' if r['exact'] else 'NO':>6}" + "".join(
                         f"{cell(r[k]):>25}" for k in ("final", "tail", "max_abs", "val")))
    return "\n".join([*lines, megatron_line()])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--stage", type=int, default=0, help="0-3 (losses agree across stages)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="model and batches")
    p.add_argument("--sr-seeds", default=(0, 1, 2),
                   type=lambda s: tuple(int(v) for v in s.split(",") if v.strip()),
                   help="stochastic rounding's seeds, a comma list (default 0,1,2)")
    p.add_argument("--out", default="runs/ladder")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    summary = measure(nproc=args.nproc, preset=args.preset, stage=args.stage, steps=args.steps,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      sr_seeds=args.sr_seeds, out=args.out, echo=None)
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:                # a rank of `measure`'s torchrun group
        from ..run.rank import rank_entry
        rank_entry(lambda: rank_main(sys.argv[1:]))
    else:
        raise SystemExit(main())
