"""ZeRO stage 3: the bf16 parameters are sharded too, gathered one block at a time.

Idea (the notes' "ZeRO Stage 3"): a rank keeps only its own range of every state. Just before a
block's forward, its parameters are all-gathered into a full buffer; right after, the buffer is
freed. Just before the block's backward they are gathered again; when its gradients are ready
they are reduce-scattered (as in ZeRO-2) and the full parameters are freed. Each rank updates its
own range; no all_gather follows the step, because nobody keeps full weights. Per rank:
(2 + 2 + 12)Ψ/N = 16Ψ/N bytes (2Ψ at N = 8) at the price of 3(n-1)/n·2Ψ bytes a step.
By default (prefetch=1) the next block's all_gather is issued while the current block computes:
the same bytes, one more gathered block alive. prefetch=0 (`--no-zero3-prefetch`) is the notes'
picture, one block gathered at a time, every gather on the critical path.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 3 --preset tiny --steps 3

Skeleton shared by ddp.py, zero1.py, zero2.py, zero3.py: __init__ (who holds what) / forward /
backward (+ its hooks) / step / state_tensors / full_parameters / shard_state / load_state.
"""
from __future__ import annotations

import contextlib

import torch

from .guards import (ShardedGrad, agree, check_edits, check_step, claim_grads,
                     claim_loop_grads, claim_shard_grads, fingerprint, hand_grads,
                     is_placeholder, shard_grads, sync_module_states, take_replaced)
from .optim import (adam_state, clip_grad_norm_, make_flat_optimizer, optimizer_states,
                    set_adam_state)
from .quant import quantized_comm
from .sharding import (GradReady, alloc_storage, build_units, check_all_used, check_trainable,
                       fp32_grads, free_storage, global_used, grad_copies, keep_own_range,
                       on_post_backward, on_pre_backward, shard_unit, write_back)

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


# Blocks gathered ahead by default. Chosen from measurements (issue #8; tests/test_knobs.py,
# tests/test_linkemu.py, `zerolab bench`): on an emulated slow link (2 ranks, sleeping blocks)
# depth 0 / 1 / 2 / all took 275 / 183 / 187 / 179 ms a step for a gathered peak of root + 1 / 2 /
# 3 / all blocks; on 2 idle gloo CPU ranks (`small`) depth 1 took 176 ms against 192 ms. Depth 1
# is the knee: almost all of the time for one block more. FSDP2 and DeepSpeed prefetch too.
DEFAULT_PREFETCH = 1



class ZeRO3:
    stage = 3

    def __init__(self, model, comm, *, prefetch=DEFAULT_PREFETCH, keep_root=False, max_grad_norm=0.0,
                 find_unused_parameters=False, grad_dtype=None, meter=None, blocks=None,
                 layout="flat", own_step=True, reshard_after_forward=True, param_dtype=None,
                 units=None, quantize=None, **adamw):
        """prefetch=1 (the default, DEFAULT_PREFETCH; True means 1) issues the next block's
        all_gather (forward order in forward, reverse in backward) as soon as the current block
        is gathered, so it can overlap the current block's compute; the price is a second
        gathered block in memory. prefetch=0 (False) gathers each block only when it runs.
        prefetch=k gathers k blocks ahead (k + 1 gathered blocks), -1 all remaining at once. keep_root=True
        keeps the root unit gathered from forward into backward (one all_gather fewer, the
        root's full weights held in between).
        Outside forward / backward a parameter keeps its full shape, dtype and device but holds
        no values: reading or changing them raises `guards.ShardedValues` naming
        `strategy.gathered()` (never an empty tensor that looks like data).
        Forward and backward follow FSDP2: a block is gathered by its own pre-forward hook and
        again by its pre-backward hook (once per pass, however often it is called); its forward
        calls are counted and its post-backward hook counts them down, so a block called in two
        forwards before one backward is reduced after both; the root unit is gathered by the
        model's own forward hooks, so `model(x, y)` under torch.no_grad() works between steps.
        blocks: for model.zero_units(). layout: "flat" or "dim0" (`FlatUnit`). own_step=False,
        units (set up by `shard_unit`), reshard_after_forward, param_dtype: for
        `zerolab.torchlike.fully_shard` (the loop's optimizer steps `u.master`; FSDP2's).
        quantize: ZeRO++'s qwZ / qgZ, e.g. {"weights": "int8", "grads": "int4"} (`zerolab.quant`)."""
        prefetch = int(prefetch) if isinstance(prefetch, bool) else prefetch
        if not isinstance(prefetch, int) or prefetch < -1:
            raise ValueError(f"prefetch {prefetch!r} must be a bool, a depth >= 0, or -1 (all)")
        self.keep_root, self.own_step, self.reshard = keep_root, own_step, reshard_after_forward
        self.model, self.meter, self.prefetch = model, meter, prefetch
        self.comm = quantized_comm(comm, quantize)      # comm itself unless quantize is given
        self.max_grad_norm, self.n = max_grad_norm, comm.world_size
        self.find_unused, self.grad_dtype = find_unused_parameters, grad_dtype
        self.handles, self.pinned, self.sync, self.fresh = [], False, True, False
        if units is None:
            sync_module_states(model, comm)             # rank 0's weights, as FSDP does
            units = build_units(model, comm.world_size, comm.rank, blocks=blocks, layout=layout)
            for u in units:
                shard_unit(u, grad_dtype, param_dtype, own_step, SHARDED)
        self.units = units
        for u in self.units:
            u.gathered, u.pending, u.bw_gathered = False, 0, False
            if u.module is not None:
                self.handles += [
                    u.module.register_forward_pre_hook(
                        lambda _, args, u=u: self._pre_forward(u, args)),
                    u.module.register_forward_hook(lambda *_, u=u: self._post_forward(u)),
                    on_pre_backward(u.module, lambda u=u: self._pre_backward(u))]
        self.handles += [model.register_forward_pre_hook(lambda *_: self._root_pre_forward()),
                         model.register_forward_hook(lambda *_: self._root_post_forward())]
        for m in (model, *(u.module for u in self.units if u.module is not None)):
            if own_step:                    # (fully_shard: state_dict() holds the loop's shards)
                self.handles += [m.register_state_dict_pre_hook(self._check_gathered),
                                 m.register_load_state_dict_pre_hook(
                                     lambda *_: self._check_gathered(0, 0, False, "load_"))]
        self.optimizer = make_flat_optimizer(self.units, sharded=True, **adamw) if own_step else None
        self.root = [u for u in self.units if u.module is None]
        self.blocks = [u for u in self.units if u.module is not None]     # forward order
        # reduce_scatters in flight; unit name -> all_gather issued ahead of use; forward: the
        # blocks before next_block were gathered; ledger records already compared between ranks
        self.inflight, self.prefetched, self.next_block, self.agreed = [], {}, 0, 0
        self.ready = GradReady(self.units, self._grads_ready)

    def _gather(self, u):
        if self.pinned or u.gathered:       # inside gathered(), or gathered already this pass
            return
        if u.name in self.prefetched:       # issued earlier: just wait for it
            self.prefetched.pop(u.name).wait()
        else:
            self._start_gather(u)
        u.bind_params(u.param_flat)
        self._refresh(u, keep=False)        # (own_step=False: the cast copy is not needed now)
        u.gathered = True
        self._sample(f"all_gather {u.name}")
        if self.prefetch and u in self.blocks:          # depth: True = 1, k, or -1 = all
            order = self.blocks[::-1] if self.comm.current_phase == "backward" else self.blocks
            k, depth = order.index(u), int(self.prefetch)
            for nxt in order[k + 1:] if depth < 0 else order[k + 1:k + 1 + depth]:
                if nxt.name not in self.prefetched and not nxt.gathered:
                    self.prefetched[nxt.name] = self._start_gather(nxt, async_op=True)

    def _start_gather(self, u, async_op=False):
        self._check_untouched(u)            # `gather_params` waited for at once, or in flight:
        self._refresh(u)
        if not async_op:
            return gather_params(self.comm, u)
        alloc_storage(u.param_flat)
        return self.comm.all_gather(u.param_flat, u.param_shard, what="params", unit=u.name,
                                    async_op=True)

    def _refresh(self, u, keep=True):
        # own_step=False: gather the loop's master shard in param_dtype (a transient cast copy)
        if u.param_shard is not u.master and not self.own_step:
            alloc_storage(u.param_shard) if keep else free_storage(u.param_shard)
            if keep:
                u.param_shard.copy_(u.master)

    def _check_untouched(self, u):
        # `p.data = t` on a sharded parameter: its values would be overwritten by the gather
        for name, p in zip(u.names, u.params):
            if not is_placeholder(p):
                raise RuntimeError(f"parameter {name} was given new data (p.data = ...) while "
                                   "ZeRO-3 held only its shard: change weights inside "
                                   "`with strategy.gathered(modifier_rank=r):`")

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
    def forward(self, x, y):
        with self.comm.phase("forward"):
            return self.model(x, y)

    def _root_pre_forward(self):
        # every forward pass, with or without grad: root params (tied embedding / head) span it
        self.next_block = 0
        for u in self.root:
            self._gather(u)

    def _pre_forward(self, u, args):
        if self.comm.current_phase == "backward":   # activation checkpointing recomputes it
            self._gather(u)
            return args
        # a block this rank's forward skipped (data-dependent control flow) is gathered and freed
        # anyway, so that every rank issues the same all_gathers in the same order
        i = self.blocks.index(u)
        while self.next_block < i:
            skipped = self.blocks[self.next_block]
            self._gather(skipped)
            self._free(skipped)
            self.next_block += 1
        self.next_block = max(self.next_block, i + 1)
        self._gather(u)
        if not torch.is_grad_enabled():
            return args
        u.pending += 1                      # one more backward of this block to come
        return on_post_backward(args, lambda: self._post_backward(u))

    def _post_forward(self, u):
        if self.comm.current_phase == "backward":   # recomputed in backward: its backward frees it
            return
        if getattr(u, "reshard", self.reshard) or not torch.is_grad_enabled():
            self._free(u)

    def _root_post_forward(self):
        for u in self.blocks[self.next_block:]:     # skipped at the end: same collectives
            self._gather(u)
            self._free(u)
        self.next_block = 0
        self._drain_prefetch()
        for u in self.root:
            if not (self.keep_root and torch.is_grad_enabled()):  # keep_root: held into backward
                self._free(u)

    # --- backward: gather again, reduce_scatter each bucket, free params and bucket ----------
    def backward(self, loss, *, sync=True):
        """sync=True: each block's gradient is reduce-scattered as soon as its backward is done.
        sync=False (torch's no_sync, FSDP2's set_requires_gradient_sync(False)): no
        reduce_scatter; the full local gradients stay in the buckets (ZeRO-1's 2Ψ bytes of
        gradient, `theory.accumulation_grad_bytes`) until a sync=True backward reduces the sum.
        The weights are still gathered in every forward and backward, so every rank must run
        the same micro-steps: ranks that disagree on `sync` (uneven micro-steps), or that issued
        different all_gathers since the last backward (blocks called in a rank-dependent order),
        raise RuntimeError on every rank (one all_reduce of 4 int64 a backward checks it)."""
        self.begin_backward(sync)
        try:
            loss.backward()
        finally:
            self.end_backward()

    def begin_backward(self, sync=True):
        """Everything before `loss.backward()` (fully_shard calls it when the gradient of the
        model's output arrives: FSDP2's root pre-backward hook)."""
        self.agreed = agree(self.comm, sync, self.agreed, self.units[0].master.device)
        self.sync = sync
        self.fresh = True
        check_trainable(self.model, self.units)
        self.ready.start()
        self.phase_before, self.comm.current_phase = self.comm.current_phase, "backward"
        if not self.own_step:
            for u in self.units:
                claim_loop_grads(u)
        for u in self.units:
            u.bw_gathered = False
            if u.bucket is not None:        # p.grad as the loop left it: accumulating
                claim_grads(u, u.bucket)
            else:                           # ... or after a synchronising backward / a step
                claim_shard_grads(u, self._open_bucket)
        for u in self.root:
            self._gather(u)
            u.bw_gathered = True
            self._open_bucket(u)

    def end_backward(self):
        """Everything after `loss.backward()` (fully_shard: autograd's final callback)."""
        try:
            self.ready.finish()             # units whose params got no gradient: reduce now
            while self.inflight:
                self.inflight.pop(0).wait()
            self._drain_prefetch()
            for u in self.units:
                u.pending = 0
                self._free(u)               # held since forward, backward never reached it
        finally:
            self.comm.current_phase = self.phase_before
        if self.sync and not self.find_unused:
            check_all_used(self.units, self.comm.rank)
        if self.sync:                       # the averaged gradient lives in shards only
            shard_grads(self.units, "ZeRO-3")
            used = global_used(self.units, self.comm) if self.find_unused else None
            for k, u in enumerate([] if self.own_step else self.units):   # the loop's p.grad
                hand_grads(u, used[k] if used else None, self.comm)
        self._sample("backward done")

    def _post_backward(self, u):
        u.pending = max(0, u.pending - 1)

    def _pre_backward(self, u):
        self.ready.flush_before(u)          # the units after u with no backward pending are done
        self._gather(u)
        u.bw_gathered = True
        self._open_bucket(u)

    def _open_bucket(self, u):
        if u.bucket is not None:            # open already (accumulating, or a second graph)
            return
        u.bucket = torch.zeros_like(u.param_flat, dtype=getattr(u, "grad_dtype", None)
                                    or self.grad_dtype)         # [Ψ_u] bf16, transient
        u.bind_grads(u.bucket)
        self._sample(f"bucket {u.name}")

    def _grads_ready(self, u):
        if not u.bw_gathered:               # its backward never ran here (skipped in forward):
            self._gather(u)                 # the same all_gather as the other ranks, then
            u.bw_gathered = True            # reduce zeros
            self._open_bucket(u)
        self._free(u)                       # this block's backward is done with its weights
        if not self.sync:                   # accumulate: the bucket stays, nothing is sent
            return
        while len(self.inflight) > 1:       # keep at most two buckets in flight
            self.inflight.pop(0).wait()
        out = u.rs_out = torch.empty_like(u.grad_shard)       # [Ψ_u/N] bf16, in flight
        u.packed_grad = u.pack(u.bucket)    # layout "dim0": rank r's rows together (a copy)
        handle = self.comm.reduce_scatter(out, u.packed_grad, what="grads", unit=u.name,
                                          async_op=True)

        def done(u=u, out=out):
            self._reduced(u, out)                              # accumulate the averaged shard
            u.bucket = u.grad_views = u.rs_out = u.packed_grad = None   # free the buckets
            for p in u.params:
                p.grad = None
        handle.on_done = done
        self.inflight.append(handle)
        self._sample(f"reduce_scatter {u.name}")

    def _reduced(self, u, out):
        u.grad_shard.add_(out.div_(self.n))     # (zerolab.hybrid's HSDP: across nodes first)

    # --- step: update the owned range; nothing to gather, nobody keeps full weights -----------
    def step(self) -> torch.Tensor:
        if not self.own_step:
            raise RuntimeError("built with own_step=False: step your own optimizer on the shards")
        check_step(self.sync, self.fresh)   # a backward ran since, and reduced the grads
        self.fresh = False
        with self.comm.phase("step"):
            used = global_used(self.units, self.comm) if self.find_unused else None
            fp32_grads(self.units, [u.grad_shard for u in self.units])       # [Ψ_u/N] fp32
            self._sample("fp32 grads")
            norm = clip_grad_norm_([u.master for u in self.units], self.max_grad_norm, self.comm)
            self.optimizer.step(used)
            self._sample("optimizer step")
            for u in self.units:
                u.param_shard.copy_(u.master)                       # fp32 -> bf16, own range
                u.master.grad = None
                u.grad_shard.zero_()
                u.used = [False] * len(u.params)
                for p in u.params:                # consumed, as torch's zero_grad() after step
                    p.grad = None
                self._free(u)               # anything still gathered holds the old weights
            self._drain_prefetch()
        self._sample("step done")
        return norm

    # --- what this rank holds ----------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        masters = [u.master for u in self.units]
        return {"params": [u.param_shard for u in self.units],
                "grads": [u.grad_shard for u in self.units],
                "gathered_params": [t for u in self.units for t in (u.param_flat, u.unsharded)],
                "grad_buckets": [t for u in self.units for t in (u.bucket, u.packed_grad)] + [
                    p.grad for u in self.units for p in u.params
                    if type(p.grad) is not ShardedGrad],
                "reduce_scatter_out": [u.rs_out for u in self.units],
                **optimizer_states(self.optimizer, masters),
                "grad_fp32": grad_copies(self.units)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 copy} of every parameter, gathered (ledger phase "eval")."""
        with self.gathered():
            return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    @contextlib.contextmanager
    def gathered(self, modifier_rank=None):
        """Full weights of every unit inside the block (one all_gather per unit, ledger phase
        "eval"; every rank must enter): read them, `model.state_dict()`, run an eval forward.
        modifier_rank=r: on exit, rank r's weights are broadcast and written into every rank's
        bf16 and fp32 master shards (DeepSpeed's GatheredParameters; FSDP2's unshard)."""
        if self.pinned:
            raise RuntimeError("strategy.gathered() blocks do not nest")
        with self.comm.phase("eval"):
            for u in self.units:
                self._gather(u)
        before = fingerprint(self.units)
        self.pinned = True
        try:
            yield
            for u in self.units:            # `p.data = t` inside the block: t's values count
                take_replaced(u, u.param_flat)
            if modifier_rank is not None:
                write_back(self, modifier_rank, sharded=True)
            elif check_edits(self.comm, self.units, before):   # the same edit on every rank
                keep_own_range(self, sharded=True)
        finally:
            self.pinned = False
            for u in self.units:
                self._free(u)

    def _check_gathered(self, module, prefix, keep_vars, load=""):
        # keep_vars=True asks for the live parameters themselves (placeholders here): allowed
        if not self.pinned and not keep_vars:
            raise RuntimeError(f"ZeRO-3 holds only shards of the weights: call {load}state_dict()"
                               f" inside `with strategy.gathered({load and 'modifier_rank=0'}):` "
                               "(on every rank)")

    def close(self):
        """Remove every hook this strategy put on the model, so that it can be freed."""
        self.ready.close()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # --- checkpoint: this rank's range out, logical (unpadded) state in -----------------------
    def shard_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{unit: {"params", "master", "exp_avg", "exp_avg_sq"}}: views of this rank's range
        [Ψ_u/N] of each state (zerolab.run.checkpoint writes them)."""
        return {u.name: {"params": u.param_shard, **adam_state(self.optimizer, u.master)}
                for u in self.units}

    def load_state(self, read, step: int):
        """read(unit, key) -> [padded_numel] state of `unit` for this world size (key: params,
        master, exp_avg, exp_avg_sq), rebuilt from logical tensors; `step`: AdamW's count."""
        for u in self.units:
            u.param_shard.copy_(u.own(read(u, "params")))           # [Ψ_u/N] own range
            u.master.copy_(u.own(read(u, "master")))                # [Ψ_u/N] own range
            set_adam_state(self.optimizer, u.master, u.own(read(u, "exp_avg")),
                           u.own(read(u, "exp_avg_sq")), step)

    def _sample(self, tag):
        if self.meter is not None:
            self.meter.sample(self, tag)
