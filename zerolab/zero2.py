"""ZeRO stage 2: gradients are sharded too, reduce-scattered layer by layer during backward.

Idea (the notes' "ZeRO-2 ... layer-by-layer 的 reduce-scatter"): forward is DDP's, with full bf16
weights. In backward, just before a block's backward runs, a bucket for its full local gradient
is allocated; as soon as the block's gradients are in it, the bucket is reduce-scattered and
freed, so each rank keeps only the averaged gradient of its own range. Full gradient alive at
once: the root bucket (tied embedding/head, open for the whole backward) plus at most three block
buckets (two reducing, one filling) - whatever the depth of the model; with `bucket_mb` a bucket
holds several consecutive blocks, so fewer reduce_scatters and a higher peak
(`theory.zero2_bucket_peak_bytes`). The update is ZeRO-1's: own range, then all_gather - at the
end of the step (gather="after_step", the notes') or just before each block's next forward
(gather="before_forward", FSDP's SHARD_GRAD_OP). Per rank: 2Ψ + (2Ψ + 12Ψ)/N bytes (3.75Ψ at
N = 8); traffic 2(n-1)/n·2Ψ a step. With `offload=` (ZeRO-Offload, zerolab/offload.py) the
master and moments live on the host and AdamW runs there: 2Ψ + 2Ψ/N on the device.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 2 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py: __init__ (who holds what) / forward /
backward (+ its hooks) / step / state_tensors / full_parameters / shard_state / load_state.
"""
from __future__ import annotations

import contextlib

import torch

from .guards import (ShardedGrad, adopt_edits, check_edits, check_step, claim_grads,
                     claim_shard_grads, fingerprint, is_placeholder, shard_grads,
                     sync_module_states)
from .hooks import DEFAULT_GATHER, GATHER_MODES, GatherBeforeForward
from .offload import Offload
from .optim import (adam_state, clip_grad_norm_, make_flat_optimizer, optimizer_states,
                    set_adam_state)
from .sharding import (GradReady, bucket_numel, build_units, check_all_used, check_trainable,
                       fp32_grads, global_used, grad_copies, on_pre_backward, write_back)


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


DEFERRED = ("ZeRO-2 (gather='before_forward') gathers the other ranks' updated weights at the "
            "next forward: read or change them inside `with strategy.gathered():` (every rank)")


class ZeRO2:
    stage = 2

    def __init__(self, model, comm, *, max_grad_norm=0.0, find_unused_parameters=False,
                 grad_dtype=None, bucket_mb=None, gather=DEFAULT_GATHER, meter=None, offload=None,
                 **adamw):
        """bucket_mb: gradient bucket cap in MiB (torch DDP's bucket_cap_mb; see DDP): a bucket
        of several blocks opens when the first of them starts its backward and is
        reduce-scattered when all are done; None: one bucket per block.
        gather: when the updated weights are all-gathered (default `hooks.DEFAULT_GATHER`, with
        its measurements). "after_step", the notes': at the end of step(), every unit at once;
        nothing is left to compute, so the step waits for all of them. "before_forward" (FSDP's
        SHARD_GRAD_OP, `hooks.GatherBeforeForward`): step() only writes this rank's range; each
        unit's all_gather starts just before the next forward needs it, one unit ahead, so it
        runs while the unit before computes. Same bytes (the ledger counts each gather in the
        step whose update it carries), same memory (the full bf16 weights stay resident); in
        between, the parameters are placeholders: reads raise, and gathered(),
        full_parameters(), an eval forward and close() gather them first.
        offload: a zerolab.offload.Offload (True: one without an emulated link): master, moments
        and AdamW on the host, gradients down and updated weights up each step. The rest as in
        DDP."""
        if gather not in GATHER_MODES:
            raise ValueError(f"gather {gather!r} is not one of {', '.join(map(repr, GATHER_MODES))}")
        self.gather = gather
        self.model, self.comm, self.meter = model, comm, meter
        self.max_grad_norm, self.n = max_grad_norm, comm.world_size
        self.find_unused, self.grad_dtype = find_unused_parameters, grad_dtype
        self.handles = []
        self.offload = Offload() if offload is True else offload or None
        sync_module_states(model, comm)                 # rank 0's weights, as torch DDP does
        self.units = build_units(model, comm.world_size, comm.rank,
                                 bucket_numel(bucket_mb, model, grad_dtype))
        for u in self.units:
            # --- params: full bf16 copy on every rank ---------------------------------------
            u.param_flat = u.flatten()                          # [Ψ_u] bf16, replicated
            u.bind_params(u.param_flat)
            # --- grads: only this rank's range, averaged; full grads live in a bucket -------
            u.grad_shard = torch.zeros(u.shard_numel, dtype=grad_dtype or u.param_flat.dtype,
                                       device=u.param_flat.device)   # [Ψ_u/N] bf16
            # --- optimizer state: this rank's range only -----------------------------------
            u.master = (u.own(u.param_flat).float().clone()     # [Ψ_u/N] fp32 master shard
                        if self.offload is None else self.offload.host_master(u))   # (host)
            # the bucket opens when the unit's backward begins: at its last block's pre-backward
            # (every block's hook can open it: that block may be skipped on this rank)
            self.handles += [on_pre_backward(m, lambda u=u: self._open_bucket(u))
                             for m in reversed(u.modules)]
        if self.offload is not None:
            self.offload.attach(self.units, comm, adamw.get("optimizer_states", "fp32"))
        self.optimizer = make_flat_optimizer(self.units, sharded=True, **adamw)
        self.inflight, self.sync, self.fresh = [], True, False
        self.ready = GradReady(self.units, self._grads_ready)
        self.deferred = self.stepped = None
        if gather == "before_forward":
            self.deferred = GatherBeforeForward(model, self.units, self._gather, DEFERRED,
                                                is_placeholder)

    # --- forward: local (gather="before_forward": each unit's deferred all_gather first) -----
    def forward(self, x, y):
        with self.comm.phase("forward"):
            return self.model(x, y)

    # --- backward: reduce_scatter each bucket as soon as its grads are ready, then free it ---
    def backward(self, loss, *, sync=True):
        """sync=True: each bucket is reduce-scattered as soon as it is full, then freed, so the
        full gradient never outlives its block (accumulating micro-steps this way costs one
        reduce_scatter each). sync=False (torch's no_sync, FSDP2's
        set_requires_gradient_sync(False)): no traffic; the full local gradient stays in the
        buckets until a sync=True backward reduces the sum - ZeRO-1's gradient memory (2Ψ
        bytes, `theory.accumulation_grad_bytes`) for one reduce_scatter per step, and micro-step
        counts may differ between ranks."""
        self.sync, self.fresh = sync, True
        check_trainable(self.model, self.units)
        self.ready.start()
        for u in self.units:                # p.grad as the loop left it (zero_grad, assigned)
            if u.bucket is not None:        # accumulating after sync=False
                claim_grads(u, u.bucket)
            else:
                claim_shard_grads(u, self._open_bucket)
            if u.module is None:            # the root unit has no output to hook: open now
                self._open_bucket(u)
        with self.comm.phase("backward"):
            loss.backward()
            self.ready.finish()             # units whose params got no gradient: reduce now
            while self.inflight:
                self.inflight.pop(0).wait()
        if sync and not self.find_unused:
            check_all_used(self.units, self.comm.rank)
        if sync:                            # the averaged gradient lives in shards only
            shard_grads(self.units, f"ZeRO-{self.stage}")
        self._sample("backward done")

    def _open_bucket(self, u):
        if u.bucket is not None:            # open already (another block of this bucket)
            return
        u.bucket = torch.zeros_like(u.param_flat, dtype=self.grad_dtype)  # [Ψ_u] bf16, transient
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

    # --- step: update the owned range, then all_gather every rank's range ---------------------
    def step(self) -> torch.Tensor:
        check_step(self.sync, self.fresh)   # a backward ran since, and reduced the grads
        self.fresh = False
        with self.comm.phase("step"):
            self._adopt_edits()             # weights the loop changed since the last step
            used = global_used(self.units, self.comm) if self.find_unused else None
            if self.offload is None:
                fp32_grads(self.units, [u.grad_shard for u in self.units])   # [Ψ_u/N] fp32
                self._sample("fp32 grads")
                norm = clip_grad_norm_([u.master for u in self.units], self.max_grad_norm,
                                       self.comm)
                self.optimizer.step(used)
            else:       # grads down, clip + AdamW on the host, new weights up (offload.py)
                norm = self.offload.update(self.units, [u.grad_shard for u in self.units],
                                           self.optimizer, used, self.max_grad_norm, self.comm)
            self._sample("optimizer step")
            handles = []
            for u in self.units:
                if self.offload is None:
                    u.own(u.param_flat).copy_(u.master)             # fp32 -> bf16, own range
                else:
                    self.offload.wait_up(u)                         # arrived from the host
                if self.deferred is None:                           # before_forward: later
                    handles.append(self._gather(u))
                u.master.grad = None
                u.grad_shard.zero_()
                u.used = [False] * len(u.params)
                for p in u.params:                # consumed, as torch's zero_grad() after step
                    p.grad = None
            for handle in handles:
                handle.wait()
            if self.deferred is not None:   # the other ranks' ranges arrive at the next forward
                self.stepped = self.comm.step
                self.deferred.defer()
        self._sample("step done")
        return norm

    def _gather(self, u):
        handle = self.comm.all_gather(u.param_flat, u.own(u.param_flat), what="params",
                                      unit=u.name, async_op=True)
        if self.stepped is not None:        # deferred: counted in the step whose update it is
            handle.record.step = self.stepped
        return handle

    def _complete(self):                    # every reader of full weights: gather them first
        if self.deferred is not None and self.deferred.pending:
            with self.comm.phase("eval"):
                self.deferred.complete()

    # --- what this rank holds ----------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        masters = [u.master for u in self.units]
        device = {"params": [u.param_flat for u in self.units],
                  "grads": [u.grad_shard for u in self.units],
                  "grad_buckets": [u.bucket for u in self.units] + [
                      p.grad for u in self.units for p in u.params
                      if type(p.grad) is not ShardedGrad],
                  "reduce_scatter_out": [u.rs_out for u in self.units]}
        if self.offload is not None:        # the optimizer's states: "host_..." categories
            return {**device, **self.offload.host_tensors(self.optimizer)}
        return {**device, **optimizer_states(self.optimizer, masters),
                "grad_fp32": grad_copies(self.units)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 copy} of every parameter, as a single-process model would have it
        (gather="before_forward": collective, every rank calls it)."""
        self._complete()
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    @contextlib.contextmanager
    def gathered(self, modifier_rank=None):
        """Full weights in the block - always true below ZeRO-3 (gather="before_forward": the
        step's deferred all_gathers are completed first). modifier_rank=r: on exit, rank r's
        weights are broadcast and written into every rank's master shard (DeepSpeed's
        GatheredParameters). Every rank must enter."""
        self._complete()
        before = fingerprint(self.units)
        yield
        if modifier_rank is None:           # the same edit on every rank: kept at the step
            check_edits(self.comm, self.units, before)
        elif self.offload is not None:      # the masters are on the host
            self.offload.write_back(self, modifier_rank)
        else:
            write_back(self, modifier_rank, sharded=True)

    def close(self):
        """Remove every hook this strategy put on the model, so that it can be freed; the model
        keeps the full trained weights (gather="before_forward": collective, gathers first)."""
        if self.deferred is not None:
            self.deferred.complete()
            self.deferred.close()
        self.ready.close()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # --- checkpoint: this rank's range out, logical (unpadded) state in -----------------------
    def shard_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{unit: {"params", "master", "exp_avg", "exp_avg_sq"}}: views of this rank's range
        [Ψ_u/N] of each state (zerolab.run.checkpoint writes them)."""
        self._adopt_edits()
        host = self.offload.to_device if self.offload is not None else (lambda d: d)
        return {u.name: {"params": u.own(u.param_flat),
                         **host(adam_state(self.optimizer, u.master))} for u in self.units}

    def load_state(self, read, step: int):
        """read(unit, key) -> [padded_numel] state of `unit` for this world size (key: params,
        master, exp_avg, exp_avg_sq), rebuilt from logical tensors; `step`: AdamW's count."""
        for u in self.units:
            u.param_flat.copy_(read(u, "params"))                   # [Ψ_u] replicated
            u.master.copy_(u.own(read(u, "master")))                # [Ψ_u/N] own range
            set_adam_state(self.optimizer, u.master, u.own(read(u, "exp_avg")),
                           u.own(read(u, "exp_avg_sq")), step)
        if self.offload is not None:
            self.offload.loaded(self.units)
        if self.deferred is not None:       # full weights written: nothing to gather
            self.deferred.cancel()

    def _adopt_edits(self):
        if self.deferred is not None and self.deferred.pending:
            return                          # placeholders: nothing the loop could have edited
        if self.offload is not None:        # the masters are on the host
            return self.offload.adopt_edits(self.units)
        for u in self.units:                # in place or `p.data = t`: the owner takes them
            adopt_edits(u, u.param_flat, u.master, u.own)

    def _sample(self, tag):
        if self.meter is not None:
            self.meter.sample(self, tag)
