"""The anchors of `zerolab fit`: other people's estimates next to the same measured peak.

Idea: a prediction is worth what it gets right that others do not. For the CPU presets at N = 2
and B = 4 rows per rank, this module trains each stage for real (`fitcheck.measured_gpt`: rank
0's MemTracker peak) and puts beside it:

- `zerolab fit`'s prediction (`run.fit.simulate`);
- DeepSpeed's estimators, re-derived from their source (deepspeedai/DeepSpeed,
  deepspeed/runtime/zero/stage_1_and_2.py `estimate_zero2_model_states_mem_needs` and
  deepspeed/runtime/zero/stage3.py `estimate_zero3_model_states_mem_needs`, no offload):
  ZeRO-2 4Ψ + 16Ψ/N, ZeRO-3 4·P_max + 18Ψ/N with P_max the largest module's own parameters
  (`model_to_params`); there is none for DDP or ZeRO-1;
- accelerate's `estimate-memory` (huggingface/accelerate, src/accelerate/commands/estimate.py
  `estimate_training_usage`, shown as the largest of its parts by `estimate_command`): with
  mixed precision max(4Ψ, 6Ψ, 8Ψ) = 8Ψ, in fp32 16Ψ; one device, no sharding;
- torch's `FSDPMemTracker` (torch.distributed._tools.fsdp2_mem_tracker) over torch's own
  `fully_shard` (FSDP2, bf16 MixedPrecisionPolicy) of the same GPT on the same gloo ranks:
  ZeRO-3's row;
- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
  eq. 1): s·b·h·(34 + 5·a·s/h) bytes of activations per layer (s sequence, b rows, h width,
  a heads), next to the bytes one block's forward keeps, counted on the meta device for every
  preset (`counted_per_layer`).

    python -m zerolab.course.fitanchors              # both tables (~3 min on 2 cores)
    python -m zerolab.course.fitanchors --markdown   # the same, as docs/fit.md's tables
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

PRESETS = ("nano", "tiny", "small")
WORLD, ROWS = 2, 4


# --- the formulas, as their sources write them ----------------------------------------------
def deepspeed_zero2(psi: int, n: int) -> int:
    """estimate_zero2_model_states_mem_needs(cpu_offload=False)'s gpu_mem: 4Ψ + 16Ψ/N bytes."""
    return 4 * psi + int(16 * psi / n)


def deepspeed_zero3(psi: int, largest: int, n: int) -> int:
    """estimate_zero3_model_states_mem_needs(cpu_offload=False)'s gpu_mem: 4·P_max + 18Ψ/N."""
    return 4 * largest + int(18 * psi / n)


def largest_layer_params(model) -> int:
    """DeepSpeed's model_to_params: the most parameters one module holds itself (recurse=False)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def accelerate_training(psi: int, mixed: bool = True) -> int:
    """accelerate estimate-memory's "Training using Adam": the largest of model 4Ψ, gradients
    6Ψ (mixed) or 4Ψ, optimizer 8Ψ, step 8Ψ (mixed) or 16Ψ (fp32)."""
    return 8 * psi if mixed else 16 * psi


def korthikanti(cfg, rows: int) -> float:
    """Activation bytes per transformer layer, Korthikanti et al. 2022 eq. 1 (16-bit, no
    recomputation): s·b·h·(34 + 5·a·s/h)."""
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    return s * rows * h * (34 + 5 * a * s / h)


def counted_per_layer(preset: str, rows: int = 1, block_size: int | None = None) -> int:
    """Bytes one block's forward keeps for backward at the preset's shape, `rows` rows: the
    counted activations of the GPT with 2 layers minus those with 1 (`run.fit.simulate`, DDP,
    N = 1, bf16, on the meta device); block_size: the sequence length (default: the preset's)."""
    from ..run import fit, fitreport
    from .fitcheck import fit_args
    got = []
    for layers in (1, 2):
        args = fit_args(["--preset", preset, "--n-layer", str(layers), "--steps", "1",
                         "--batch-size", str(rows), "--nproc", "1"]
                        + (["--block-size", str(block_size)] if block_size else []))
        n, every, target = fitreport.check_args(args)
        got.append(fit.simulate(args, 0, 1, rows, target)["activations"])
    return got[1] - got[0]


# --- torch's own tracker over torch's own FSDP2 ---------------------------------------------
def fsdp_run(preset: str, rows: int, out: Path):
    """One rank: the preset's GPT under fully_shard (each block, then the root; bf16
    MixedPrecisionPolicy, AdamW on the fp32 shards), two steps, the second under
    FSDPMemTracker; writes OUT/fsdp_rank{r}.json {"peak", "by_type"}."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..model import GPT, get_config
    dist.init_process_group("gloo")
    cfg = get_config(preset)
    torch.manual_seed(0)
    model = GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.zeros(rows, cfg.block_size, dtype=torch.long)

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    step()
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((x, x))
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")
    stats = {str(k).split(".")[-1]: int(v) for d, s in snap.items() for k, v in s.items()}
    (out / f"fsdp_rank{dist.get_rank()}.json").write_text(json.dumps(
        {"peak": stats.pop("Total"), "by_type": stats}))
    dist.destroy_process_group()


def measured_fsdp(preset: str, out: Path) -> dict:
    from ..run.launch import run_torchrun
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun(["--fsdp-run", "--preset", preset, "--out", str(out)], WORLD, timeout=600,
                 module="zerolab.course.fitanchors", echo=lambda *a, **k: None)
    return json.loads((out / "fsdp_rank0.json").read_text())


# --- the tables -------------------------------------------------------------------------------
def anchors_table() -> list[dict]:
    """One row per preset and stage: bytes measured, zerolab fit's, DeepSpeed's, accelerate's,
    FSDPMemTracker's (None where an anchor has no such case)."""
    import torch

    from .. import theory
    from ..model import GPT, get_config
    from .fitcheck import measured_gpt, predicted
    rows = []
    with tempfile.TemporaryDirectory(prefix="fitanchors") as tmp:
        for preset in PRESETS:
            argv, runs = measured_gpt(preset, WORLD, ROWS, False, Path(tmp) / preset)
            pred = predicted(argv, range(4), WORLD, ROWS)
            fsdp = measured_fsdp(preset, Path(tmp) / f"{preset}_fsdp")
            with torch.device("meta"):
                model = GPT(get_config(preset))
            psi = sum(p.numel() for p in model.parameters())
            largest = largest_layer_params(model)
            for s in range(4):
                rows.append({
                    "preset": preset, "stage": theory.STAGE_NAMES[s], "psi": psi,
                    "measured": runs[s]["memory"]["allocator"]["peak_absolute"],
                    "fit": pred[s]["peak"],
                    "deepspeed": (deepspeed_zero2(psi, WORLD) if s == 2 else
                                  deepspeed_zero3(psi, largest, WORLD) if s == 3 else None),
                    "accelerate": accelerate_training(psi) if s == 0 else None,
                    "fsdp_tracker": fsdp["peak"] if s == 3 else None})
    return rows


def korthikanti_table(rows: int = 1) -> list[dict]:
    """Per preset: Korthikanti's bytes per layer and the counted ones, b = `rows`."""
    from ..model import PRESETS as ALL, get_config
    out = []
    for preset in ALL:
        cfg = get_config(preset)
        out.append({"preset": preset, "s": cfg.block_size, "h": cfg.n_embd, "a": cfg.n_head,
                    "korthikanti": korthikanti(cfg, rows),
                    "korthikanti_no_dropout_flash": no_dropout_flash(cfg, rows),
                    "counted": counted_per_layer(preset, rows)})
    return out


def no_dropout_flash(cfg, rows: int) -> float:
    """Korthikanti's count for this model: no dropout (minus the two one-byte sbh masks of the
    attention output and the MLP, and the a·s²·b attention-dropout mask) and a flash kernel
    (no 2a·s²·b softmax and no 2a·s²·b dropout output; the kernel's output is the projection's
    input, already counted, and it keeps the fp32 logsumexp, 4a·s·b): 32·s·b·h + 4·a·s·b."""
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    return s * rows * h * 32 + 4 * a * s * rows


def _pct(x, ref):
    return "-" if x is None else f"{x / ref - 1:+.1%}"


def format_tables(anchors: list[dict], kort: list[dict], markdown: bool = False) -> str:
    head = ["preset", "stage", "measured", "zerolab fit", "DeepSpeed", "accelerate",
            "FSDPMemTracker"]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("".join(f"{h:>16}" for h in head))
    for r in anchors:
        cells = [r["preset"], r["stage"], f"{r['measured']:,}"] + [
            "-" if r[k] is None else f"{r[k]:,} ({_pct(r[k], r['measured'])})"
            for k in ("fit", "deepspeed", "accelerate", "fsdp_tracker")]
        lines.append("| " + " | ".join(cells) + " |" if markdown else
                     "".join(f"{c:>16}" for c in cells))
    lines.append("")
    head = ["preset", "s", "h", "a", "eq. 1", "eq. 1 adjusted", "counted", "counted / eq. 1",
            "counted / adjusted"]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("".join(f"{h:>18}" for h in head))
    for r in kort:
        cells = [r["preset"], str(r["s"]), str(r["h"]), str(r["a"]), f"{r['korthikanti']:,.0f}",
                 f"{r['korthikanti_no_dropout_flash']:,.0f}", f"{r['counted']:,}",
                 f"{r['counted'] / r['korthikanti']:.2f}",
                 f"{r['counted'] / r['korthikanti_no_dropout_flash']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |" if markdown else
                     "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab.course.fitanchors",
                                description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="tables as markdown (docs/fit.md)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--fsdp-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="nano", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fsdp_run:
        fsdp_run(args.preset, ROWS, Path(args.out))
        return 0
    kort = korthikanti_table()
    anchors = anchors_table()
    print(format_tables(anchors, kort, args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps({"anchors": anchors, "korthikanti": kort},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
