"""The loop brings its own optimizer: DDP and ZeRO-3 for torch's interfaces (zerolab.torchlike).

Idea: zerolab's stages own the update - an fp32 master per unit and a flat AdamW (strategy.py).
torch's DistributedDataParallel and FSDP2's `fully_shard` do not: the loop builds any torch
optimizer over `model.parameters()` and calls `optimizer.step()` itself. These two subclasses are
the stages for such a loop, what `zerolab.torchlike` wraps:

- `LoopStepDDP` (torchlike.DistributedDataParallel): no master copy and no AdamW; the parameters
  keep their own storage and their gradients live in the buckets (torch's
  gradient_as_bucket_view=True); after a synchronising backward a parameter no rank gave a
  gradient gets `.grad = None`, so the loop's optimizer skips it, as torch's does. Blocks come
  from the model's own structure (`sharding.module_blocks`) when it has no `zero_units()`.
- `LoopStepZeRO3` (torchlike.fully_shard): the units arrive sharded by `fully_shard` calls
  (`shard_unit`: this rank's piece of each parameter is an nn.Parameter the loop's optimizer
  steps, in the parameters' own dtype; gathered in param_dtype, a cast copy that lives only
  while gathering, and reduced in reduce_dtype: FSDP2's MixedPrecisionPolicy); after a
  synchronising backward each shard parameter's .grad is its piece of the averaged gradient
  (`hand_grads`) whose norms are global (`GlobalNormGrad`: torch's clip_grad_norm_ clips by the
  whole gradient's norm); the root stays gathered into backward and each block frees its weights
  after forward as its `u.reshard` says (FSDP2's reshard_after_forward); a unit in layout "dim0"
  (FSDP2's rows per rank) packs its gradient rank-major for the reduce_scatter. FSDP2's
  hooks besides: a block whose backward starts first begins the backward itself (`enter_backward`:
  the model may return a block's output directly); a unit over several modules (fully_shard's
  list) is gathered when the first of them runs and freed once all have run; explicit prefetch
  lists (`u.prefetch_forward`, `u.prefetch_backward`); shard parameters whose data the loop
  replaced (`module.to(torch.float64)`) are taken in before the next forward (`refresh`).

step() is refused on both (one line): the loop steps.
"""
from __future__ import annotations

import torch

from ..ddp import DDP
from ..sharding import alloc_storage, free_storage, global_used, on_pre_backward
from ..zero3 import SHARDED, ZeRO3


class LoopStepDDP(DDP):
    """DDP for a loop with its own optimizer. blocks: [(name, module)] instead of
    model.zero_units(); the other options are Strategy's."""

    def __init__(self, model, comm, *, blocks=None, **options):
        self.given_blocks = blocks
        super().__init__(model, comm, **options)

    def blocks_of(self, model):
        return self.given_blocks

    def hold(self, u):                      # the parameters keep their storage; no master
        u.grad_flat = torch.zeros(u.padded_numel, dtype=self.grad_dtype or u.params[0].dtype,
                                  device=u.params[0].device)            # [Ψ_u] bf16
        u.bind_grads(u.grad_flat)

    def make_optimizer(self, **adamw):
        return None

    def synced(self):                       # no rank's gradient -> None (the optimizer skips it)
        used = global_used(self.units, self.comm) if self.find_unused else None
        for k, u in enumerate(self.units):
            for p, on in zip(u.params, used[k] if used else u.used):
                p.grad = p.grad if on else None
            u.used = [False] * len(u.params)

    def step(self):
        raise RuntimeError("the loop steps its own optimizer here (torchlike's "
                           "DistributedDataParallel): call optimizer.step()")

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [p for u in self.units for p in u.params],
                "grads": [u.grad_flat for u in self.units]}


def shard_unit(u, grad_dtype=None, param_dtype=None):
    """One unit's state for `LoopStepZeRO3`, then its parameters made placeholders: master
    [Ψ_u/N] in the parameters' own dtype (the loop's shard), param_shard (param_dtype; the
    master itself when the dtypes agree, else a cast copy, freed until a gather), grad_shard
    (grad_dtype) and grad_master (the loop's gradients: grad_shard itself when its dtype is the
    master's, else made at the first hand-over)."""
    full = u.flatten()                                          # [Ψ_u] the params' dtype
    u.param_flat = full.to(param_dtype) if param_dtype else full    # [Ψ_u] bf16, transient
    u.master = u.own(full).clone()                              # [Ψ_u/N] the loop's shard
    same = u.master.dtype == u.param_flat.dtype
    u.param_shard = u.master if same else u.master.to(u.param_flat.dtype)   # freed below
    u.grad_shard = torch.zeros_like(u.param_shard, dtype=grad_dtype)   # [Ψ_u/N] bf16
    u.grad_master = u.grad_shard if u.grad_shard.dtype == u.master.dtype else None
    u.unbind_params("")
    free_storage(u.param_flat)
    if u.param_shard is not u.master:
        free_storage(u.param_shard)         # a cast copy only while gathering


def replaced(u) -> bool:
    """True when a shard parameter of `u` is no longer a view of its master (new data, dtype or
    device: `module.to(...)`, `p.data = t`)."""
    master = u.master.untyped_storage().data_ptr()
    return any(sp.dtype != u.master.dtype or sp.device != u.master.device
               or sp.untyped_storage().data_ptr() != master for sp in u.shard_params)


def reshard_unit(u, comm=None):
    """`u`'s shard parameters were given new data (module.to(dtype / device), p.data = t): a new
    master in their dtype and device holding their values, each shard parameter a view of it
    again (FSDP2's reset_sharded_param), and the unit's other buffers remade to match (the
    gathered weights in u.param_dtype or the new dtype, gradients in u.grad_dtype or that);
    a .grad the loop holds keeps its values. Not during a forward or backward."""
    sps = u.shard_params
    kinds = sorted({f"{sp.dtype} on {sp.device}" for sp in sps})
    if len(kinds) > 1:
        raise RuntimeError(f"fully_shard unit {u.name} holds parameters of {' and '.join(kinds)}: "
                           "a unit gathers one dtype (FSDP2 expects uniform original parameter "
                           "dtype): call .to() on the module given to fully_shard, or on the root")
    if getattr(u, "gathered", False) or u.bucket is not None:
        raise RuntimeError(f"the parameters of fully_shard unit {u.name} were replaced while "
                           "its weights or a gradient bucket were held (a forward, a backward, "
                           "or set_requires_gradient_sync(False)): change them between steps")
    dtype, device = sps[0].dtype, sps[0].device
    grads = [sp.grad for sp in sps]
    master = torch.zeros(u.shard_numel, dtype=dtype, device=device)    # [Ψ_u/N] the loop's shard
    with torch.no_grad():
        for sp, view in zip(sps, u.shard_views(master)):
            view.copy_(sp.detach())
            sp.data = view
    compute = getattr(u, "param_dtype", None) or dtype
    with torch._C.DisableTorchFunctionSubclass():   # placeholders of the new dtype and device
        for p in u.params:
            p.data = torch.empty(0, dtype=compute, device=device)
    u.unbind_params(SHARDED)
    u.master, u.unsharded, u._views = master, None, {}
    u.param_flat = torch.empty(u.padded_numel, dtype=compute, device=device)
    free_storage(u.param_flat)
    u.param_shard = master if compute == dtype else torch.empty_like(master, dtype=compute)
    if u.param_shard is not master:
        free_storage(u.param_shard)
    u.grad_shard = torch.zeros_like(u.param_shard, dtype=getattr(u, "grad_dtype", None))
    u.grad_master = u.grad_shard if u.grad_shard.dtype == dtype else None
    if any(g is not None for g in grads):
        if u.grad_master is None:
            u.grad_master = torch.zeros_like(master)
        wrap = (lambda v: global_norm_grad(v, comm)) if comm is not None else (lambda v: v)
        for sp, g, view in zip(sps, grads, u.shard_views(u.grad_master)):
            sp.grad = None if g is None else wrap(view.copy_(g))
        if u.grad_master is not u.grad_shard:
            u.grad_shard.untyped_storage().resize_(0)   # (claim_loop_grads gives it back)


class LoopStepZeRO3(ZeRO3):
    """ZeRO-3 over the units `fully_shard` built (`units`, each set up by `shard_unit`, with
    `reshard` set); the loop's optimizer steps their shard parameters. The other options are
    Strategy's. enter_backward: called (no argument) when a block's backward is about to start,
    before anything else of it - the wrapper begins the backward there if no output of the
    model has yet (torchlike.backward.Backward.enter)."""

    def __init__(self, model, comm, *, units, enter_backward=None, **options):
        self.given_units, self.enter_backward = units, enter_backward
        super().__init__(model, comm, **options)
        for u in self.blocks:               # a unit over several modules: each one's hooks
            u.ran = set()
            for m in u.modules[:-1]:        # (u.module's were registered by ZeRO3)
                self.handles += [
                    m.register_forward_pre_hook(lambda _, args, u=u: self._pre_forward(u, args)),
                    m.register_forward_hook(lambda mod, *_, u=u: self._post_forward(u, mod)),
                    on_pre_backward(m, lambda u=u: self._pre_backward(u))]

    def build_units(self, model, bucket_mb):
        return self.given_units             # rank 0's weights were broadcast by fully_shard

    def hold(self, u):                      # held already: `shard_unit`
        pass

    def make_optimizer(self, **adamw):
        return None

    def weights_readable(self) -> bool:     # state_dict() holds the loop's shard parameters
        return True

    def _start_gather(self, u, async_op=False):
        if u.param_shard is not u.master:   # gathered in param_dtype: a transient cast copy
            alloc_storage(u.param_shard)
            u.param_shard.copy_(u.master)
        return super()._start_gather(u, async_op)

    def _bind(self, u):
        super()._bind(u)
        if u.param_shard is not u.master:   # (the cast copy is not needed now)
            free_storage(u.param_shard)

    def reshard_after_forward(self, u) -> bool:
        # the root stays gathered into backward (FSDP2's); a block as its fully_shard call said
        return (u.module is not None and u.reshard) or not torch.is_grad_enabled()

    # --- FSDP2's hooks beyond ZeRO-3's ----------------------------------------------------------
    def _pre_backward(self, u):
        if self.enter_backward is not None:     # the backward may begin at a block's output
            self.enter_backward()
        super()._pre_backward(u)

    def _post_forward(self, u, module=None):
        # a unit over several modules (fully_shard([a, b])): freed once every one of them ran
        if len(u.modules) > 1 and self.comm.current_phase != "backward":
            u.ran.add(id(module if module is not None else u.module))
            if len(u.ran) < len(u.modules):
                return
            u.ran.clear()
        super()._post_forward(u)

    def _root_post_forward(self):
        for u in self.blocks:                   # a group not all of whose modules ran: done now
            if getattr(u, "ran", None):
                u.ran.clear()
                super()._post_forward(u)
        super()._root_post_forward()

    def _ahead(self, u) -> list:
        """The blocks gathered ahead once `u` is: its explicit list for this pass when it has
        one (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch), else ZeRO-3's."""
        backward = self.comm.current_phase == "backward"
        given = getattr(u, "prefetch_backward" if backward else "prefetch_forward", None)
        if given is not None:               # (the root is gathered by the root's own hook)
            return [v for v in given if v is not u and v in self.blocks]
        return super()._ahead(u)

    def refresh(self):
        """Before a forward: units whose shard parameters the loop gave new data (module.to(
        torch.float64), .cuda(), p.data = t) are rebuilt around them (`reshard_unit`). A unit
        whose parameters no longer share one dtype and device: RuntimeError, one line."""
        for u in self.units:
            if replaced(u):
                reshard_unit(u, self.comm)

    def claim(self, u):
        claim_loop_grads(u)
        super().claim(u)

    def _reduce_scatter(self, u):           # rank r's rows together (layout "dim0": a copy)
        u.packed_grad = u.pack(u.bucket)
        u.bucket = u.packed_grad
        super()._reduce_scatter(u)

    def _reduced(self, u, out):
        super()._reduced(u, out)
        u.packed_grad = None

    def synced(self):
        super().synced()
        used = global_used(self.units, self.comm) if self.find_unused else None
        for k, u in enumerate(self.units):  # the loop's p.grad: this rank's piece, averaged
            hand_grads(u, used[k] if used else None, self.comm)

    def step(self):
        raise RuntimeError("the loop steps its own optimizer on the shards here (torchlike's "
                           "fully_shard): call optimizer.step()")

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = super().state_tensors()
        out["gathered_params"] += [u.unsharded for u in self.units]     # layout "dim0"
        out["grad_buckets"] += [u.packed_grad for u in self.units]
        return out


# --- the loop's gradients of the shard parameters --------------------------------------------------
class GlobalNormGrad(torch.Tensor):
    """The loop's p.grad under fully_shard: this rank's shard of the averaged gradient, whose
    norms are global - a full norm of it (torch.linalg.vector_norm, torch.norm, Tensor.norm,
    torch._foreach_norm; dim=None) sums the ranks' parts in one all_reduce, so
    `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` clips by the whole
    gradient's norm on every rank, as FSDP2's DTensor gradients do. Every rank must ask (a
    collective; ledger phase "step" when asked between backward and step, where zerolab's own
    stages clip); everything else it does is a plain tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func not in _NORMS or kwargs.get("dim") is not None or (
                len(args) > 2 and func is not torch._foreach_norm):
            return out
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
        ord_ = 2.0 if ord_ in (None, "fro") else float(ord_)
        first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        comm = first.__dict__["_zerolab_comm"]
        local = torch.stack(list(out)) if isinstance(out, (list, tuple)) else out.reshape(1)
        part = local.float() if ord_ == float("inf") else local.float().pow(ord_)
        idle = comm.current_phase == "setup"    # the loop clips between backward and step:
        with comm.phase("step" if idle else comm.current_phase):   # the update's, as zerolab's
            comm.all_reduce(part, what="metric", unit="grad_norm",
                            op="max" if ord_ == float("inf") else "sum")
        whole = (part if ord_ == float("inf") else part.pow(1 / ord_)).to(local.dtype)
        return list(whole.unbind()) if isinstance(out, (list, tuple)) else whole.reshape(out.shape)


_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch._foreach_norm}


def global_norm_grad(view: torch.Tensor, comm) -> GlobalNormGrad:
    """`view` (no copy) as a GlobalNormGrad whose norms all_reduce over `comm`."""
    g = torch.Tensor._make_subclass(GlobalNormGrad, view)
    g.__dict__["_zerolab_comm"] = comm
    return g


def claim_loop_grads(u):
    """own_step=False, before a backward: the loop's gradients of its shard parameters keep
    torch's meaning when the reduce_scatter adds into them in place (`u.grad_master` is
    `grad_shard`): None -> that piece starts from zero; the view itself -> kept (accumulating);
    another tensor the loop assigned -> its values. (Otherwise grad_shard was freed after the
    last hand-over: it gets its memory back, zeroed.)"""
    if u.grad_master is not u.grad_shard:
        if u.grad_shard.untyped_storage().nbytes() == 0:
            nbytes = u.grad_shard.numel() * u.grad_shard.element_size()
            u.grad_shard.untyped_storage().resize_(nbytes)
            u.grad_shard.zero_()
        return
    for sp, view in zip(u.shard_params, u.shard_views(u.grad_shard)):
        g = sp.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
            view.copy_(g)


def hand_grads(u, used=None, comm=None):
    """own_step=False, after a synchronising backward: each shard parameter's .grad is its piece
    of the averaged gradient shard (a view of `grad_shard` when it has the master's dtype;
    else `grad_shard` is added into the loop's fp32 gradients `u.grad_master` and freed,
    FSDP2's reduce in reduce_dtype then cast). used: [bool per parameter], whether any rank
    gave it a gradient since the last hand-over: one no rank used keeps its .grad as it was (None
    stays None, so the loop's optimizer skips it, as torch's does)."""
    used = used or [True] * len(u.params)
    u.used = [False] * len(u.params)                # counting starts again (no step() here)
    wrap = (lambda v: global_norm_grad(v, comm)) if comm is not None else (lambda v: v)
    if u.grad_master is u.grad_shard:
        for sp, view, on in zip(u.shard_params, u.shard_views(u.grad_shard), used):
            if on or sp.grad is not None:
                sp.grad = sp.grad if type(sp.grad) is GlobalNormGrad else wrap(view)
        return
    if u.grad_master is None:
        u.grad_master = torch.zeros_like(u.master)
    for sp, view, g, on in zip(u.shard_params, u.shard_views(u.grad_master),
                               u.shard_views(u.grad_shard), used):
        if not on:
            continue
        if sp.grad is None:
            sp.grad = wrap(view.copy_(g))
        else:
            sp.grad.add_(g)
    u.grad_shard.untyped_storage().resize_(0)      # back at the next backward (2Ψ/N bytes bf16)
