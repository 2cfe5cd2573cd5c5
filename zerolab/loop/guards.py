"""What a training loop may do to the model between forward, backward and step, made safe.

Idea: a PyTorch loop owns its model. It calls `model.zero_grad()` (set_to_none=True since torch
2.0), reads and clips `p.grad`, edits weights in place under `torch.no_grad()`, replaces `p.data`,
seeds each rank differently, and reads `model.wte.weight` to log it. torch's DDP, its
ZeroRedundancyOptimizer and FSDP2 give each of these a meaning; a strategy that keeps its own
flat copies of weights and gradients must give the same meaning or refuse in one line - never a
silent difference. This module holds the pieces the strategies share for that:

- `sync_module_states`: rank 0's parameters and buffers broadcast at construction (torch DDP's
  `_sync_module_states`, FSDP's `sync_module_states=True`), so per-rank seeds cannot split the
  replicas;
- `claim_grads`: before a backward, every `p.grad` becomes a view of the strategy's gradient
  buffer again, keeping what the loop did to it (None after `zero_grad(set_to_none=True)`: zero,
  like torch; a tensor the loop assigned: its values);
- `adopt_edits`: before the update, weights the loop changed (in place, or by `p.data = t`) are
  taken into the fp32 master weights, as torch's optimizer would see them;
- `Sharded` placeholders: where a rank holds only a shard (ZeRO-3's weights outside forward,
  ZeRO-1's reduce_scatter and ZeRO-2/3's gradients after backward) the parameter, or its
  `.grad`, keeps its full shape, dtype and device, but reading or changing its values raises one
  line naming the way out (`strategy.gathered()`, `max_grad_norm=`) instead of giving an empty
  or partial tensor that looks like data (DeepSpeed's 0-element parameters).
"""
from __future__ import annotations

import torch

# Tensor methods and attributes that only read metadata (shape, dtype, device, autograd flags)
# or that the strategies themselves use to rebind storage: allowed on a placeholder.
_T = torch.Tensor
_META_GET = ("grad", "requires_grad", "dtype", "device", "shape", "is_leaf", "grad_fn", "layout",
             "ndim", "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "_base",
             "output_nr", "_version", "_backward_hooks", "itemsize", "nbytes", "T")
_ALLOWED = ({getattr(_T, n).__get__ for n in _META_GET if n not in ("T",)}
            | {getattr(_T, n).__set__ for n in ("grad", "requires_grad", "data", "_backward_hooks")}
            | {_T.size, _T.dim, _T.numel, _T.nelement, _T.register_post_accumulate_grad_hook,
               _T.register_hook, _T.requires_grad_, _T.is_floating_point, _T.is_complex,
               _T.element_size, _T.__hash__, _T.untyped_storage, _T.data_ptr, _T.stride,
               _T.storage_offset, _T.is_contiguous, _T.get_device, _T.__format__,
               torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
               torch.rand_like, torch.randn_like, _T.new_empty, _T.new_zeros, _T.new_ones,
               _T.new_full})          # the *_like / new_* family reads shape, dtype, device only


class ShardedValues(RuntimeError):
    """A read or write of values this rank does not hold (one line naming the way out)."""


def _tensors(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):     # lists too: torch.cat, torch._foreach_*
        yield from (a if isinstance(a, (list, tuple)) else (a,))


def _refuse(func, args, kwargs):
    if func in _ALLOWED:
        return
    for a in _tensors(args, kwargs):
        why = a.__dict__.get("_zerolab_sharded") if isinstance(a, torch.Tensor) else None
        if why:
            name = getattr(func, "__name__", str(func))
            if name in ("__get__", "__set__"):          # an attribute: `p.data`, say
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            raise ShardedValues(f"{why} (the loop used {name} on it)")


def _quiet(name: str, settable: bool = False) -> property:
    """Tensor attribute `name` read (and set) past `__torch_function__`: metadata that a
    placeholder allows anyway (`_ALLOWED`), at 0.5 us instead of 3 us an access - the strategies
    read and reset p.grad, p.shape, ... of every parameter every step (measured, timeit)."""
    attr = getattr(torch._C.TensorBase, name)

    def get(self):
        with torch._C.DisableTorchFunctionSubclass():
            return attr.__get__(self)

    def set(self, value):
        with torch._C.DisableTorchFunctionSubclass():
            attr.__set__(self, value)
    return property(get, set if settable else None)


class ShardedParameter(torch.nn.Parameter):
    """The class a parameter wears while its rank holds only a shard of it (ZeRO-3 outside
    forward / backward): full shape, dtype and device; its values raise `ShardedValues`."""

    grad, requires_grad = _quiet("grad", settable=True), _quiet("requires_grad", settable=True)
    shape, dtype, device = _quiet("shape"), _quiet("dtype"), _quiet("device")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _refuse(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self):
        return (f"ShardedParameter(shape={tuple(self.shape)}, dtype={self.dtype}: "
                f"{self._zerolab_sharded})")


class ShardedGrad(torch.Tensor):
    """What `p.grad` is while the averaged gradient lives only in shards (ZeRO-1 with
    reduce_scatter, ZeRO-2, ZeRO-3, between a synchronising backward and the step): full shape,
    no memory; reading it raises `ShardedValues`. Not None, so a loop that skips parameters
    without a gradient (`if p.grad is None`) does not silently skip a sharded one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _ZEROING:                # zero_grad(set_to_none=False): the gradient is
            for g in _tensors(args, kwargs):    # cleared (the next backward starts from zero)
                if type(g) is ShardedGrad:
                    g.__dict__["_zerolab_cleared"] = True
            return args[0]
        _refuse(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self):
        return f"ShardedGrad(shape={tuple(self.shape)}: {self._zerolab_sharded})"


_ZEROING = {_T.zero_, torch._foreach_zero_}


def cleared(g) -> bool:
    """True when `g` (a p.grad) means "no gradient": None, or a placeholder the loop zeroed."""
    return g is None or (type(g) is ShardedGrad and g.__dict__.get("_zerolab_cleared", False))


_ZEROS: dict = {}


def _no_memory(shape, like: torch.Tensor) -> torch.Tensor:
    """A tensor of `shape` (like's dtype and device) backed by one shared element."""
    key = (like.dtype, like.device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(1, dtype=like.dtype, device=like.device)
    return _ZEROS[key].expand(shape) if len(shape) else _ZEROS[key].view(())


_STEP_HOOK: list = []


def refuse_loop_optimizers():
    """Once per process: every torch optimizer's step() first looks at its parameters, and one
    whose weights or gradient are a strategy's placeholders is refused (ShardedValues, one line:
    which, and strategy.step()) before the step changes anything - AdamW decays the weights
    before it reads a gradient, so a refusal from inside the step would come too late."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_placeholders))


def _placeholders(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.__dict__.get("_zerolab_sharded_away"):     # fully_shard's: torchlike says why
                continue
            for t, what in ((p, "weights"), (p.grad, "gradient")):
                why = t.__dict__.get("_zerolab_sharded") if t is not None else None
                if why:
                    raise ShardedValues(
                        f"{why} ({type(optimizer).__name__}.step() read its {what}; step with "
                        "strategy.step(), the strategy's AdamW, not an optimizer of your own - "
                        "Muon and other whole-matrix ones: zerolab.variants.compose.make_muon over a "
                        "replicated model)")


def shard_params(params, shapes, whys):
    """Make each parameter of `params` a ShardedParameter of its shape whose values raise its
    message of `whys` (one line)."""
    refuse_loop_optimizers()
    with torch._C.DisableTorchFunctionSubclass():
        for p, shape, why in zip(params, shapes, whys):
            p.data = _no_memory(shape, p)
            if type(p) is not ShardedParameter:
                p.__dict__["_zerolab_class"] = type(p)
                p.__class__ = ShardedParameter
            p.__dict__["_zerolab_sharded"] = why


def is_placeholder(p: torch.Tensor) -> bool:
    """True while `p` is a placeholder (its storage is the shared element of `_no_memory`)."""
    z = _ZEROS.get((p.dtype, p.device))
    with torch._C.DisableTorchFunctionSubclass():
        return z is not None and p.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()


def unshard_param(p: torch.nn.Parameter, view: torch.Tensor):
    """Give `p` its values back: `view` (full shape) becomes its data, its class its own."""
    if type(p) is ShardedParameter:
        p.__class__ = p.__dict__.pop("_zerolab_class", torch.nn.Parameter)
        p.__dict__.pop("_zerolab_sharded", None)
    p.data = view


def shard_grads(units, who: str):
    """After a synchronising backward that left only this rank's range of the averaged gradient
    (`who`: "ZeRO-2", say): every `p.grad` of `units` becomes a ShardedGrad placeholder whose
    values raise one line naming the parameter and the ways out."""
    refuse_loop_optimizers()
    for u in units:
        for p, why in zip(u.params, u.messages(who, _SHARDED_GRAD)):
            g = torch.Tensor._make_subclass(ShardedGrad, _no_memory(p.shape, p))
            g.__dict__["_zerolab_sharded"] = why
            p.grad = g


_SHARDED_GRAD = ("{name}: {why} holds only this rank's range of the averaged gradient: clip with "
                 "max_grad_norm= (the strategy clips the global norm), scale the loss rather than "
                 "the gradients; zero_grad() is fine")


# --- the loop's gradients and weights, taken into the strategy's buffers -------------------
def claim_grads(unit, flat: torch.Tensor):
    """Before a backward: every `p.grad` of `unit` becomes its view of `flat` [padded] again.
    What the loop left there keeps torch's meaning: None (zero_grad(set_to_none=True)) or a
    placeholder it zeroed (zero_grad(set_to_none=False)) -> zero, so the gradient starts
    afresh; the view itself or the strategy's own placeholder -> kept (accumulation); another
    tensor the loop assigned -> its values, as autograd would accumulate into it.
    When the buffer's dtype is not the parameters' (`unit.grad_views`: autograd fills p.grad and
    the hook moves it, so p.grad must be None) only a zeroed placeholder can be told apart."""
    if unit.grad_views is not None:
        for p, view in zip(unit.params, unit.grad_views):
            if type(p.grad) is ShardedGrad:
                if cleared(p.grad):
                    view.zero_()
                p.grad = None
        return
    for p, view in zip(unit.params, unit.views(flat)):
        g = p.grad
        if cleared(g):
            view.zero_()
        elif type(g) is ShardedGrad or (g.data_ptr() == view.data_ptr() and g.shape == view.shape):
            pass
        else:
            view.copy_(g)
        p.grad = view


def claim_shard_grads(unit, open_bucket):
    """ZeRO-2/3 before a backward, for a unit with no bucket open: its averaged gradient lives in
    `unit.grad_shard` [Ψ_u/N] and each p.grad is the strategy's placeholder (or None after a
    step). What the loop did keeps torch's meaning: None or a zeroed placeholder -> this
    parameter's part of grad_shard is zeroed (the gradient starts afresh); a tensor the loop
    assigned -> zeroed too, and the tensor goes into a bucket opened now (`open_bucket(unit)`),
    so the next reduce_scatter adds its average over the ranks, as DDP would; the untouched
    placeholder -> kept (accumulation across synchronising backwards)."""
    grads = [p.grad for p in unit.params]
    for p in unit.params:
        p.grad = None
    for i, (g, (lo, hi)) in enumerate(zip(grads, unit.segments(sharded=True))):
        if type(g) is ShardedGrad and not cleared(g):
            continue
        unit.grad_shard[lo:max(lo, hi)].zero_()
        if g is not None and type(g) is not ShardedGrad:
            open_bucket(unit)
            (unit.grad_views or unit.views(unit.bucket))[i].copy_(g)


def adopt_edits(unit, flat: torch.Tensor, master: torch.Tensor, own=None):
    """Before an update: weights the loop changed since the last one are taken into `master`.
    `take_replaced(unit, flat)` first; then every element of `own(flat)` (this rank's part;
    default all) that differs from `master` cast to `flat`'s dtype overwrites the master
    (unchanged elements keep their low fp32 bits)."""
    take_replaced(unit, flat)
    if not flat.is_meta:                # zerolab.timing.whatif: shapes only, nothing to compare
        take_changed(master, own(flat) if own is not None else flat)


def take_changed(master: torch.Tensor, weights: torch.Tensor):
    """Copy into the fp32 `master` only the elements of `weights` (same range, the run's dtype)
    that differ from `master` cast to that dtype: untouched ones keep their low fp32 bits.
    Nothing edited (the usual step): one comparison pass, no temporaries in fp32."""
    cast = master.to(weights.dtype)
    if same_bits(weights, cast):
        return
    changed = weights != cast
    master[changed] = weights[changed].to(master.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` (same dtype and shape, contiguous) hold the same bits, compared 8
    bytes at a time where their sizes and offsets allow (2x faster than a float comparison)."""
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        try:
            return torch.equal(a.view(dtype), b.view(dtype))
        except RuntimeError:            # a size or offset that this width does not divide
            continue
    return torch.equal(a, b)


def take_replaced(unit, flat: torch.Tensor):
    """A parameter of `unit` whose data is no longer its view of `flat` (the loop ran
    `p.data = t`) has t's values copied into `flat` and is bound to its view again.
    RuntimeError (one line, naming it) if t's shape or dtype is not the parameter's."""
    for name, p, view in zip(unit.names, unit.params, unit.views(flat)):
        if p.data_ptr() != view.data_ptr():
            if p.shape != view.shape or p.dtype != view.dtype:
                raise RuntimeError(f"parameter {name} was given data of shape {tuple(p.shape)} "
                                   f"{p.dtype}; the strategy holds {tuple(view.shape)} "
                                   f"{view.dtype}: assign values of the same shape and dtype")
            view.copy_(p.data)
            p.data = view


BROADCAST_BUCKET_BYTES = 250 * 2**20      # torch DDP's broadcast bucket for module states


@torch.no_grad()
def sync_module_states(model: torch.nn.Module, comm, tensors=None):
    """Broadcast rank 0's parameters and buffers to every rank, in place (torch DDP does this at
    construction): a loop that seeds each rank differently still starts from one model. Tensors
    of one dtype and device travel flattened together, up to BROADCAST_BUCKET_BYTES per
    broadcast (torch's `_broadcast_coalesced`): one collective for a small model instead of one
    per tensor. Recorded in the ledger as phase "setup", what "init". tensors: these instead of
    all of `model`'s (fully_shard: the parameters and buffers one call manages)."""
    if comm.world_size == 1:
        return
    seen, groups = set(), {}
    for t in (tensors if tensors is not None else (*model.parameters(), *model.buffers())):
        if id(t) in seen or t.numel() == 0 or t.is_meta:
            continue
        seen.add(id(t))
        groups.setdefault((t.dtype, t.device), []).append(t.data)
    for tensors in groups.values():
        bucket, size = [], 0
        for t in [*tensors, None]:
            full = bucket and t is not None and size + t.nbytes > BROADCAST_BUCKET_BYTES
            if bucket and (t is None or full):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                comm.broadcast(flat, 0, what="init", unit="sync_module_states")
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0
            if t is not None:
                bucket.append(t)
                size += t.nbytes


def check_step(sync: bool, fresh: bool):
    """Before an update. `fresh`: a backward ran since the last step - `strategy.step()` is
    torch's `optimizer.step()` followed by `zero_grad()`, so without one there is no gradient
    (torch would step with the old ones again, or skip). `sync`: the last backward reduced the
    gradients - after `backward(sync=False)` each rank's are its own micro-batches' only, and
    updating with them would let the replicas (or the shards' owners) drift apart in silence, as
    torch DDP's no_sync() around every micro-step does. RuntimeError, one line."""
    if not fresh:
        raise RuntimeError("step() without a backward since the last step: strategy.step() "
                           "consumes the gradients (torch's optimizer.step() then zero_grad()); "
                           "run a backward first")
    if not sync:
        raise RuntimeError("step() after backward(sync=False): the gradients were never reduced "
                           "across ranks; pass sync=True to the last micro-step's backward, or "
                           "call strategy.sync_grads() before step() when that micro-step was "
                           "skipped (it reduces what was accumulated)")


def check_sync_grads(sync: bool, fresh: bool):
    """Before `Strategy.sync_grads()`: RuntimeError (one line) unless backward(sync=False) ran
    since the last synchronising backward or step."""
    if not fresh or sync:
        raise RuntimeError("sync_grads() with nothing to reduce: it finishes an accumulation of "
                           "backward(sync=False) micro-steps; " + (
                               "the last backward already reduced the gradients" if fresh else
                               "no backward ran since the last step"))


# --- ZeRO-3: the weights are placeholders between passes ---------------------------------------
def check_untouched(unit):
    """Before a unit's all_gather: RuntimeError (one line, naming it) if the loop gave a parameter
    new data (`p.data = t`) while only its shard was held - the gather would overwrite t."""
    with torch._C.DisableTorchFunctionSubclass():     # (one context for the unit)
        for name, p in zip(unit.names, unit.params):
            z = _ZEROS.get((p.dtype, p.device))
            if z is None or p.untyped_storage().data_ptr() != z.untyped_storage().data_ptr():
                raise RuntimeError(f"parameter {name} was given new data (p.data = ...) while "
                                   "ZeRO-3 held only its shard: change weights inside "
                                   "`with strategy.gathered(modifier_rank=r):`")


def refuse_state_dict(modules, gathered) -> list:
    """Hooks on `modules` that refuse `state_dict()` / `load_state_dict()` (RuntimeError, one
    line) unless `gathered()` says the weights are gathered; `state_dict(keep_vars=True)` asks
    for the live parameters themselves (placeholders) and is allowed. Returns the handles."""
    def check(module, prefix, keep_vars, load=""):
        if not gathered() and not keep_vars:
            raise RuntimeError(f"ZeRO-3 holds only shards of the weights: call {load}state_dict()"
                               f" inside `with strategy.gathered({load and 'modifier_rank=0'}):` "
                               "(on every rank)")
    return [h for m in modules for h in (
        m.register_state_dict_pre_hook(check),
        m.register_load_state_dict_pre_hook(lambda *_: check(0, 0, False, "load_")))]


# --- what every rank must agree on (the loop's edits; ZeRO-3's gathers: order.agree) ---------
def fingerprint(units) -> torch.Tensor:
    """[2 x units] int64: two checksums of each unit's full weights `param_flat` (the sum of
    their bits, and that sum weighted by position), enough to tell an edit from none."""
    out = []
    for u in units:
        t = u.param_flat
        bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        bits = bits.to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device) % 8191 + 1
        out += [bits.sum(), (bits * weights).sum()]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def check_edits(comm, units, before: torch.Tensor) -> bool:
    """On leaving `gathered()` without modifier_rank (`before`: `fingerprint(units)` on entry):
    True if the weights were changed, the same way on every rank (then every stage can keep
    the change: each rank's copy holds it). RuntimeError on every rank (one line) if the ranks
    changed them differently - rank 0 only, say: only `gathered(modifier_rank=r)` says whose
    change wins. One all_reduce (max) of 4 int64 per unit (ledger: phase "eval", "metric")."""
    if not units or units[0].param_flat.is_meta:
        return False
    after = fingerprint(units)
    both = torch.cat([after, -after])
    with comm.phase("eval"):
        comm.all_reduce(both, what="metric", unit="edits", op="max")
    k = after.numel()
    if not torch.equal(both[:k], -both[k:]):
        raise RuntimeError("the ranks changed the weights differently inside "
                           "`strategy.gathered()`: pass modifier_rank=r to keep rank r's change "
                           "on every rank (or make the same change on every rank)")
    return not torch.equal(before, after)
