"""`zerolab fit`: its options, its checks and its report, on `fit`'s simulation.

`add_arguments` gives `zerolab train`'s own flags plus the ones only a prediction needs, so that
`zerolab fit ARGS` predicts what `zerolab train ARGS` measures; `check_args` reads them (ValueError,
one line, for a bad value); `report` simulates each stage and answers fits / largest micro-batch /
smallest N; `format_report` prints it (`--json`: the report itself).
"""
from __future__ import annotations

import argparse

from ..timing import hardware
from . import options
from .fit import MAX_SEARCH, UNKNOWN, advice, largest_rows, simulate, smallest_world
from .fittarget import GB, Target, device_memory, target_of


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`zerolab fit`'s options: `zerolab train`'s own (options.parser("train")), so that
    `zerolab fit ARGS` predicts what `zerolab train ARGS` measures, plus the ones below."""
    options.parser("train", p)
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="data-parallel ranks N (default: --nproc x --nnodes); any N up to "
                        f"{MAX_SEARCH:,}, larger than this machine")
    p.add_argument("--model", default=None, metavar="PKG.MODULE:BUILD",
                   help="your model: a function returning an nn.Module with forward(x, y) -> "
                        "loss and example_inputs(rows) -> (x, y); built on the meta device")
    for flag, what in (("--n-layer", "layers L"), ("--d-model", "width d"),
                       ("--n-head", "attention heads"), ("--vocab-size", "vocabulary")):
        p.add_argument(flag, type=int, default=None, help=f"GPT shape: {what} (default: the preset's)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="activation checkpointing of every K-th block (1: every block, as "
                        "--activation-checkpointing)")
    p.add_argument("--device-memory", default=None, metavar="GB|NAME",
                   help="memory of one rank's device: GB, or a named device ("
                        + ", ".join(n for n, d in hardware.DEVICES.items() if d.memory)
                        + "); default: this machine's available memory, shared by --nproc ranks")
    p.add_argument("--json", action="store_true", help="print every stage's bytes as JSON")
    return p


def check_args(args) -> tuple[int, int | None, Target]:
    """(N, every k-th block checkpointed or None, the Target); ValueError (one line) for a bad
    value: N, the batch, the shape, the model, the device."""
    n = args.world_size if args.world_size is not None else args.nproc * args.nnodes
    if not 1 <= n <= MAX_SEARCH:
        raise ValueError(f"--world-size {n} is outside 1..{MAX_SEARCH:,} (ranks of the fake world)")
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be >= 1")
    every = args.checkpoint_every
    if every is not None:
        if every < 1:
            raise ValueError(f"--checkpoint-every {every} must be >= 1 (1: every block)")
        if args.activation_checkpointing and every != 1:
            raise ValueError(f"--activation-checkpointing checkpoints every block; drop it to "
                             f"use --checkpoint-every {every}")
    elif args.activation_checkpointing:
        every = 1
    target = target_of(args)
    args.activation_checkpointing = False if target.cfg is None else args.activation_checkpointing
    options.check(args, n)
    if args.device_memory is not None:
        device_memory(args.device_memory)
    return n, every, target


def budget(args, n_here: int):
    """(budget_of(N) -> bytes one rank may use, a label)."""
    if args.device_memory is not None:
        memory, label = device_memory(args.device_memory)
        return (lambda n: memory), f"{label} per rank"
    from .preflight import available_bytes
    memory = available_bytes() or 0
    if not memory:
        raise ValueError("this machine does not say how much memory it has: give "
                         "--device-memory GB")
    return ((lambda n: memory / max(1, min(n, n_here))),
            f"this machine's {memory / GB:.3g} GB available, shared by {n_here} rank(s)")


def report(args) -> dict:
    """Every stage's prediction, fit, largest micro-batch and smallest N (`zerolab fit`)."""
    n, every, target = check_args(args)
    rows = args.batch_size // (n * args.grad_accum)
    budget_of, label = budget(args, min(n, args.nproc))
    stages = []
    for s in options.parse_stages(args.stages):
        r = simulate(args, s, n, rows, target, every=every)
        r["fits"] = r["peak"] <= budget_of(n)
        r["largest_rows"], _ = largest_rows(args, s, n, budget_of(n), target, every=every)
        r["smallest_world"] = smallest_world(args, s, rows, budget_of, target, 1, every=every)
        r["advice"] = [] if r["fits"] else advice(
            args, s, n, rows, budget_of, target, every=every,
            ranks_here=None if args.device_memory is not None else min(n, args.nproc))
        stages.append(r)
    return {"model": target.name, "world_size": n, "rows_per_rank": rows,
            "grad_accum": args.grad_accum, "precision": args.precision,
            "activation_checkpointing_every": every, "budget": budget_of(n),
            "budget_label": label, "stages": stages, "unknown": list(UNKNOWN)}


def format_report(rep: dict) -> str:
    """The table `zerolab fit` prints (GB per rank)."""
    ac = ("none" if not rep["activation_checkpointing_every"] else
          "every block" if rep["activation_checkpointing_every"] == 1 else
          f"every {rep['activation_checkpointing_every']}-th block")
    s0 = rep["stages"][0]
    top = max(r["peak"] for r in rep["stages"])
    unit, scale = next((u, v) for u, v in (("GB", GB), ("MB", 1e6), ("kB", 1e3), ("B", 1))
                       if top >= v or v == 1)
    lines = [f"{rep['model']}: Ψ = {s0['num_params']:,}, N = {rep['world_size']}, "
             f"B = {rep['rows_per_rank']} row(s) per rank x {rep['grad_accum']} micro-step(s), "
             f"{rep['precision']}, activation checkpointing {ac}; "
             f"budget {rep['budget'] / GB:.4g} GB ({rep['budget_label']})",
             f"per-rank {unit} of one step, simulated on the meta device (zerolab/run/fit.py)",
             f"{'stage':<8}{'states':>10}{'activ.':>10}{'transient':>11}{'rest':>11}"
             f"{'peak':>10}{'fits':>6}{'largest B':>11}{'smallest N':>12}"]
    for r in rep["stages"]:
        n = r["smallest_world"]
        lines.append(f"{r['name']:<8}{r['model_states_total'] / scale:>10.4g}"
                     f"{r['activations'] / scale:>10.4g}"
                     f"{sum(r['transients'].values()) / scale:>11.4g}"
                     f"{r['rest'] / scale:>11.3g}{r['peak'] / scale:>10.4g}"
                     f"{'yes' if r['fits'] else 'no':>6}{r['largest_rows'] or 'none':>11}"
                     f"{n if n is not None else 'none':>12}")
    lines.append("states: the formula at the padded Ψ; activ.: what one micro-batch's forward "
                 "keeps for backward; transient: the meter's gathered blocks, buckets, "
                 "reduce_scatter outputs and fp32 gradient copies, each at its own peak; rest: the "
                 "peak minus these three (backward's temporaries; below 0 when the parts do not "
                 "peak together); "
                 "largest B: rows per rank; smallest N: at this B")
    for r in rep["stages"]:
        if not r["fits"]:
            lines.append(f"{r['name']} does not fit; it would with "
                         + ("; or ".join(r["advice"]) if r["advice"] else
                            "none of: a smaller micro-batch, activation checkpointing, a later "
                            "stage, more ranks, a smaller preset"))
    lines.append("not known here:")
    lines += [f"  - {u}" for u in rep["unknown"]]
    return "\n".join(lines)


def main(args) -> int:
    """`zerolab fit`: print the table (or --json); 0, or ValueError for bad input."""
    import json
    rep = report(args)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0
