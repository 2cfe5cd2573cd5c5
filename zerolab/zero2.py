"""ZeRO stage 2: gradients are sharded too, reduce-scattered layer by layer during backward.

Idea (the notes' "ZeRO-2 ... layer-by-layer 的 reduce-scatter"): forward is DDP's, with full bf16
weights. In backward, just before a block's backward runs, a bucket for its full local gradient
is allocated; as soon as the block's gradients are in it, the bucket is reduce-scattered and
freed, so each rank keeps only the averaged gradient of its own range. Full gradient alive at
once: the root bucket (tied embedding/head, open for the whole backward) plus at most three block
buckets (two reducing, one filling) - whatever the depth of the model; with `bucket_mb` a bucket
holds several consecutive blocks, so fewer reduce_scatters and a higher peak
(`theory.zero2_bucket_peak_bytes`). The update is ZeRO-1's: own range, then all_gather at the end
of the step. Per rank: 2Ψ + (2Ψ + 12Ψ)/N bytes (3.75Ψ at N = 8); traffic 2(n-1)/n·2Ψ a step.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 2 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py (the frame: zerolab/strategy.py):
hold (who holds what) / backward's hooks / update (the step) / state_tensors / checkpoint.
Variants, each in its own module: the all_gather just before the next forward
(zerolab/variants/placement.py), the optimizer on the host (zerolab/variants/offload.py).
"""
from __future__ import annotations

import torch

from .loop.guards import ShardedGrad, claim_grads, claim_shard_grads, shard_grads
from .sharding import on_pre_backward
from .strategy import Strategy


def reduce_scatter_bucket(comm, unit, world_size: int):
    """Called from the gradient hook as soon as every gradient of `unit` is in `unit.bucket`
    ([Ψ_u] bf16, this rank's full local gradient): start an async reduce_scatter whose result,
    averaged over the ranks, is *added* to `unit.grad_shard` ([Ψ_u/N], this rank's range; added
    so that micro-steps accumulate); when it is done, free the bucket (`unit.bucket = None` and
    every `p.grad = None` of `unit.params`). Return the Handle.
    Exercise (d) of notebooks/exercises: `zerolab check zero2 --impl FILE` replaces it."""
    out = unit.rs_out = torch.empty_like(unit.grad_shard)          # [Ψ_u/N] bf16, in flight
    handle = comm.reduce_scatter(out, unit.bucket, what="grads", unit=unit.name, async_op=True)

    def done():
        unit.grad_shard.add_(out.div_(world_size))                 # accumulate the averaged shard
        unit.bucket = unit.rs_out = None                           # free the full-gradient bucket
        for p in unit.params:
            p.grad = None
    handle.on_done = done
    return handle


class ZeRO2(Strategy):
    """Stage 2 around `model` on the ranks of `comm` (zerolab.comm.Comm); the options are
    `Strategy`'s (max_grad_norm, find_unused_parameters, grad_dtype, bucket_mb, meter, AdamW's).

    backward(sync=True): each bucket is reduce-scattered as soon as it is full, then freed, so
    the full gradient never outlives its block (accumulating micro-steps this way costs one
    reduce_scatter each). sync=False (torch's no_sync, FSDP2's set_requires_gradient_sync(False)):
    no traffic; the full local gradient stays in the buckets until a sync=True backward reduces
    the sum - ZeRO-1's gradient memory (2Ψ bytes, `theory.accumulation_grad_bytes`) for one
    reduce_scatter per step, and micro-step counts may differ between ranks."""

    stage, name = 2, "ZeRO-2"
    gather = "after_step"                           # (placement.py: before_forward)

    # --- who holds what: full weights; gradients and the optimizer's state 1/N -------------------
    def hold(self, u):
        u.param_flat = u.flatten()                              # [Ψ_u] bf16, replicated
        u.bind_params(u.param_flat)                             # the parameters: views of it
        u.grad_shard = torch.zeros(u.shard_numel, dtype=self.grad_dtype or u.param_flat.dtype,
                                   device=u.param_flat.device)  # [Ψ_u/N] bf16, this rank's range
        u.master = self.new_master(u)                           # [Ψ_u/N] fp32, this rank's range
        # the full gradient lives in a bucket opened when the unit's backward begins: at its last
        # block's pre-backward (every block's hook can open it: that block may be skipped here)
        self.handles += [on_pre_backward(m, lambda u=u: self._open_bucket(u))
                         for m in reversed(u.modules)]

    # --- backward: a bucket per block, reduce_scattered as soon as its grads are ready, freed ---
    def claim(self, u):                     # p.grad as the loop left it (zero_grad, assigned)
        if u.bucket is not None:            # accumulating after sync=False
            claim_grads(u, u.bucket)
        else:
            claim_shard_grads(u, self._open_bucket)
        if u.module is None:                # the root unit has no output to hook: open now
            self._open_bucket(u)

    def _open_bucket(self, u):
        if u.bucket is not None:            # open already (another block of this bucket)
            return
        u.bucket = torch.zeros_like(u.param_flat, dtype=u.grad_shard.dtype)  # [Ψ_u] bf16, transient
        u.bind_grads(u.bucket)
        self._sample(f"bucket {u.name}")

    def _grads_ready(self, u):
        if u.bucket is None:                # its backward never ran here: reduce zeros
            self._open_bucket(u)
        if not self.sync:                   # accumulate: the bucket stays, nothing is sent
            return
        while len(self.inflight) > 1:       # keep at most two buckets in flight
            self.inflight.pop(0).wait()
        u.grad_views = None                 # the gradients are in the bucket now
        self.inflight.append(reduce_scatter_bucket(self.comm, u, self.n))
        self._sample(f"reduce_scatter {u.name}")

    def synced(self):                       # the averaged gradient lives in shards only
        shard_grads(self.units, f"ZeRO-{self.stage}")

    # --- step: update the owned range, then all_gather every rank's range -----------------------
    def update(self, used) -> torch.Tensor:
        norm = self.adamw([u.grad_shard for u in self.units], used, self.comm)     # [Ψ_u/N]
        self.publish_all()                  # every unit: `publish`, then wait for the gathers
        return norm

    def publish(self, u):
        self.write_own(u)                                       # fp32 -> bf16, own range
        return self.gather_update(u)                            # every rank's range, to all

    def zero_grad(self, u):                 # the shard zeroed; p.grad, a placeholder, gone
        u.grad_shard.zero_()
        for p in u.params:
            p.grad = None

    # --- what this rank holds --------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [u.param_flat for u in self.units],
                "grads": [u.grad_shard for u in self.units],
                "grad_buckets": [u.bucket for u in self.units] + [
                    p.grad for u in self.units for p in u.params
                    if type(p.grad) is not ShardedGrad],
                "reduce_scatter_out": [u.rs_out for u in self.units], **self.optimizer_tensors()}
