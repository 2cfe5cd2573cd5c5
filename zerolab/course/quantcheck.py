"""What ZeRO++'s quantized collectives save and what they cost, measured on the `tiny` GPT.

zerolab/variants/quant.py is the mechanism (qwZ: int8 weight all_gathers; qgZ: the gradient reduce_scatter
as an all_to_all of int8 / int4 codes), `theory.quantized_traffic_bytes` the formula. Three
measurements, each re-runnable:

1. `weight_error(state)`: one quantized gather of every unit's bf16 weights (2 ranks' shards,
   block-wise int8 and, for comparison, int4, at several block sizes), next to the exact bf16
   weights: RMS error relative to the weights' RMS (||Δ||/||w||), the largest error relative to
   the weights' RMS (max|Δ| / RMS(w)), and the largest error in units of its block's scale
   (<= 0.5: round to nearest). Computed locally: tests/test_quant.py shows the gather over gloo
   ranks gives exactly these values. `grad_error()`: the same for one qgZ reduction of real
   gradients (two ranks' micro-batches) against the exact fp32 sum of the bf16 gradients.
2. `bytes_per_step`: the comm ledger of a step (ZeRO-3, 2 gloo ranks) for each configuration,
   next to `theory.quantized_traffic_bytes` at the run's shard sizes (they must be equal).
3. `loss_drift`: `tiny`, 2 gloo ranks, ZeRO-3, `steps` steps of `zerolab train`'s own loop
   (run.stage.run_stage, its defaults: batch 8, lr 1e-3, seed 0) for bf16, qwZ, qwZ + qgZ int4
   and a yardstick (bf16 with fp32 gradients: a different but harmless rounding); per run the
   final loss, the held-out loss, and against bf16 the final difference and max |difference|.

    python -m zerolab.course.quantcheck --steps 300 > /tmp/quantcheck.txt     # ~15 min, 2 cores
    python -m zerolab.course.quantcheck --steps 20                            # ~2 min
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile

import torch

from .. import theory
from ..variants import quant
from ..model import GPT, get_config
from ..sharding import build_units
from .testing import run_ranks

#: name -> (zerolab train flags); "bf16" is the baseline every other run is compared with
CONFIGS = {
    "bf16": [],
    "qwZ int8": ["--quantize-weights", "int8"],
    "qwZ int8 + qgZ int4": ["--quantize-weights", "int8", "--quantize-grads", "int4"],
    "bf16, fp32 grads": ["--grad-dtype", "fp32"],
}
BLOCKS = (64, 256, 2048)


def tiny_state(seed: int = 0) -> dict:
    """The `tiny` GPT's initial weights (seed as `zerolab train`), bf16."""
    torch.manual_seed(seed)
    return GPT(get_config("tiny")).to(torch.bfloat16).state_dict()


def _units(state: dict, n: int):
    model = GPT(get_config("tiny")).to(torch.bfloat16)
    model.load_state_dict(state)
    return model, build_units(model, n, 0)


def _errors(exact: torch.Tensor, approx: torch.Tensor, scale_units: torch.Tensor) -> dict:
    d, x = (approx - exact).float(), exact.float()
    return {"rms_rel": (d.norm() / x.norm()).item(),
            "max_rel": (d.abs().max() / x.pow(2).mean().sqrt()).item(),
            "max_in_scales": scale_units.max().item()}


def weight_error(state: dict | None = None, n: int = 2, blocks=BLOCKS, bits=(8, 4)) -> list[dict]:
    """One row per (bits, block, unit): the error of a quantized all_gather of the unit's bf16
    weights over n ranks (each rank's shard quantized on its own, dequantized into bf16)."""
    _, units = _units(state or tiny_state(), n)
    rows = []
    for b in bits:
        for block in blocks:
            for u in units:
                flat = u.flatten()                                      # [Ψ_u] bf16, padded
                shards = flat.view(n, -1)
                codes, scales = quant.quantize(shards, b, block)
                got = quant.dequantize(codes, scales, block).to(flat.dtype).reshape(-1)
                in_scales = ((quant.dequantize(codes, scales, block) - shards.float()).abs()
                             / scales.repeat_interleave(block, -1)[..., :shards.shape[1]]
                             .clamp_min(1e-30))
                rows.append({"bits": b, "block": block, "unit": u.name, "numel": u.numel,
                             **_errors(flat, got, in_scales)})
    return rows


def grad_error(n: int = 2, blocks=BLOCKS, bits=(4, 8), seed: int = 0) -> list[dict]:
    """One row per (bits, block, unit): a qgZ reduction of n ranks' bf16 gradients of the initial
    `tiny` GPT (rank r: rows of one batch, as `zerolab train` splits it) against their exact fp32
    sum."""
    from ..data import get_batch, load_tokens, rank_slice
    cfg = get_config("tiny")
    tokens, _ = load_tokens(None, cfg.block_size)
    x, y = get_batch(tokens, 0, 8, cfg.block_size, seed)
    grads = []
    for r in range(n):
        model, units = _units(tiny_state(seed), n)
        model(rank_slice(x, r, n), rank_slice(y, r, n)).backward()
        grads.append([u.flatten([p.grad for p in u.params]) for u in units])    # [Ψ_u] bf16
    rows = []
    for b in bits:
        for block in blocks:
            for k, u in enumerate(units):
                exact = sum(g[k].float() for g in grads)
                got = sum(quant.dequantize(*quant.quantize(g[k].view(n, -1), b, block), block)
                          .reshape(-1) for g in grads)
                rows.append({"bits": b, "block": block, "unit": u.name, "numel": u.numel,
                             **_errors(exact, got, torch.zeros(1))})
    return rows


def _run_worker(rank, n, configs: dict, steps: int, out: str):
    """On each rank: every configuration, `steps` steps of run_stage (ZeRO-3, tiny)."""
    from ..comm import Comm
    from ..data import load_tokens
    from ..run import knobs, options
    from ..run.stage import run_stage
    comm, results = Comm(), {}
    for name, flags in configs.items():
        args = options.parse("ranks", ["--stage", "3", "--preset", "tiny", "--steps", str(steps),
                                       "--no-allocator", "--out", f"{out}/{len(results)}",
                                       "--save-params", *flags])
        cfg = options.check(args, n)
        train_tokens, val_tokens = load_tokens(args.data, cfg.block_size)
        with contextlib.redirect_stdout(io.StringIO()):
            r = run_stage(3, args, comm, torch.device("cpu"), train_tokens, val_tokens)
        spec = knobs.quantize(args) or quant.Quantize()
        shards = [u["shard_numel"] for u in r["units"]]
        formula = theory.quantized_traffic_bytes(shards, n, spec.weights, spec.grads, spec.block,
                                                 grad_dtype=args.grad_dtype)
        results[name] = {"losses": r["losses"], "val_loss": r["val_loss"],
                         "step_s": r["step_times_s"], "bytes": r["comm"]["bytes_per_step"],
                         "formula": formula, "params": f"{out}/{len(results)}/stage3/params.pt"}
    return results


def run(steps: int = 300, n: int = 2, configs: dict | None = None,
        timeout: float | None = None) -> dict:
    """Measurements 2 and 3 (and 1 on the trained bf16 weights): {config: {...}}, rank 0's.
    timeout: seconds for all runs (default 5 s a step: a busy 2-core machine takes 1-3)."""
    configs = configs or CONFIGS
    timeout = timeout or 60 + 5 * steps * len(configs)
    with tempfile.TemporaryDirectory(prefix="zerolab-quantcheck-") as out:
        res = run_ranks(_run_worker, n, configs, steps, out, timeout=timeout)[0]
        trained = torch.load(res["bf16"]["params"], weights_only=True) if "bf16" in res else None
    for r in res.values():
        del r["params"]
    if trained is not None:
        state = {k: v.to(torch.bfloat16) for k, v in trained.items()}
        res["_weight_error_trained"] = weight_error(state, n, blocks=(quant.DEFAULT_BLOCK,),
                                                    bits=(8,))
    return res


# --- tables ----------------------------------------------------------------------------------------
def _summary(rows):
    """Per (bits, block): the worst unit's figures and the all-units RMS (weighted by numel)."""
    out = {}
    for r in rows:
        key = (r["bits"], r["block"])
        o = out.setdefault(key, {"rms2": 0.0, "numel": 0, "max_rel": 0.0, "max_in_scales": 0.0,
                                 "worst_rms": 0.0})
        o["rms2"] += r["rms_rel"] ** 2 * r["numel"]
        o["numel"] += r["numel"]
        o["worst_rms"] = max(o["worst_rms"], r["rms_rel"])
        o["max_rel"] = max(o["max_rel"], r["max_rel"])
        o["max_in_scales"] = max(o["max_in_scales"], r["max_in_scales"])
    return out


def format_errors(rows, what="weights") -> str:
    head = (f"{what}: bits block   RMS rel (mean / worst unit)   max|Δ|/RMS(x)   "
            "max|Δ| in scales")
    lines = [head]
    for (b, block), o in sorted(_summary(rows).items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        scales = f"{o['max_in_scales']:.3f}" if o["max_in_scales"] else "-"
        lines.append(f"  int{b:<4}{block:>6}   {math.sqrt(o['rms2'] / o['numel']):>10.2e} / "
                     f"{o['worst_rms']:.2e}   {o['max_rel']:>13.2e}   {scales:>16}")
    return "\n".join(lines)


def format_bytes(res: dict) -> str:
    base = sum(res["bf16"]["bytes"].values()) if "bf16" in res else None
    lines = [f"{'config':<22}{'all_gather':>12}{'reduce_scatter':>16}{'total':>10}{'formula':>10}"
             f"{'equal':>7}{'vs bf16':>9}"]
    for name, r in res.items():
        if name.startswith("_"):
            continue
        b, f = r["bytes"], r["formula"]
        total = sum(b.values())
        same = all(b.get(op, 0.0) == f[op] for op in f)
        lines.append(f"{name:<22}{b['all_gather']:>12,.0f}{b['reduce_scatter']:>16,.0f}"
                     f"{total:>10,.0f}{sum(f.values()):>10,.0f}{str(same):>7}"
                     f"{total / base if base else float('nan'):>9.3f}")
    return "\n".join(lines)


def format_drift(res: dict) -> str:
    base = res["bf16"]["losses"]
    lines = [f"{'config':<22}{'final loss':>11}{'val loss':>10}{'Δ final':>10}{'max |Δ|':>9}"
             f"{'mean |Δ|':>10}{'ms/step':>9}"]
    for name, r in res.items():
        if name.startswith("_"):
            continue
        d = [a - b for a, b in zip(r["losses"], base)]
        ms = sorted(r["step_s"][1:-1] or r["step_s"])[len(r["step_s"][1:-1] or r["step_s"]) // 2]
        lines.append(f"{name:<22}{r['losses'][-1]:>11.4f}{r['val_loss']:>10.4f}{d[-1]:>+10.4f}"
                     f"{max(map(abs, d)):>9.4f}{sum(map(abs, d)) / len(d):>10.4f}{ms * 1e3:>9.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab.course.quantcheck", description=__doc__
                                .split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps per training run")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--no-train", action="store_true", help="only the weight / gradient errors")
    args = p.parse_args(argv)
    w, g = weight_error(), grad_error()
    print("1. error of one quantized collective, tiny at init, 2 ranks (B = block, fp32 scales)")
    print(format_errors(w, "weights (qwZ gather)"))
    print(format_errors(g, "grads (qgZ reduction)"))
    res = {}
    if not args.no_train:
        res = run(args.steps)
        print(format_errors(res["_weight_error_trained"], f"weights after {args.steps} bf16 steps"))
        print("\n2. ledger bytes per rank of the last step (ZeRO-3, tiny, 2 gloo ranks) vs "
              "theory.quantized_traffic_bytes")
        print(format_bytes(res))
        print(f"\n3. loss over {args.steps} steps against bf16 (Δ = config - bf16, per step)")
        print(format_drift(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"weight_error": w, "grad_error": g, "runs": res}, f)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
