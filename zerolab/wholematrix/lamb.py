"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", arXiv 1904.00962, Algorithm 2) as a torch.optim.Optimizer, written from the paper.

Idea: Adam's update r = m̂ / (√v̂ + ε) plus decoupled weight decay λx, rescaled per layer (here:
per parameter tensor) by the trust ratio φ(‖x‖) / ‖r + λx‖, so that every layer moves by about
lr times its own norm. It reads a parameter's whole norm, so ZeRO's flat ranges cannot step it:
zerolab's MuonOwner and MuonReplicate can (tests/test_muon.py).

    m_t = β1·m + (1 - β1)·g            v_t = β2·v + (1 - β2)·g²
    m̂ = m_t / (1 - β1^t)               v̂ = v_t / (1 - β2^t)
    r = m̂ / (√v̂ + ε)                   x ← x - lr · φ(‖x‖) / ‖r + λx‖ · (r + λx)

φ is the identity (the paper's experiments; its φ(z) = min(max(z, γ_l), γ_u) with no bounds).
Where ‖x‖ or ‖r + λx‖ is 0 the ratio is 1 (the paper leaves it open; NVIDIA's and the
reference implementations do this), so a zero-initialised bias still moves.
"""
from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """params: tensors or groups; lr (> 0), betas (each in [0, 1)), eps (>= 0), weight_decay
    λ (>= 0): the paper's symbols. State per parameter: step (fp32 scalar tensor), exp_avg m
    and exp_avg_sq v (the parameter's shape and dtype). ValueError (one line) for a bad value."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        if not lr > 0:
            raise ValueError(f"lr = {lr!r}: must be > 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas = {betas!r}: two numbers in [0, 1)")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"eps = {eps!r}, weight_decay = {weight_decay!r}: both must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for x in group["params"]:
                if x.grad is None:
                    continue
                g, state = x.grad, self.state[x]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(x)
                    state["exp_avg_sq"] = torch.zeros_like(x)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                r = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
                if wd:
                    r.add_(x, alpha=wd)
                x_norm, r_norm = x.norm(), r.norm()
                trust = (x_norm / r_norm).item() if x_norm > 0 and r_norm > 0 else 1.0
                x.add_(r, alpha=-lr * trust)
        return loss
