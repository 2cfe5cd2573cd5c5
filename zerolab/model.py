"""A small decoder-only GPT (GPT-2 style, byte-level vocabulary), with named size presets.

Idea: the model is deliberately ordinary so that all attention goes to who holds its states.
`zero_units()` names the blocks that ZeRO-2 reduces and ZeRO-3 gathers one at a time; the tied
token embedding / output head, the position embedding and the final LayerNorm form the root unit.

    python -m zerolab train --stage 3 --preset tiny --nproc 2

Presets (vocab 256 bytes): "nano" and "tiny" train in seconds on a 2-core CPU; "small" in
minutes; "gpt2" (~85M), "medium" (~300M) and "1b" (~1.2B) are for GPUs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64        # context length T (tokens)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    tie_weights: bool = True    # output head shares the token embedding (GPT-2)
    activation_checkpointing: bool = False   # keep only each block's input; recompute in backward


PRESETS = {
    "nano": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=64),
    "small": GPTConfig(block_size=128, n_layer=6, n_head=6, n_embd=192),
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "medium": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "1b": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=2048),
}


def get_config(preset: str, **overrides) -> GPTConfig:
    """The preset's GPTConfig with `overrides` applied; ValueError names an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    return GPTConfig(**{**asdict(PRESETS[preset]), **overrides})


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). x: [B, T, C].

    With `cfg.activation_checkpointing` the block saves only its input x for backward and runs
    its forward again inside backward (`torch.utils.checkpoint`, non-reentrant): the block's
    internal activations are not kept, at the price of a second forward of every block. The
    checkpoint wraps the block's computation, not the module call, so the module hooks of
    ZeRO-2/3 (gather, free, bucket) fire once per pass as without it."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.activation_checkpointing = cfg.activation_checkpointing
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.attn_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)                # [B, T, C] each
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # [B, H, T, C/H]
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """idx [B, T] int64 byte tokens, targets [B, T] -> mean cross-entropy loss (fp32 scalar)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def zero_units(self):
        """(name, module) of the units that are bucketed (ZeRO-2) and gathered (ZeRO-3)."""
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, idx, targets):
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))   # [B, T, C]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                                # [B, T, vocab]
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def num_params(model: nn.Module, trainable_only: bool = True) -> int:
    """Ψ: distinct parameters (tied weights counted once), trainable ones by default."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
