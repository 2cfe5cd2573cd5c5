"""ZeRO stage 1: the optimizer state (fp32 master, exp_avg, exp_avg_sq) is sharded 1/N.

Idea (the notes' "ZeRO Stage 1"): forward and backward are DDP's - full bf16 weights, full
gradients all-reduced bucket by bucket. Only the update changes: rank r keeps the fp32 master
weights, exp_avg and exp_avg_sq of its own contiguous range of each bucket, updates only that
range, writes it into its bf16 weights, and an all_gather at the end of the step brings every
rank's updated range to everyone. Per rank: 2Ψ + 2Ψ + 12Ψ/N bytes (5.5Ψ at N = 8); traffic
3(n-1)/n·2Ψ a step (the all_reduce's 2, the all_gather's 1).

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 1 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py (the frame: zerolab/strategy.py):
hold (who holds what) / backward's hooks / update (the step) / state_tensors / checkpoint.
Variants, each in its own module: the gradient as a reduce_scatter (zerolab/variants/zero1rs.py), the
all_gather just before the next forward (zerolab/variants/placement.py), the optimizer on the host
(zerolab/variants/offload.py).
"""
from __future__ import annotations

import torch

from .strategy import Strategy


# --- the two halves of the sharded update (exercise (c): `zerolab check zero1 --impl FILE`) ----
def own_gradient(unit):
    """The averaged gradient of this rank's range, as fp32 [Ψ_u/N]: what AdamW updates the master
    shard `unit.master` with (after the backward, `unit.grad_flat` [Ψ_u] holds it)."""
    return unit.own(unit.grad_flat).float()


def publish_update(comm, unit):
    """AdamW has updated `unit.master` (fp32 [Ψ_u/N], this rank's range): write it into this rank's
    range of the bf16 weights `unit.param_flat` [Ψ_u], then start an async all_gather that brings
    every rank's updated range to every rank; return its Handle."""
    unit.own(unit.param_flat).copy_(unit.master)                   # fp32 -> bf16, own range
    return comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params",
                           unit=unit.name, async_op=True)


class ZeRO1(Strategy):
    """Stage 1 around `model` on the ranks of `comm` (zerolab.comm.Comm); the options are
    `Strategy`'s (max_grad_norm, find_unused_parameters, grad_dtype, bucket_mb, meter, AdamW's)."""

    stage, name = 1, "ZeRO-1"
    grad_op, gather = "all_reduce", "after_step"      # (zero1rs.py, placement.py: the others)

    # --- who holds what: weights and gradients in full, the optimizer's state 1/N ----------------
    def hold(self, u):
        u.param_flat = u.flatten()                              # [Ψ_u] bf16, replicated
        u.bind_params(u.param_flat)                             # the parameters: views of it
        u.grad_flat = torch.zeros_like(u.param_flat, dtype=self.grad_dtype)  # [Ψ_u] bf16
        u.bind_grads(u.grad_flat)                               # autograd accumulates into it
        u.master = self.new_master(u)                           # [Ψ_u/N] fp32, this rank's range

    # --- backward: as DDP, all_reduce each bucket as soon as its grads are ready ------------------
    def _grads_ready(self, u):
        if self.sync:
            handle = self.comm.all_reduce(u.grad_flat, what="grads", unit=u.name, async_op=True)
            handle.on_done = lambda: u.grad_flat.div_(self.n)       # sum -> average
            self.inflight.append(handle)
            self._sample(f"all_reduce {u.name}")

    # --- step: update the owned range, then all_gather every rank's range -----------------------
    def update(self, used) -> torch.Tensor:
        norm = self.adamw([own_gradient(u) for u in self.units], used, self.comm)  # [Ψ_u/N]
        self.publish_all()                  # every unit: `publish`, then wait for the gathers
        return norm

    def publish(self, u):
        return publish_update(self.comm, u)         # own range into bf16, all_gather it

    # --- what this rank holds --------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [u.param_flat for u in self.units],
                "grads": [u.grad_flat for u in self.units], **self.optimizer_tensors()}
