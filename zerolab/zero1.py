"""ZeRO stage 1: the optimizer state (fp32 master, exp_avg, exp_avg_sq) is sharded 1/N.

Idea (the notes' "ZeRO Stage 1"): forward and backward are DDP's - full bf16 weights, full
gradients all-reduced bucket by bucket. Only the update changes: rank r keeps the fp32 master
weights, exp_avg and exp_avg_sq of its own contiguous range of each bucket, updates only that
range, writes it into its bf16 weights, and an all_gather brings every rank's updated range to
everyone - at the end of the step (gather="after_step", the notes') or just before each block's
next forward (gather="before_forward", FSDP's SHARD_GRAD_OP). Per rank: 2Ψ + 2Ψ + 12Ψ/N bytes (5.5Ψ at N = 8). The gradient path is the notes'
all_reduce (3(n-1)/n·2Ψ bytes a step with the all_gather) or, with grad_op="reduce_scatter", a
reduce_scatter that leaves only the owned range averaged (2(n-1)/n·2Ψ bytes). With
`offload=` (ZeRO-Offload, zerolab/offload.py) the optimizer states and AdamW are on the host:
4Ψ on the device.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 1 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py: __init__ (who holds what) / forward /
backward (+ its hooks) / step / state_tensors / full_parameters / shard_state / load_state.
"""
from __future__ import annotations

import contextlib

import torch

from .guards import (adopt_edits, check_edits, check_step, claim_grads, fingerprint,
                     is_placeholder, shard_grads, sync_module_states)
from .hooks import DEFAULT_GATHER, GATHER_MODES, GatherBeforeForward
from .offload import Offload
from .optim import (adam_state, clip_grad_norm_, make_flat_optimizer, optimizer_states,
                    set_adam_state)
from .sharding import (GradReady, bucket_numel, build_units, check_all_used, check_trainable,
                       fp32_grads, global_used, grad_copies, write_back)


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


DEFERRED = ("ZeRO-1 (gather='before_forward') gathers the other ranks' updated weights at the "
            "next forward: read or change them inside `with strategy.gathered():` (every rank)")


class ZeRO1:
    stage = 1

    def __init__(self, model, comm, *, grad_op="all_reduce", max_grad_norm=0.0,
                 find_unused_parameters=False, grad_dtype=None, bucket_mb=None,
                 gather=DEFAULT_GATHER, meter=None, offload=None, **adamw):
        """grad_op: the gradient collective, "all_reduce" (the notes') or "reduce_scatter".
        bucket_mb: gradient bucket cap in MiB (torch DDP's bucket_cap_mb; see DDP); None: one
        bucket per block.
        gather: when the updated weights are all-gathered (default `hooks.DEFAULT_GATHER`, with
        its measurements). "after_step", the notes': at the end of step() (`publish_update`),
        every unit at once; nothing is left to compute, so the step waits for all of them.
        "before_forward" (FSDP's SHARD_GRAD_OP, `hooks.GatherBeforeForward`): step() only writes
        this rank's range; each unit's all_gather starts just before the next forward needs it,
        one unit ahead, so it runs while the unit before computes. Same bytes (the ledger counts
        each gather in the step whose update it carries), same memory (the full bf16 weights
        stay resident); in between, the parameters are placeholders: reads raise, and
        gathered(), full_parameters(), an eval forward and close() gather them first.
        offload: a zerolab.offload.Offload (True: one without an emulated link): master, moments
        and AdamW on the host; the own range of the gradient down and of the updated weights up
        each step. The rest as in DDP."""
        if grad_op not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"grad_op {grad_op!r} is not one of 'all_reduce', 'reduce_scatter'")
        if gather not in GATHER_MODES:
            raise ValueError(f"gather {gather!r} is not one of {', '.join(map(repr, GATHER_MODES))}")
        self.grad_op, self.gather = grad_op, gather
        self.model, self.comm, self.meter = model, comm, meter
        self.max_grad_norm, self.n = max_grad_norm, comm.world_size
        self.find_unused = find_unused_parameters
        self.offload = Offload() if offload is True else offload or None   # as ZeRO2's
        sync_module_states(model, comm)                 # rank 0's weights, as torch DDP does
        self.units = build_units(model, comm.world_size, comm.rank,
                                 bucket_numel(bucket_mb, model, grad_dtype))
        for u in self.units:
            # --- params: full bf16 copy on every rank ---------------------------------------
            u.param_flat = u.flatten()                          # [Ψ_u] bf16, replicated
            u.bind_params(u.param_flat)
            # --- grads: full, replicated; autograd accumulates into the bucket -------------
            u.grad_flat = torch.zeros_like(u.param_flat, dtype=grad_dtype)  # [Ψ_u] bf16
            u.bind_grads(u.grad_flat)
            # --- optimizer state: this rank's range only -----------------------------------
            u.master = (u.own(u.param_flat).float().clone()     # [Ψ_u/N] fp32 master shard
                        if self.offload is None else self.offload.host_master(u))   # (host)
            u.averaged = False          # reduce_scatter done: own range averaged, the rest stale
        if self.offload is not None:
            self.offload.attach(self.units, comm, adamw.get("optimizer_states", "fp32"))
        self.optimizer = make_flat_optimizer(self.units, sharded=True, **adamw)
        self.inflight, self.sync, self.fresh = [], True, False
        self.ready = GradReady(self.units, self._grads_ready)
        self.handles = []
        self.deferred = self.stepped = None
        if gather == "before_forward":
            self.deferred = GatherBeforeForward(model, self.units, self._gather, DEFERRED,
                                                is_placeholder)

    # --- forward: local (gather="before_forward": each unit's deferred all_gather first) -----
    def forward(self, x, y):
        with self.comm.phase("forward"):
            return self.model(x, y)

    # --- backward: as DDP (all_reduce), or reduce_scatter into the owned range ---------------
    def backward(self, loss, *, sync=True):
        """sync=False on micro-steps before the last (grads accumulate locally, no traffic)."""
        self.sync, self.fresh = sync, True
        check_trainable(self.model, self.units)
        for u in self.units:
            if u.averaged:                  # a second synchronised backward before the step:
                u.own(u.grad_flat).mul_(self.n)           # own range back to a sum, the rest 0
                u.grad_flat[:u.start].zero_()
                u.grad_flat[u.start + u.shard_numel:].zero_()
                u.averaged = False
            claim_grads(u, u.grad_flat)     # p.grad: the bucket again (the loop's zero_grad kept)
        self.ready.start()
        with self.comm.phase("backward"):
            loss.backward()
            self.ready.finish()             # units whose params got no gradient: reduce now
            for handle in self.inflight:
                handle.wait()
            self.inflight.clear()
        if sync and not self.find_unused:
            check_all_used(self.units, self.comm.rank)
        if sync and self.grad_op == "reduce_scatter":   # only the own range is averaged now
            shard_grads(self.units, "ZeRO-1 with grad_op='reduce_scatter'")
        self._sample("backward done")

    def _grads_ready(self, u):
        if not self.sync:
            return
        if self.grad_op == "all_reduce":
            handle = self.comm.all_reduce(u.grad_flat, what="grads", unit=u.name, async_op=True)
            handle.on_done = lambda: u.grad_flat.div_(self.n)          # sum -> average
        else:   # in place: the owned range of grad_flat receives the sum of everyone's range
            handle = self.comm.reduce_scatter(u.own(u.grad_flat), u.grad_flat, what="grads",
                                              unit=u.name, async_op=True)
            handle.on_done = lambda: u.own(u.grad_flat).div_(self.n)
            u.averaged = True
        self.inflight.append(handle)
        self._sample(f"{self.grad_op} {u.name}")

    # --- step: update the owned range, then all_gather every rank's range ---------------------
    def step(self) -> torch.Tensor:
        check_step(self.sync, self.fresh)   # a backward ran since, and reduced the grads
        self.fresh = False
        with self.comm.phase("step"):
            self._adopt_edits()             # weights the loop changed since the last step
            used = global_used(self.units, self.comm) if self.find_unused else None
            if self.offload is None:
                fp32_grads(self.units, [own_gradient(u) for u in self.units])  # [Ψ_u/N] fp32
                self._sample("fp32 grads")
                norm = clip_grad_norm_([u.master for u in self.units], self.max_grad_norm,
                                       self.comm)
                self.optimizer.step(used)
            else:       # own range down, clip + AdamW on the host, new weights up (offload.py)
                norm = self.offload.update(self.units, [u.own(u.grad_flat) for u in self.units],
                                           self.optimizer, used, self.max_grad_norm, self.comm)
            self._sample("optimizer step")
            handles = []
            for u in self.units:
                if self.offload is not None:                        # own range: from the host
                    self.offload.wait_up(u)
                    if self.deferred is None:
                        handles.append(self._gather(u))
                elif self.deferred is None:
                    handles.append(publish_update(self.comm, u))    # own range, all_gather
                else:                                               # own range; gather later
                    u.own(u.param_flat).copy_(u.master)
                u.master.grad = None
                u.grad_flat.zero_()                 # consumed: p.grad reads zeros, as after
                u.used, u.averaged = [False] * len(u.params), False   # zero_grad(False)
                claim_grads(u, u.grad_flat)         # (the placeholders of reduce_scatter go)
            for handle in handles:
                handle.wait()
            if self.deferred is not None:   # the other ranks' ranges arrive at the next forward
                self.stepped = self.comm.step
                self.deferred.defer()
        self._sample("step done")
        return norm

    def _gather(self, u):                   # publish_update's second half (before_forward, offload)
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
                  "grads": [u.grad_flat for u in self.units]}
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
