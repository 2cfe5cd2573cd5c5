"""`fully_shard`: FSDP2's interface over zerolab's ZeRO-3, each shard a real nn.Parameter.

    for block in model.blocks:
        fully_shard(block)                      # one unit each: gathered for its own forward
    fully_shard(model)                          # the root: what is left (embeddings, head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)    # steps this rank's shards
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

Each call shards the trainable parameters its module holds that no inner call took (FSDP2's
rule): rank 0's values are broadcast, one zerolab unit is built over them (`sharding.FlatUnit`,
layout "dim0" - FSDP2's: rank r holds rows [r*ceil(d0/N), ...) of every parameter - or "flat" -
DeepSpeed's and FSDP1's: the unit's elements end to end, split in N ranges), and every place the
module held a parameter now holds this rank's shard: an nn.Parameter (shape: its rows x the
rest for "dim0", a 1-D piece for "flat") that is a view of the unit's master shard. A torch
optimizer built afterwards over model.parameters() steps those shards in place. The outermost
call builds zerolab's ZeRO-3 for a loop that steps (zerolab.loopstep.LoopStepZeRO3) over every unit: forward gathers a unit in
param_dtype just before its module runs and frees it after (reshard_after_forward=True); the
loop's loss.backward() gathers again, reduce-scatters each unit's gradient as soon as it is
ready and leaves each shard parameter's .grad = its piece of the averaged gradient.
"""
from __future__ import annotations

import dataclasses

import torch

from ..comm import Comm
from ..guards import is_placeholder, sync_module_states
from ..loopstep import LoopStepZeRO3, shard_unit
from ..sharding import ROOT, FlatUnit
from .backward import arm, cast_floats


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy. param_dtype: dtype of the gathered weights the forward and
    backward compute with (None: the parameters' own). reduce_dtype: dtype of the gradient
    reduce_scatter (None: param_dtype). output_dtype: the root module's floating outputs are
    cast to it (None: left). cast_forward_inputs: floating inputs of each fully_shard module are
    cast to param_dtype. The shards the optimizer steps (and their .grad) keep the parameters'
    own dtype (the fp32 master weights of the notes)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype)
                                          and value.is_floating_point):
                raise ValueError(f"{name} {value!r} must be None or a floating torch.dtype "
                                 "(torch.bfloat16, torch.float16, torch.float32)")


class FSDPModule:
    """Methods fully_shard adds to the module's class (FSDP2's FSDPModule)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """False: backwards accumulate full local gradients, no reduce_scatter (FSDP2's; torch
        DDP's no_sync); the first backward after setting True reduce-scatters the sum. Applies
        to the whole model (set it on the root)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync {requires_gradient_sync!r} is not a bool")
        _root_state(self).sync = requires_gradient_sync

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full tensor} under the original names (those of the unwrapped module's
        state_dict), parameters in their own dtype, on every rank: one all_gather of each unit's
        master shard (ledger phase "eval"). A collective: call it on every rank."""
        return _full_state_dict(self)

    @property
    def comm(self):
        """The zerolab.comm.Comm every collective of this model goes through (`.records`)."""
        return self._zerolab_fsdp.comm

    @property
    def zerolab_strategy(self):
        """The zerolab.loopstep.LoopStepZeRO3 running this model (on the root)."""
        return _root_state(self).strategy


class _State:
    def __init__(self, comm, unit, policy, hooks):
        self.comm, self.unit, self.policy, self.hooks = comm, unit, policy, hooks
        self.strategy, self.sync = None, True


def _root_state(module) -> _State:
    state = getattr(module, "_zerolab_fsdp", None)
    if state is None or state.strategy is None:
        raise RuntimeError("call this on the outermost module given to fully_shard (the root)")
    return state


_CLASSES: dict = {}


def fully_shard(module: torch.nn.Module, *, mesh=None, reshard_after_forward=None,
                shard_placement_fn=None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy=None, ignored_params=None, layout: str = "dim0",
                process_group=None, comm=None):
    """Shard `module`'s trainable parameters that no inner fully_shard call took, in place, and
    return `module` (its class now also an FSDPModule). Call it on inner blocks first, the root
    last, as with FSDP2; FSDP2's keywords. mesh: a 1-D DeviceMesh (its group is used) or None.
    reshard_after_forward: None / True / False (the root always keeps its weights from forward
    into backward, as FSDP2's). mp_policy: MixedPrecisionPolicy. ignored_params: parameters
    left alone (replicated, like frozen ones: FSDP2 shards frozen parameters too).
    shard_placement_fn and offload_policy other than None / the default are refused. layout:
    "dim0" (FSDP2's) or "flat" (zerolab's). process_group / comm: as DistributedDataParallel
    (an inner call's Comm is reused, so one ledger holds every collective). Raises ValueError /
    TypeError (one line) for a bad value, RuntimeError for a parameter shared by two modules
    sharded by separate calls."""
    if reshard_after_forward is None:
        reshard_after_forward = True
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"mesh {mesh!r}: a 1-D mesh (HSDP's 2-D mesh is not offered)")
        process_group = mesh.get_group()
    if shard_placement_fn is not None:
        raise ValueError("shard_placement_fn is not offered: zerolab shards on dim 0 (layout="
                         "'dim0') or flat ranges (layout='flat')")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise ValueError(f"offload_policy {offload_policy!r}: CPU offload is not offered")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward {reshard_after_forward!r} must be True or False "
                         "(an int, ZeRO++'s hpZ, is zerolab.hybrid.HpZ, not offered by fully_shard)")
    if type(mp_policy).__name__ == "MixedPrecisionPolicy" and not isinstance(
            mp_policy, MixedPrecisionPolicy):           # torch's own: the same four fields
        mp_policy = MixedPrecisionPolicy(**{f.name: getattr(mp_policy, f.name)
                                            for f in dataclasses.fields(MixedPrecisionPolicy)})
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy {mp_policy!r} is not a MixedPrecisionPolicy")
    if layout not in ("dim0", "flat"):
        raise ValueError(f"layout {layout!r} is not one of 'dim0', 'flat'")
    if getattr(module, "_zerolab_fsdp", None) is not None:
        raise RuntimeError(f"{type(module).__name__} was given to fully_shard already")
    inner = [(name, m) for name, m in module.named_modules()
             if m is not module and getattr(m, "_zerolab_fsdp", None) is not None]
    if comm is None:
        comm = inner[0][1]._zerolab_fsdp.comm if inner else Comm(process_group)
    inside = {id(x) for _, m in inner for x in m.modules()}
    ignored = {id(p) for p in (ignored_params or ())}
    # --- the parameters this call manages, and every place the module holds each ------------
    places, params, rest, frozen = {}, {}, [], []
    for mname, m in module.named_modules():
        if id(m) in inside:
            continue
        for attr, p in m._parameters.items():
            if p is None or getattr(p, "_zerolab_shard", False):
                continue
            qual = f"{mname}.{attr}" if mname else attr
            if is_placeholder(p):
                raise RuntimeError(f"parameter {qual} is shared with a module that fully_shard "
                                   "sharded on its own: shard their common parent instead (the "
                                   "shared weight then lives in its unit)")
            if id(p) in ignored:                    # the loop's own: not cast, not reduced
                p._zerolab_ignored = True
                continue
            if not p.requires_grad:
                rest.append(p)
                frozen.append((m, attr, p))
                continue
            params.setdefault(id(p), (qual, p))
            places.setdefault(id(p), []).append((m, attr))
        rest += [b for b in m._buffers.values() if b is not None]
    sync_module_states(module, comm, [p for _, p in params.values()] + rest)
    unit = None
    if params:
        unit = FlatUnit(ROOT, [p for _, p in params.values()], comm.world_size, comm.rank,
                        names=[q for q, _ in params.values()], layout=layout)
        unit.grad_dtype, unit.reshard = mp_policy.reduce_dtype, reshard_after_forward
        shard_unit(unit, mp_policy.reduce_dtype, mp_policy.param_dtype)
        unit.shard_params = []
        for (_, full), view in zip(params.values(), unit.shard_views(unit.master)):
            shard = torch.nn.Parameter(view, requires_grad=True)
            shard._zerolab_shard = True
            unit.shard_params.append(shard)
            unit.swap += [(m, attr, full, shard) for m, attr in places[id(full)]]
        for m, attr, _, shard in unit.swap:
            m._parameters[attr] = shard
    # --- inner calls become blocks of this one; the outermost builds the strategy -----------
    units = [unit] if unit is not None else []
    qual = {id(m): name for name, m in module.named_modules()}
    for name, m in inner:
        state = m._zerolab_fsdp
        if state.strategy is not None:
            state.strategy.close()
            state.strategy = None
        u = state.unit
        if u is not None:
            if u.module is None:                    # it was a root: now a block of this one
                u.modules, u.module = [m], m
            first = {}                              # names as this module's state_dict has them
            for mm, attr, full, _ in u.swap:
                first.setdefault(id(full), f"{qual[id(mm)]}.{attr}")
            u.name, u.names = name, [first[id(p)] for p in u.params]
            units.append(u)
    if not units:
        raise ValueError(f"{type(module).__name__} has no trainable parameter to shard")
    state = _State(comm, unit, mp_policy, [])
    state.frozen = frozen if mp_policy.param_dtype is not None else []
    module._zerolab_fsdp = state
    # find_unused_parameters: a parameter no rank used keeps .grad None, as in FSDP2
    state.strategy = LoopStepZeRO3(module, comm, units=units, find_unused_parameters=True)
    state.hooks += [module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True),
                    module.register_forward_hook(_post_forward)]
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]
    return module


def _pre_forward(module, args, kwargs):
    state = module._zerolab_fsdp
    if state.strategy is not None:                  # the root: tag the forward's collectives
        state.phase_before, state.comm.current_phase = state.comm.current_phase, "forward"
    dtype = state.policy.param_dtype
    for m, attr, p in state.frozen:                 # frozen weights computed in param_dtype too
        m._parameters[attr] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
    if dtype is not None and state.policy.cast_forward_inputs:
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)
    return args, kwargs


def _post_forward(module, args, output):
    state = module._zerolab_fsdp
    for m, attr, p in state.frozen:                 # (the cast copy stays saved for backward)
        m._parameters[attr] = p
    if state.strategy is None:
        return output
    state.comm.current_phase = state.phase_before
    if state.policy.output_dtype is not None:
        output = cast_floats(output, state.policy.output_dtype)
    strategy = state.strategy
    return arm(output, lambda: strategy.begin_backward(state.sync), strategy.end_backward)


def _full_state_dict(module) -> dict[str, torch.Tensor]:
    state = _root_state(module)
    comm, full = state.comm, {}
    with torch.no_grad(), comm.phase("eval"):
        for u in state.strategy.units:
            packed = torch.empty(u.padded_numel, dtype=u.master.dtype, device=u.master.device)
            comm.all_gather(packed, u.master, what="params", unit=u.name)
            natural = packed
            if u.layout == "dim0":
                natural = torch.empty_like(packed)
                u.unpack(packed, natural)
            for shard, view in zip(u.shard_params, u.views(natural)):
                full[id(shard)] = view.clone()
    return {name: full[id(t)] if id(t) in full else t.detach().clone()
            for name, t in module.state_dict(keep_vars=True).items()}
