"""Compute time: the FLOPs of a training step and the fraction of the device's peak it reaches.

Idea: a token through a dense transformer costs 2Ψ FLOPs forward (one multiply-add per weight)
plus 4·L·d·s for attention (in each of L layers, the scores QKᵀ and the weighted sum AV, s·d
multiply-adds per token each: s the sequence length, d the width), and twice that backward:

    FLOPs per token = 6Ψ + 12·L·d·s          (PaLM, Chowdhery et al. 2022, appendix B)

the count MFU (model FLOPs utilization) is defined with. Compute time is those FLOPs over the
FLOP/s training really reaches, F · MFU, with F the datasheet peak (`hardware.py`). MFU defaults to
0.4: Llama 3 reports 38-43 % on 8k-16k H100s, PaLM 46.2 % on TPU v4; 1.0 is the peak, a floor on
compute time that no run reaches. `costmodel` re-exports everything here.

    compute_time(7.5e9, 4096, get_device("h100"))                 # 6Ψ at 0.4 x 989 TFLOP/s
    compute_time(7.5e9, 4096, h100, n_layer=32, d_model=4096, seq_len=2048, mfu=0.5)
"""
from __future__ import annotations

import math
import numbers

from .hardware import Device

# Model FLOPs utilization: the FLOPs of 6Ψ + 12·L·d·s per token a training run gets through per
# second, as a fraction of the device's datasheet peak. 0.4 is what large dense runs report:
MFU = 0.4
MFU_SOURCE = ("Llama 3 (Dubey et al. 2024, table 4): BF16 MFU 38-43 % on 8,192-16,384 H100s; "
              "PaLM (Chowdhery et al. 2022): 46.2 % on 6,144 TPU v4 chips")


def check_mfu(mfu, flag: str = "mfu") -> float:
    """`mfu` as a float; ValueError (one line, naming the value and the range) unless 0 < mfu <= 1."""
    if isinstance(mfu, bool) or not isinstance(mfu, numbers.Real) or not 0 < mfu <= 1:
        raise ValueError(f"{flag} {mfu!r} is not in (0, 1]: the fraction of the device's peak "
                         f"FLOP/s that training reaches (MFU; default {MFU:g})")
    return float(mfu)


PASSES = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}     # multiples of the forward's FLOPs


def flops_per_token(psi: float, *, n_layer: int = 0, d_model: int = 0, seq_len: float = 0,
                    passes: str = "fwd+bwd") -> float:
    """Training FLOPs per token through Ψ parameters: forward 2Ψ + 4·L·d·s, backward twice that.

    2Ψ: one multiply-add per weight. 4·L·d·s: in each of the L layers, the attention scores QKᵀ
    and the weighted sum AV, each s·d multiply-adds per token (all heads together: d = n_head ·
    d_head) - FLOPs that no weight accounts for and that grow with the sequence length s. In all
    6Ψ + 12·L·d·s, the count PaLM (Chowdhery et al. 2022, appendix B) defines MFU with
    (torchtitan counts the same); the causal mask's skipped half is not subtracted. Kaplan et al.
    2020 (table 1) write the forward attention term as 2·n_layer·n_ctx·d_attn, half of this;
    Chinchilla (Hoffmann et al. 2022, appendix F) counts both matmuls, as here. Without a shape
    (n_layer, d_model or seq_len 0): the 6Ψ rule alone.
    passes: "fwd" (x1), "bwd" (x2) or "fwd+bwd" (x3).
    """
    if passes not in PASSES:
        raise ValueError(f"passes {passes!r} is not one of {', '.join(PASSES)}")
    return PASSES[passes] * (2 * psi + 4 * n_layer * d_model * seq_len)


def compute_time(psi: float, tokens: float, device: Device, *, passes: str = "fwd+bwd",
                 mfu: float = MFU, n_layer: int = 0, d_model: int = 0, seq_len: float = 0) -> float:
    """Seconds of compute for `tokens` tokens through Ψ parameters: FLOPs / (F · MFU).

    FLOPs per token from `flops_per_token` (6Ψ, plus 12·L·d·s when the shape is given; passes:
    "fwd", "bwd" or "fwd+bwd"). mfu: the fraction of the device's peak reached, (0, 1]
    (default `MFU` = 0.4; 1.0 is the datasheet peak). ValueError otherwise.
    """
    check_mfu(mfu)
    per_token = flops_per_token(psi, n_layer=n_layer, d_model=d_model, seq_len=seq_len,
                                passes=passes)
    return per_token * tokens / (device.flops * mfu)


def shape_from_params(psi: float, n_layer: int) -> int:
    """The width d of a GPT of Ψ parameters in `n_layer` blocks: Ψ ≈ 12·L·d² (attention 4d² +
    MLP 8d² per block; embeddings neglected), d = sqrt(Ψ / 12L) rounded to a multiple of 64."""
    d = math.sqrt(psi / (12 * n_layer))
    return max(64, int(round(d / 64)) * 64)
