"""The frame every stage shares, so that each stage's file holds only its own algorithm.

Idea: DDP and ZeRO-1/2/3 differ in who holds what (`hold`), in the collective a unit's gradients
get when they are ready during backward (`_grads_ready`) and in the update (`update`). The order
of a training step is the same for all four - the notes' "训练流程": forward, backward with the
gradient collectives in flight, then the optimizer step - and so is what a PyTorch loop may do
around it (zero_grad, clipping, edits, reading weights: `zerolab.loop.guards`). `Strategy` is that
frame; ddp.py, zero1.py, zero2.py and zero3.py fill it in, method for method in the same order:

    hold(u)             the buffers of one unit on this rank: weights, gradients, fp32 master
    _grads_ready(u)     the unit's gradients are complete (backward): start its collective
    update(used)        AdamW on what this rank owns, and what follows it (an all_gather, ...)
    state_tensors()     every tensor held now, by category (zerolab.memory measures them)

The frame itself, in the order it runs:

    __init__        rank 0's weights broadcast (`guards.sync_module_states`), the trainable
                    parameters flattened into units (`sharding.build_units`), `hold(u)` for
                    each, AdamW over the units' masters (`optim.make_flat_optimizer`), a hook per
                    parameter that calls `_grads_ready(u)` in one fixed order (`hooks.GradReady`)
    forward         the model's own forward, its collectives tagged "forward" in the ledger
    backward        `begin_backward` (each p.grad becomes the stage's buffer again, keeping what
                    the loop did to it: `claim(u)`), `loss.backward()`, `end_backward` (wait for
                    the collectives in flight, check that every parameter got a gradient)
    step            checks, the loop's weight edits taken into the masters, `update(used)`

A variant of a stage (offload, the gather's placement, prefetch depth, hybrid sharding, the loop's
own optimizer, ...) is a subclass in its own module that overrides a few of these methods
(`zerolab.variants.compose` builds them); nothing of a variant appears here or in a stage's file.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from .loop.guards import (adopt_edits, check_edits, check_step, check_sync_grads, claim_grads,
                     fingerprint, sync_module_states)
from .loop.leaves import holders
from .optim import (adam_state, clip_grad_norm_, make_flat_optimizer, optimizer_states,
                    set_adam_state)
from .loop.order import confirm
from .sharding import (GradReady, bucket_numel, build_units, check_all_used, check_trainable,
                       fp32_grads, global_used, grad_copies, write_back)

ADAMW = tuple(inspect.signature(make_flat_optimizer).parameters)[2:]   # lr, betas, eps, ...


class Strategy:
    """One data-parallel stage around `model` on the ranks of `comm` (a zerolab.comm.Comm).

    max_grad_norm: clip the global gradient norm to it (<= 0: only measure it). find_unused_
    parameters: allow parameters that get no gradient in a step (torch DDP's flag; one
    all_reduce of a flag per parameter a step). grad_dtype: dtype of the gradient buffers
    (default: the parameters'; torch.float32 = Megatron's fp32 gradients). bucket_mb: gradient
    bucket cap in MiB (2**20 bytes; torch DDP's bucket_cap_mb): consecutive blocks share one
    collective while their gradients fit (`sharding.bucket_numel`); None: one per block.
    meter: a zerolab.memory.MemoryMeter sampled at named points of the step. **adamw: lr,
    betas, eps, weight_decay and the state ladder of `optim.make_flat_optimizer`.
    Attributes: model, comm, units (root first, then blocks in forward order), optimizer."""

    stage: int
    name: str                               # as the tables print it: "DDP", "ZeRO-1", ...

    def __init__(self, model, comm, *, max_grad_norm=0.0, find_unused_parameters=False,
                 grad_dtype=None, bucket_mb=None, meter=None, **adamw):
        for key in adamw:
            if key not in ADAMW:
                raise TypeError(f"{type(self).__name__} got an unexpected option {key!r}: it takes "
                                f"max_grad_norm, find_unused_parameters, grad_dtype, bucket_mb, "
                                f"meter, {', '.join(ADAMW)}; a variant's option goes to "
                                "zerolab.variants.compose.make_strategy")
        self.model, self.comm, self.meter = model, comm, meter
        self.max_grad_norm, self.n = max_grad_norm, comm.world_size
        self.find_unused, self.grad_dtype, self.bucket_mb = (find_unused_parameters, grad_dtype,
                                                             bucket_mb)
        self.handles, self.inflight, self.sync, self.fresh = [], [], True, False
        self.phase_set = False              # _enter_forward set the ledger's phase
        self.units = self.build_units(model, bucket_mb)
        vars(getattr(comm, "root", comm)).setdefault("parents", {}).update(   # zerolab.loop.order's
            holders(model, self.units))                                         # advice names them
        for u in self.units:
            self.hold(u)
        self.optimizer = self.make_optimizer(**adamw)
        self.ready = GradReady(self.units, self._grads_ready)
        self.handles += [model.register_forward_pre_hook(lambda *_: self._enter_forward(),
                                                         prepend=True),
                         model.register_forward_hook(lambda *_: self._leave_forward(),
                                                     always_call=True)]

    def build_units(self, model, bucket_mb):
        """Rank 0's weights on every rank, then the units. zerolab's always broadcasts them; torch's
        DDP does too, FSDP1 only with `sync_module_states=True`, FSDP2 never (each rank's own
        initialisation is kept: seed it the same)."""
        sync_module_states(model, self.comm)
        return build_units(model, self.n, self.comm.rank,
                           bucket_numel(bucket_mb, model, self.grad_dtype), self.blocks_of(model))

    def blocks_of(self, model):
        """[(name, module)] to build units of; None: `model.zero_units()` (sharding.build_units)."""
        return None

    def new_master(self, u) -> torch.Tensor:
        """The fp32 master of the part of `u` this rank updates (`own`), a new tensor."""
        return self.own(u, u.param_flat).float().clone()

    def own(self, u, full: torch.Tensor) -> torch.Tensor:
        """The part of a [Ψ_u] state this rank's optimizer updates: its range [Ψ_u/N] (ZeRO)."""
        return u.own(full)

    def make_optimizer(self, **adamw):
        return make_flat_optimizer(self.units, sharded=self.stage > 0, **adamw)

    @property
    def options(self) -> dict:
        """What this strategy is, as built: its name, bucket_mb, and the variant knobs its class
        says (grad_op, gather, offload, prefetch, keep_root, hybrid: class or instance
        attributes; quantize: its Comm's spec), None where the stage has no such knob. The run's
        result JSON reads it (zerolab.run.result), never the command line again."""
        knobs = ("grad_op", "gather", "offload", "prefetch", "keep_root", "hybrid")
        return {"name": self.name, "bucket_mb": self.bucket_mb,
                "quantize": getattr(self.comm, "spec", None),
                **{k: getattr(self, k, None) for k in knobs}}

    # --- forward ---------------------------------------------------------------------------------
    def forward(self, x, y):
        with self.comm.phase("forward"):
            return self.model(x, y)

    def _enter_forward(self):               # model(x) called directly: the ledger's phase
        self.phase_set = self.comm.current_phase == "setup"
        if self.phase_set:                  # (a forward pass is never setup)
            self.comm.current_phase = "forward" if torch.is_grad_enabled() else "eval"

    def _leave_forward(self):
        if self.phase_set:
            self.comm.current_phase, self.phase_set = "setup", False

    # --- backward --------------------------------------------------------------------------------
    def backward(self, loss, *, sync=True):
        """loss.backward() with the stage's collectives. sync=False on micro-steps before the
        last (torch's no_sync): the gradients accumulate locally, with no traffic."""
        self.begin_backward(sync)
        try:
            loss.backward()
        finally:
            self.end_backward()

    def sync_grads(self):
        """Reduce the gradients accumulated by backward(sync=False) now, as a sync=True backward
        would at its end - for a loop that cannot run that backward (its last micro-batch was
        skipped: the forward raised, the data ran out). Every rank calls it where the others run
        their last backward or call it too. RuntimeError (one line) with nothing to reduce."""
        check_sync_grads(self.sync, self.fresh)
        self.sync = True
        self.phase_before, self.comm.current_phase = self.comm.current_phase, "backward"
        self.ready.start()
        self.end_backward()                 # every unit ready: its collective, in one order

    def begin_backward(self, sync=True):
        """Everything before `loss.backward()` (the torch-shaped wrappers call it when the
        gradient of the model's output arrives: `torchlike.backward.arm`)."""
        self.sync, self.fresh = sync, True
        check_trainable(self.model, self.units)
        self.ready.start()
        self.phase_before, self.comm.current_phase = self.comm.current_phase, "backward"
        for u in self.units:
            self.claim(u)

    def claim(self, u):
        """p.grad of `u` becomes its view of the gradient buffer again, keeping the loop's
        zero_grad or assignment (`guards.claim_grads`)."""
        claim_grads(u, u.grad_flat)

    def end_backward(self):
        """Everything after `loss.backward()` (the wrappers: autograd's final callback)."""
        try:
            self.ready.finish()             # units whose params got no gradient: reduce now
            while self.inflight:
                self.inflight.pop(0).wait()
            self.finish_backward()
            if self.sync and not self.find_unused:
                check_all_used(self.units, self.comm.rank)
            if self.sync:
                self.synced()               # (its collectives, if any, are the backward's)
        finally:
            self.comm.current_phase = self.phase_before
        self._sample("backward done")

    def finish_backward(self):
        """After the last collective of a backward was waited for (ZeRO-3 frees weights)."""

    def synced(self):
        """After a synchronising backward (ZeRO-2/3: p.grad becomes a placeholder)."""

    # --- step ------------------------------------------------------------------------------------
    def step(self) -> torch.Tensor:
        """torch's optimizer.step() then zero_grad(): the stage's update of what this rank owns,
        after the weights the loop changed since the last step are taken into the masters.
        Returns the global gradient norm (fp32 scalar, the same on every rank). RuntimeError
        (one line) without a synchronising backward since the last step (`guards.check_step`)."""
        check_step(self.sync, self.fresh)
        confirm(self.comm, "step()")        # every rank steps here, after as many micro-steps
        self.fresh = False
        with self.comm.phase("step"):
            self._adopt_edits()
            used = global_used(self.units, self.comm) if self.find_unused else None
            norm = self.update(used)
        self._sample("step done")
        return norm

    def adamw(self, grads, used, comm=None) -> torch.Tensor:
        """`grads` (one per unit, what each master covers) as the masters' fp32 .grad, the
        global norm clipped (summed over `comm` when the ranks hold disjoint shards), AdamW."""
        fp32_grads(self.units, grads)
        self._sample("fp32 grads")
        norm = clip_grad_norm_([u.master for u in self.units], self.max_grad_norm, comm)
        self.optimizer.step(used)
        self._sample("optimizer step")
        return norm

    def publish_all(self):
        """After AdamW: every unit's update into its bf16 weights (`publish(u)`: a Handle when a
        collective carries it), the gradients consumed, then every Handle waited for."""
        handles = [self.publish(u) for u in self.units]
        for u in self.units:
            self.consumed(u)
        for handle in handles:
            if handle is not None:
                handle.wait()

    def write_own(self, u):
        """ZeRO-1/2: the updated master of this rank's range into its bf16 weights."""
        u.own(u.param_flat).copy_(u.master)                     # fp32 -> bf16, own range

    def gather_update(self, u):
        """ZeRO-1/2: start the all_gather of every rank's range of `u`'s weights into
        `u.param_flat` [Ψ_u] (each rank's own range is its input); return the Handle."""
        return self.comm.all_gather(u.param_flat, u.own(u.param_flat), what="params",
                                    unit=u.name, async_op=True)

    def consumed(self, u):
        """After the update, as torch's optimizer.step() then zero_grad(): no fp32 gradient is
        kept, no parameter counts as used, and the gradient is zero (`zero_grad`)."""
        u.master.grad = None
        u.used = [False] * len(u.params)
        self.zero_grad(u)

    def zero_grad(self, u):                 # DDP, ZeRO-1: p.grad, a view of it, reads zeros
        u.grad_flat.zero_()                 # (torch's zero_grad(set_to_none=False))

    def _adopt_edits(self):
        for u in self.units:                # in place or `p.data = t`: the masters take them
            adopt_edits(u, u.param_flat, u.master, lambda t, u=u: self.own(u, t))

    # --- what this rank holds, and what a loop may read --------------------------------------------
    def optimizer_tensors(self) -> dict[str, list[torch.Tensor]]:
        """master_weights, exp_avg, exp_avg_sq and the fp32 gradient copies AdamW reads."""
        return {**optimizer_states(self.optimizer, [u.master for u in self.units]),
                "grad_fp32": grad_copies(self.units)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 copy} of every parameter, as a single-process model would have it."""
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    @contextlib.contextmanager
    def gathered(self, modifier_rank=None):
        """Full weights in the block (below ZeRO-3 they are always there; ZeRO-3 gathers them:
        `unshard`). modifier_rank=r: on exit, rank r's weights are broadcast and written into
        every rank's masters (DeepSpeed's GatheredParameters). Without it, edits must be the same
        on every rank (RuntimeError, one line, on every rank otherwise). Every rank must enter."""
        self.unshard()
        try:
            before = fingerprint(self.units)
            yield
            self.keep_edits(modifier_rank, before)
        finally:
            self.reshard()

    def unshard(self):
        """Before a gathered() block: every unit's full weights in place (here they are)."""

    def reshard(self):
        """After a gathered() block."""

    def keep_edits(self, modifier_rank, before):
        if modifier_rank is None:           # the same edit on every rank: kept at the step
            check_edits(self.comm, self.units, before)
        else:
            self.write_back(modifier_rank)

    def write_back(self, modifier_rank: int):
        write_back(self, modifier_rank, sharded=self.stage > 0)

    def close(self):
        """Remove every hook this strategy put on the model, so that it can be freed."""
        self.ready.close()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # --- checkpoint: this rank's range out, logical (unpadded) state in -----------------------------
    def shard_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{unit: {"params", "master", "exp_avg", "exp_avg_sq"}}: views of this rank's range
        [Ψ_u/N] of each state (zerolab.run.checkpoint writes them). DDP holds every state in
        full but writes only its own 1/N of it, like the ZeRO stages."""
        self._adopt_edits()                 # (DDP's master is a full replica: its own range)
        return {u.name: {"params": u.own(u.param_flat), **adam_state(
            self.optimizer, u.master, None if self.stage else u.own)} for u in self.units}

    def load_state(self, read, step: int):
        """read(unit, key) -> [padded_numel] state of `unit` for this world size (key: params,
        master, exp_avg, exp_avg_sq), rebuilt from logical tensors; `step`: AdamW's count."""
        for u in self.units:
            self.load_params(u, read(u, "params"))
            u.master.copy_(self.own(u, read(u, "master")))
            set_adam_state(self.optimizer, u.master, self.own(u, read(u, "exp_avg")),
                           self.own(u, read(u, "exp_avg_sq")), step)

    def load_params(self, u, full: torch.Tensor):
        u.param_flat.copy_(full)                                # [Ψ_u] replicated

    def _sample(self, tag):
        if self.meter is not None:
            self.meter.sample(self, tag)
