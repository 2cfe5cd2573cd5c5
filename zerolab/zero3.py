"""ZeRO stage 3: the bf16 parameters are sharded too, gathered one block at a time.

Idea (the notes' "ZeRO Stage 3"): a rank keeps only its own range of every state. Just before a
block's forward, its parameters are all-gathered into a full buffer; right after, the buffer is
freed. Just before the block's backward they are gathered again; when its gradients are ready
they are reduce-scattered (as in ZeRO-2) and the full parameters are freed. Each rank updates its
own range; no all_gather follows the step, because nobody keeps full weights. Per rank:
(2 + 2 + 12)Ψ/N = 16Ψ/N bytes (2Ψ at N = 8) at the price of 3(n-1)/n·2Ψ bytes a step.
The next block's all_gather is issued while the current block computes (prefetch): the same
bytes, one more gathered block alive.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 3 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py (the frame: zerolab/strategy.py):
hold (who holds what) / backward's hooks / update (the step) / state_tensors / checkpoint
(ZeRO-3's: the mixin below).
Variants, each in its own module: another prefetch depth, the root kept from forward into
backward (zerolab/variants/prefetch.py), quantized collectives (zerolab/variants/quant.py), hybrid sharding
(zerolab/variants/hybrid.py), the loop's own optimizer on the shards (zerolab/variants/loopstep.py). What a loop
does besides forward, backward and step - the unshard / reshard / keep_edits that the frame's
gathered() calls, checkpoints, skipped blocks - is the mixin `ZeRO3Loop` (zerolab/zero3loop.py).
"""
from __future__ import annotations

import torch

from .loop.guards import (ShardedGrad, check_untouched, claim_grads, claim_shard_grads,
                     refuse_state_dict, shard_grads)
from .loop.order import agree
from .sharding import alloc_storage, free_storage, on_post_backward, on_pre_backward
from .strategy import Strategy
from .zero3loop import ZeRO3Loop

SHARDED = ("ZeRO-3 holds only this rank's shard of the weights outside forward/backward: read "
           "or change them inside `with strategy.gathered():` (modifier_rank=r to keep changes)")


# --- gather before, free after (exercise (e): `zerolab check zero3 --impl FILE` replaces them) --
def gather_params(comm, unit):
    """Before `unit`'s forward (and again before its backward): give `unit.param_flat` [Ψ_u] bf16
    its storage back and all_gather every rank's `unit.param_shard` [Ψ_u/N] into it (the
    parameters are views of param_flat, so the module then computes with full weights)."""
    alloc_storage(unit.param_flat)
    comm.all_gather(unit.param_flat, unit.param_shard, what="params", unit=unit.name)


def free_params(unit):
    """After `unit`'s forward (and after its backward): release the full buffer's memory, keeping
    only this rank's `unit.param_shard`."""
    free_storage(unit.param_flat)


class ZeRO3(ZeRO3Loop, Strategy):
    """Stage 3 around `model` on the ranks of `comm` (zerolab.comm.Comm); the options are
    `Strategy`'s (no bucket_mb: a unit is one block, gathered and reduced on its own). As in
    FSDP2, a block is gathered by its own pre-forward hook and again by its pre-backward hook;
    the root unit by the model's own forward hooks, so `model(x, y)` under torch.no_grad() works
    between steps. Outside forward / backward a parameter keeps its shape, dtype and device but
    holds no values: reading them raises `guards.ShardedValues` naming `strategy.gathered()`."""

    stage, name = 3, "ZeRO-3"
    prefetch, keep_root = 1, False          # blocks gathered ahead (prefetch.py: other depths)

    def __init__(self, model, comm, **options):
        if options.get("bucket_mb") is not None:
            raise ValueError(f"bucket_mb {options['bucket_mb']!r}: ZeRO-3 gathers and reduces "
                             "one block at a time (buckets are DDP's, ZeRO-1's and ZeRO-2's)")
        # gathered() pins the weights; blocks' all_gathers issued ahead; the next block a forward
        # expects; ledger records already compared between ranks
        self.pinned, self.prefetched, self.next_block, self.agreed = False, {}, 0, 0
        super().__init__(model, comm, **options)
        self.root = [u for u in self.units if u.module is None]
        self.blocks = [u for u in self.units if u.module is not None]     # forward order
        for u in self.units:
            u.gathered, u.pending, u.bw_gathered = False, 0, False
        for u in self.blocks:               # a block: gathered for its forward and its backward
            self.handles += [
                u.module.register_forward_pre_hook(lambda _, args, u=u: self._pre_forward(u, args)),
                u.module.register_forward_hook(lambda *_, u=u: self._post_forward(u)),
                on_pre_backward(u.module, lambda u=u: self._pre_backward(u))]
        self.handles += [model.register_forward_pre_hook(lambda *_: self._root_pre_forward()),
                         model.register_forward_hook(lambda *_: self._root_post_forward(),
                                                     prepend=True)]     # before the frame's
        self.handles += refuse_state_dict([model, *(u.module for u in self.blocks)],
                                          lambda: self.weights_readable())

    # --- who holds what: this rank's range of everything; full weights only while gathered ------
    def hold(self, u):
        u.param_flat = u.flatten()                              # [Ψ_u] bf16, while gathered
        u.param_shard = u.own(u.param_flat).clone()             # [Ψ_u/N] bf16, resident
        u.master = self.new_master(u)                           # [Ψ_u/N] fp32, this rank's range
        u.grad_shard = torch.zeros(u.shard_numel, dtype=self.grad_dtype or u.param_flat.dtype,
                                   device=u.param_flat.device)  # [Ψ_u/N] bf16, this rank's range
        u.unbind_params(SHARDED)                                # the parameters: placeholders
        free_storage(u.param_flat)                              # the full buffer's bytes go

    def _gather(self, u):
        if self.pinned or u.gathered:       # inside gathered(), or gathered already this pass
            return
        if u.name in self.prefetched:       # issued earlier: just wait for it
            self.prefetched.pop(u.name).wait()
        else:
            self._start_gather(u)
        self._bind(u)
        u.gathered = True
        self._sample(f"all_gather {u.name}")
        for nxt in self._ahead(u):          # prefetch: their all_gather overlaps u's compute
            if nxt.name not in self.prefetched and not nxt.gathered:
                self.prefetched[nxt.name] = self._start_gather(nxt, async_op=True)

    def _start_gather(self, u, async_op=False):
        check_untouched(u)                  # `gather_params`, waited for at once; or in flight:
        if not async_op:
            return gather_params(self.comm, u)
        alloc_storage(u.param_flat)
        return self.comm.all_gather(u.param_flat, u.param_shard, what="params", unit=u.name,
                                    async_op=True)

    def _bind(self, u):                     # the module computes with the gathered weights
        u.bind_params(u.param_flat)

    def _ahead(self, u) -> list:
        """The blocks gathered ahead once `u` is: the next `prefetch` in this pass's order."""
        if u not in self.blocks:
            return []
        order = self.blocks[::-1] if self.comm.current_phase == "backward" else self.blocks
        k = order.index(u)
        return order[k + 1:None if self.prefetch < 0 else k + 1 + self.prefetch]   # -1: all

    def _free(self, u):
        if self.pinned or not u.gathered:   # (inside gathered(), or freed already)
            return
        u.unbind_params(SHARDED)
        free_params(u)
        u.gathered = False
        self._sample(f"free {u.name}")

    def _drain_prefetch(self):
        # all_gathers issued ahead for blocks this pass did not use: wait, then free them (a
        # gather left in flight across a step would bring back stale weights)
        for name in list(self.prefetched):
            self.prefetched.pop(name).wait()
            free_params(next(u for u in self.blocks if u.name == name))

    # --- forward: gather each block just before it runs, free it right after -----------------
    def _root_pre_forward(self):
        # every forward pass, with or without grad: root params (tied embedding / head) span it
        self.next_block = 0
        for u in self.root:
            self._gather(u)

    def _pre_forward(self, u, args):
        if self.comm.current_phase == "backward":   # activation checkpointing recomputes it
            self._gather(u)
            return args
        k = self.blocks.index(u)
        self._catch_up(k)                   # blocks skipped, or u called again: zero3loop.py
        self.next_block = max(self.next_block, k + 1)
        self._gather(u)
        if not torch.is_grad_enabled():
            return args
        u.pending += 1                      # one more backward of this block to come (FSDP2's
        return on_post_backward(args, lambda: self._post_backward(u))   # count: see claim)

    def _post_forward(self, u):
        if self.comm.current_phase != "backward" and self.reshard_after_forward(u):
            self._free(u)                   # (recomputed in backward: its backward frees it)

    def reshard_after_forward(self, u) -> bool:
        """Free `u`'s weights right after its forward (FSDP2's reshard_after_forward): yes."""
        return True

    def _root_post_forward(self):
        self._catch_up(len(self.blocks))            # skipped at the end: same collectives
        self.next_block = 0
        self._drain_prefetch()
        for u in self.root:
            if self.reshard_after_forward(u):
                self._free(u)

    # --- backward: gather again, reduce_scatter each bucket, free params and bucket ----------
    def begin_backward(self, sync=True):
        self.agreed = agree(self.comm, sync, self.agreed, self.units[0].master.device)
        super().begin_backward(sync)
        for u in self.root:                 # the root spans the whole backward too
            self._gather_for_backward(u)

    def claim(self, u):                     # p.grad as the loop left it (zero_grad, assigned)
        u.bw_gathered = False
        if u.bucket is not None:            # accumulating after sync=False
            claim_grads(u, u.bucket)
        else:                               # ... or after a synchronising backward / a step
            claim_shard_grads(u, self._open_bucket)

    def _pre_backward(self, u):
        self.ready.flush_before(u)          # the units after u with no backward pending are done
        self._gather_for_backward(u)

    def _gather_for_backward(self, u):      # its weights again, and a bucket for its gradient
        self._gather(u)
        u.bw_gathered = True
        self._open_bucket(u)

    def _post_backward(self, u):
        u.pending = max(0, u.pending - 1)

    def _open_bucket(self, u):
        if u.bucket is not None:            # open already (accumulating, or a second graph)
            return
        u.bucket = torch.zeros_like(u.param_flat, dtype=u.grad_shard.dtype)  # [Ψ_u] bf16, transient
        u.bind_grads(u.bucket)
        self._sample(f"bucket {u.name}")

    def _grads_ready(self, u):
        if not u.bw_gathered:               # its backward never ran here (skipped in forward):
            self._gather_for_backward(u)    # the others' all_gather, then reduce zeros
        self._free(u)                       # this block's backward is done with its weights
        if not self.sync:                   # accumulate: the bucket stays, nothing is sent
            return
        while len(self.inflight) > 1:       # keep at most two buckets in flight
            self.inflight.pop(0).wait()
        u.grad_views = None                 # the gradients are in the bucket now
        self._reduce_scatter(u)
        self._sample(f"reduce_scatter {u.name}")

    def _reduce_scatter(self, u):           # ZeRO-2's reduce_scatter_bucket, with `_reduced`
        out = u.rs_out = torch.empty_like(u.grad_shard)       # [Ψ_u/N] bf16, in flight
        handle = self.comm.reduce_scatter(out, u.bucket, what="grads", unit=u.name,
                                          async_op=True)

        def done():
            self._reduced(u, out)                              # accumulate the averaged shard
            u.bucket = u.rs_out = None                         # free the full-gradient bucket
            for p in u.params:
                p.grad = None
        handle.on_done = done
        self.inflight.append(handle)

    def _reduced(self, u, out):
        u.grad_shard.add_(out.div_(self.n))     # (zerolab.variants.hybrid's HSDP: across nodes first)

    def finish_backward(self):
        self._drain_prefetch()
        for u in self.units:
            u.pending = 0
            self._free(u)                   # held since forward, backward never reached it

    def synced(self):                       # the averaged gradient lives in shards only
        shard_grads(self.units, f"ZeRO-{self.stage}")

    # --- step: update the owned range; nothing to gather, nobody keeps full weights -----------
    def update(self, used) -> torch.Tensor:
        norm = self.adamw([u.grad_shard for u in self.units], used, self.comm)     # [Ψ_u/N]
        self.publish_all()                  # every unit: `publish`; no collective follows
        self._drain_prefetch()
        return norm

    def publish(self, u):
        u.param_shard.copy_(u.master)                           # fp32 -> bf16, own range
        self._free(u)                       # anything still gathered holds the old weights

    def zero_grad(self, u):                 # the shard zeroed; p.grad, a placeholder, gone
        u.grad_shard.zero_()
        for p in u.params:
            p.grad = None

    # --- what this rank holds ----------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [u.param_shard for u in self.units],
                "grads": [u.grad_shard for u in self.units],
                "gathered_params": [u.param_flat for u in self.units],
                "grad_buckets": [u.bucket for u in self.units] + [
                    p.grad for u in self.units for p in u.params
                    if type(p.grad) is not ShardedGrad],
                "reduce_scatter_out": [u.rs_out for u in self.units], **self.optimizer_tensors()}
