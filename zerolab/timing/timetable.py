"""The table `zerolab time` prints: every stage's step time from the cost model, and ZeRO-3's T*.

Idea: one place says what the model assumed, in the table's header (the width from Ψ ≈ 12·L·d²
when not given, the sequence length for attention's FLOPs, the MFU and its source, ring or tree
all_reduces), then replays each stage with and without overlap (`costmodel.step_time`) and prints
the threshold T* below which ZeRO-3 is communication-bound, at the MFU given and at `SENSITIVITY`'s.

    python -m zerolab time --params 7.5e9 --world-size 64 --tokens-per-rank 4096 --mfu 0.4
"""
from __future__ import annotations

import math
import numbers

from .. import theory
from . import costmodel
from .hardware import Device, Link

SENSITIVITY = (0.3, 0.4, 0.5, 1.0)          # the MFUs the threshold is also printed at


def format_time_table(psi: float, world_size: int, tokens_per_rank: float, link: Link,
                      device: Device, n_blocks: int = 32, precision: str = "bf16",
                      mfu: float = costmodel.MFU, *, d_model: int | None = None, seq_len: float = 2048,
                      algorithm: str = "ring") -> str:
    """The per-stage step time table that `zerolab time` prints (seconds shown as ms).

    Each of the n_blocks equal blocks is one transformer layer; its width d_model defaults to
    `shape_from_params` (Ψ ≈ 12·L·d²). seq_len: tokens per sequence for attention's FLOPs (at
    most tokens_per_rank; 0: the 6Ψ rule alone). mfu and algorithm: see `compute_time` and
    `collective_time`."""
    costmodel.check_mfu(mfu)
    costmodel.check_algorithm(algorithm)
    if not (isinstance(seq_len, numbers.Real) and 0 <= seq_len < math.inf):
        raise ValueError(f"seq_len {seq_len!r} must be a number of tokens >= 0")
    seq = min(seq_len, tokens_per_rank)
    d = costmodel.shape_from_params(psi, n_blocks) if d_model is None else d_model
    units = costmodel.uniform_units(psi, n_blocks, tokens_per_rank, device, mfu, d_model=d, seq_len=seq)
    attn = 12 * n_blocks * d * seq
    share = attn / (6 * psi + attn)
    given = "given" if d_model is not None else "from Ψ ≈ 12·L·d²"
    seqs = ("attention not counted (T = 0)" if not seq else f"in sequences of T = {seq:g}"
            + (" (capped at the tokens per rank)" if seq < seq_len else ""))
    lines = [f"Ψ = {psi:.4g} parameters in {n_blocks} equal blocks (one layer each, width d = {d:,} "
             f"{given}), N = {world_size} ranks, {tokens_per_rank:g} tokens per rank per step "
             f"{seqs}, {precision}",
             f"link {link.name}: β = {link.bandwidth / 1e9:.4g} GB/s per rank per direction "
             f"({link.gbps:.4g} Gb/s), α = {link.latency * 1e6:.3g} us per ring step",
             f"  source: {link.source}",
             f"device {device.name}: {device.flops / 1e12:.4g} TFLOP/s peak x MFU {mfu:g} = "
             f"{device.flops * mfu / 1e12:.4g} TFLOP/s reached",
             f"  source: {device.source}; MFU {costmodel.MFU:g} (the default) from {costmodel.MFU_SOURCE}",
             f"compute: 6Ψ + 12·L·d·T FLOPs per token (PaLM appendix B); attention's 12·L·d·T is "
             f"{share:.1%} of them",
             costmodel.latency_note(world_size, link, algorithm), "",
             f"{'stage':<24}{'compute':>10}{'comm':>10}{'no overlap':>12}{'overlap':>10}"
             f"{'exposed':>10}   comm by op (ms)"]
    variants = [(s, False) for s in (0, 1, 2)] + [(3, False), (3, True)]
    for stage, prefetch in variants:
        ops = ("all_reduce", "reduce_scatter") if stage == 1 else (None,)
        for op in ops:
            kw = dict(prefetch=prefetch, precision=precision, zero1_grad_op=op or "all_reduce",
                      algorithm=algorithm)
            serial = costmodel.step_time(stage, units, world_size, link, overlap=False, **kw)
            over = costmodel.step_time(stage, units, world_size, link, overlap=True, **kw)
            name = theory.STAGE_NAMES[stage] + (f" ({op})" if op else "") + (
                " +prefetch" if prefetch else "")
            parts = ", ".join(f"{k} {v * 1e3:.4g}" for k, v in over.by_op().items() if v)
            lines.append(f"{name:<24}{over.compute * 1e3:>10.4g}{over.comm * 1e3:>10.4g}"
                         f"{serial.total * 1e3:>12.4g}{over.total * 1e3:>10.4g}"
                         f"{over.exposed_comm * 1e3:>10.4g}   {parts}")
    block = psi / n_blocks
    shape = dict(d_model=d, seq_len=seq)
    t_star = costmodel.zero3_comm_bound_tokens(block, world_size, link, device, precision, mfu, **shape)
    bound = "communication-bound" if tokens_per_rank < t_star else "compute-bound"
    w = theory.bytes_per_param(precision)["params"]
    bw_term = (world_size - 1) / world_size * w / 2 * device.flops * mfu / link.bandwidth
    by_mfu = ", ".join(f"{m:g}: {costmodel.zero3_comm_bound_tokens(block, world_size, link, device, precision, m, **shape):,.0f}"
                       for m in SENSITIVITY)
    lines += ["", "times in ms per optimizer step; 'exposed' = overlap - compute (comm not hidden)",
              f"ZeRO-3 threshold: a block's all_gather equals its forward compute at T* = "
              f"{t_star:,.0f} tokens per rank; at {tokens_per_rank:g} tokens per rank ZeRO-3 is {bound}",
              f"  T* = all_gather x F·MFU / ((2Ψ_b + 4·d·T) FLOPs per token); its bandwidth part "
              f"without attention, (n-1)/n · (w/2) · F·MFU/β = {bw_term:,.0f} (w = {w} bytes per param)",
              f"  T* at MFU {by_mfu} tokens per rank (T* grows with MFU: faster compute needs more "
              f"tokens to hide the same gather)"]
    return "\n".join(lines)
