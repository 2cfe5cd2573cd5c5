"""Stage 0, plain data parallelism (DDP): every rank holds every state in full.

Idea (the notes' "训练流程梳理"): each rank runs forward and backward on its own micro-batch with a
full copy of the bf16 weights; as each bucket's gradients are ready during backward they are
all-reduced, so every rank ends backward with the same averaged full gradient; every rank then
runs the same AdamW on its full fp32 master weights, exp_avg and exp_avg_sq, and the replicas stay
identical without any further communication. Per rank: 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 0 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py (the frame: zerolab/strategy.py):
hold (who holds what) / backward's hooks / update (the step) / state_tensors / checkpoint.
"""
from __future__ import annotations

import torch

from .strategy import Strategy


def all_reduce_bucket(comm, unit, world_size: int):
    """Called from the gradient hook as soon as every gradient of `unit` is in `unit.grad_flat`
    ([Ψ_u], replicated): start an async all_reduce of the bucket that leaves the *average* over
    the ranks in it; return the Handle (backward waits for it before the step).
    Exercise (b) of notebooks/exercises: `zerolab check ddp --impl FILE` replaces it."""
    handle = comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True)
    handle.on_done = lambda: unit.grad_flat.div_(world_size)        # sum -> average
    return handle


class DDP(Strategy):
    """Stage 0 around `model` on the ranks of `comm` (zerolab.comm.Comm); the options are
    `Strategy`'s (max_grad_norm, find_unused_parameters, grad_dtype, bucket_mb, meter, AdamW's)."""

    stage, name = 0, "DDP"

    # --- who holds what: every state in full, on every rank ------------------------------------------
    def hold(self, u):
        u.param_flat = u.flatten()                              # [Ψ_u] bf16, replicated
        u.bind_params(u.param_flat)                             # the parameters: views of it
        u.grad_flat = torch.zeros_like(u.param_flat, dtype=self.grad_dtype)  # [Ψ_u] bf16
        u.bind_grads(u.grad_flat)                               # autograd accumulates into it
        u.master = self.new_master(u)                           # [Ψ_u] fp32, replicated

    def own(self, u, full):                 # the optimizer updates all of it, on every rank
        return full

    # --- backward: all_reduce each bucket as soon as its grads are ready -------------------------
    def _grads_ready(self, u):
        if self.sync:
            self.inflight.append(all_reduce_bucket(self.comm, u, self.n))
            self._sample(f"all_reduce {u.name}")

    # --- step: every rank runs the same AdamW on the full state ----------------------------------
    def update(self, used) -> torch.Tensor:
        norm = self.adamw([u.grad_flat for u in self.units], used)         # [Ψ_u] fp32 each
        self.publish_all()                  # every unit: `publish`; p.grad then reads zeros
        return norm

    def publish(self, u):
        u.param_flat.copy_(u.master)                            # fp32 -> bf16, in place

    # --- what this rank holds --------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [u.param_flat for u in self.units],
                "grads": [u.grad_flat for u in self.units], **self.optimizer_tensors()}
