"""Stage 0, plain data parallelism (DDP): every rank holds every state in full.

Idea (the notes' "训练流程梳理"): each rank runs forward and backward on its own micro-batch with a
full copy of the bf16 weights; as each bucket's gradients are ready during backward they are
all-reduced, so every rank ends backward with the same averaged full gradient; every rank then
runs the same AdamW on its full fp32 master weights, exp_avg and exp_avg_sq, and the replicas stay
identical without any further communication. Per rank: 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 0 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py: __init__ (who holds what) / forward /
backward (+ its hooks) / step / state_tensors / full_parameters / shard_state / load_state.
"""
from __future__ import annotations

import contextlib

import torch

from .guards import (adopt_edits, check_edits, check_step, claim_grads, fingerprint,
                     sync_module_states)
from .optim import (adam_state, clip_grad_norm_, make_flat_optimizer, optimizer_states,
                    set_adam_state)
from .sharding import (GradReady, bucket_numel, build_units, check_all_used, check_trainable,
                       fp32_grads, global_used, grad_copies, write_back)


def all_reduce_bucket(comm, unit, world_size: int):
    """Called from the gradient hook as soon as every gradient of `unit` is in `unit.grad_flat`
    ([Ψ_u], replicated): start an async all_reduce of the bucket that leaves the *average* over
    the ranks in it; return the Handle (backward waits for it before the step).
    Exercise (b) of notebooks/exercises: `zerolab check ddp --impl FILE` replaces it."""
    handle = comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True)
    handle.on_done = lambda: unit.grad_flat.div_(world_size)        # sum -> average
    return handle


class DDP:
    stage = 0

    def __init__(self, model, comm, *, max_grad_norm=0.0, find_unused_parameters=False,
                 grad_dtype=None, bucket_mb=None, meter=None, blocks=None, own_step=True,
                 **adamw):
        """find_unused_parameters: allow parameters that get no gradient in a step (torch DDP's
        flag; costs one all_reduce of a flag per parameter a step). grad_dtype: dtype of the
        gradient buffers (default: the parameters'; torch.float32 = Megatron's fp32 grads).
        bucket_mb: gradient bucket cap in MiB (2**20 bytes of gradients; torch DDP's
        bucket_cap_mb): consecutive blocks share one all_reduce while their gradients fit
        (fewer collectives, each starting later in backward); None: one bucket per block.
        blocks: [(name, module)] instead of model.zero_units() (`sharding.module_blocks`).
        own_step=False: the loop brings its own torch optimizer over the parameters
        (`zerolab.torchlike.DistributedDataParallel`): no master copy, no AdamW here, step()
        refused; the parameters keep their own storage, the gradients live in the buckets."""
        self.model, self.comm, self.meter = model, comm, meter
        self.max_grad_norm, self.n = max_grad_norm, comm.world_size
        self.find_unused, self.own_step = find_unused_parameters, own_step
        sync_module_states(model, comm)                 # rank 0's weights, as torch DDP does
        self.units = build_units(model, comm.world_size, comm.rank,
                                 bucket_numel(bucket_mb, model, grad_dtype), blocks)
        for u in self.units:
            # --- params: full bf16 copy on every rank ---------------------------------------
            if own_step:
                u.param_flat = u.flatten()                      # [Ψ_u] bf16, replicated
                u.bind_params(u.param_flat)
            # --- grads: full, replicated; autograd accumulates into the bucket -------------
            u.grad_flat = torch.zeros(u.padded_numel, dtype=grad_dtype or u.params[0].dtype,
                                      device=u.params[0].device)  # [Ψ_u] bf16
            u.bind_grads(u.grad_flat)
            # --- optimizer state: full fp32 master (+ exp_avg, exp_avg_sq after step 1) -----
            if own_step:
                u.master = u.param_flat.float().clone()         # [Ψ_u] fp32, replicated
        self.optimizer = make_flat_optimizer(self.units, sharded=False, **adamw) if own_step else None
        self.inflight, self.sync, self.fresh = [], True, False
        self.ready = GradReady(self.units, self._grads_ready)
        self.handles = []

    # --- forward: local, no communication ----------------------------------------------------
    def forward(self, x, y):
        with self.comm.phase("forward"):
            return self.model(x, y)

    # --- backward: all_reduce each bucket as soon as its grads are ready ---------------------
    def backward(self, loss, *, sync=True):
        """sync=False on micro-steps before the last (grads accumulate locally, no traffic)."""
        self.begin_backward(sync)
        try:
            loss.backward()
        finally:
            self.end_backward()

    def begin_backward(self, sync=True):
        """Everything before `loss.backward()` (DistributedDataParallel calls it when the
        gradient of the module's output arrives: `torchlike.backward.arm`)."""
        self.sync, self.fresh = sync, True
        check_trainable(self.model, self.units)
        for u in self.units:                # p.grad: the bucket again (the loop's zero_grad kept)
            claim_grads(u, u.grad_flat)
        self.ready.start()
        self.phase_before, self.comm.current_phase = self.comm.current_phase, "backward"

    def end_backward(self):
        """Everything after `loss.backward()` (the wrappers: autograd's final callback)."""
        try:
            self.ready.finish()             # units whose params got no gradient: reduce now
            for handle in self.inflight:
                handle.wait()
            self.inflight.clear()
        finally:
            self.comm.current_phase = self.phase_before
        if self.sync and not self.find_unused:
            check_all_used(self.units, self.comm.rank)
        if self.sync and not self.own_step:     # the loop steps: no rank's gradient -> None
            used = global_used(self.units, self.comm) if self.find_unused else None
            for k, u in enumerate(self.units):  # (torch's optimizers then skip it)
                for p, on in zip(u.params, used[k] if used else u.used):
                    p.grad = p.grad if on else None
                u.used = [False] * len(u.params)
        self._sample("backward done")

    def _grads_ready(self, u):
        if self.sync:
            self.inflight.append(all_reduce_bucket(self.comm, u, self.n))
            self._sample(f"all_reduce {u.name}")

    # --- step: every rank runs the same AdamW on the full state ------------------------------
    def step(self) -> torch.Tensor:
        if not self.own_step:
            raise RuntimeError("this DDP was built with own_step=False: step your own optimizer")
        check_step(self.sync, self.fresh)   # a backward ran since, and reduced the grads
        self.fresh = False
        with self.comm.phase("step"):
            self._adopt_edits()             # weights the loop changed since the last step
            used = global_used(self.units, self.comm) if self.find_unused else None
            fp32_grads(self.units, [u.grad_flat for u in self.units])   # [Ψ_u] fp32 each
            self._sample("fp32 grads")
            norm = clip_grad_norm_([u.master for u in self.units], self.max_grad_norm)
            self.optimizer.step(used)
            self._sample("optimizer step")
            for u in self.units:
                u.param_flat.copy_(u.master)                        # fp32 -> bf16, in place
                u.master.grad = None
                u.grad_flat.zero_()                 # consumed: p.grad reads zeros, as after
                u.used = [False] * len(u.params)    # torch's zero_grad(set_to_none=False)
        self._sample("step done")
        return norm

    # --- what this rank holds ----------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not self.own_step:               # the loop's optimizer holds its own states
            return {"params": [p for u in self.units for p in u.params],
                    "grads": [u.grad_flat for u in self.units]}
        masters = [u.master for u in self.units]
        return {"params": [u.param_flat for u in self.units],
                "grads": [u.grad_flat for u in self.units],
                **optimizer_states(self.optimizer, masters),
                "grad_fp32": grad_copies(self.units)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 copy} of every parameter, as a single-process model would have it."""
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    @contextlib.contextmanager
    def gathered(self, modifier_rank=None):
        """Full weights in the block - always true below ZeRO-3. modifier_rank=r: on exit, rank
        r's weights are broadcast and written into every rank's master weights (DeepSpeed's
        GatheredParameters). Every rank must enter."""
        before = fingerprint(self.units)
        yield
        if modifier_rank is None:           # the same edit on every rank: kept at the step
            check_edits(self.comm, self.units, before)
        else:
            write_back(self, modifier_rank, sharded=False)

    def close(self):
        """Remove every hook this strategy put on the model, so that it can be freed."""
        self.ready.close()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # --- checkpoint: this rank's range out, logical (unpadded) state in -----------------------
    def shard_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{unit: {"params", "master", "exp_avg", "exp_avg_sq"}}: views of this rank's range
        [Ψ_u/N] of each state (zerolab.run.checkpoint writes them). DDP holds every state in full
        but writes only its own 1/N of it, like the ZeRO stages."""
        self._adopt_edits()
        return {u.name: {"params": u.own(u.param_flat),
                         **adam_state(self.optimizer, u.master, u.own)} for u in self.units}

    def load_state(self, read, step: int):
        """read(unit, key) -> [padded_numel] state of `unit` for this world size (key: params,
        master, exp_avg, exp_avg_sq), rebuilt from logical tensors; `step`: AdamW's count."""
        for u in self.units:
            u.param_flat.copy_(read(u, "params"))                   # [Ψ_u] replicated
            u.master.copy_(read(u, "master"))
            set_adam_state(self.optimizer, u.master, read(u, "exp_avg"), read(u, "exp_avg_sq"),
                           step)

    def _adopt_edits(self):
        for u in self.units:                # in place or `p.data = t`: the master takes them
            adopt_edits(u, u.param_flat, u.master)

    def _sample(self, tag):
        if self.meter is not None:
            self.meter.sample(self, tag)
