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
optimizer built afterwards over model.parameters() steps those shards in place: an element-wise
one (another is refused at its first step: optimizers.py; zerolab.torchlike.Adafactor runs). The outermost
call builds zerolab's ZeRO-3 for a loop that steps (zerolab.variants.loopstep.LoopStepZeRO3) over every unit: forward gathers a unit in
param_dtype just before its module runs and frees it after (reshard_after_forward=True); the
loop's loss.backward() gathers again, reduce-scatters each unit's gradient as soon as it is
ready and leaves each shard parameter's .grad = its piece of the averaged gradient.

One ledger: every call of one model writes into the root's Comm (`module.comm` of any of them;
the start-up broadcasts of sibling calls, made before the root existed, are moved into it in
the order they ran), each collective tagged with its phase - "forward" for any fully_shard'ed
module's forward (or a method given to `register_fsdp_forward_method`; "eval" under
torch.no_grad(), as zerolab's stages name it), "backward" from the
moment the backward reaches the model (the root's output, or a block's output the model returns
as its own), "step" for clip_grad_norm_'s norm, "eval" for full_state_dict. FSDP2's besides:
`fully_shard([m1, m2])` (one unit over several modules), `set_modules_to_forward_prefetch` /
`set_modules_to_backward_prefetch`, `register_fsdp_forward_method`, `model.to(dtype / device)`
after sharding (the units are rebuilt in the new dtype), a MixedPrecisionPolicy per call
(output_dtype too: each module's outputs).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..loop.guards import is_placeholder, sync_module_states
from ..loop.leaves import MARK
from ..variants.loopstep import LoopStepZeRO3, replaced, reshard_unit, shard_unit
from ..sharding import ROOT, FlatUnit
from .backward import Backward, cast_floats, in_backward, not_picklable
from .checkpoint import full_tensors, own_rows
from .ledger import LedgerComm, one_ledger
from .optimizers import install_step_check


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy. param_dtype: dtype of the gathered weights the forward and
    backward compute with (None: the parameters' own). reduce_dtype: dtype of the gradient
    reduce_scatter (None: param_dtype). output_dtype: the floating outputs of the module(s) of
    the fully_shard call given this policy are cast to it (None: left), inner ones too.
    cast_forward_inputs: floating inputs of each fully_shard module are cast to param_dtype.
    The shards the optimizer steps (and their .grad) keep the parameters'
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

    def set_modules_to_forward_prefetch(self, modules: list):
        """FSDP2's: once this module's weights are gathered in forward, the all_gathers of
        `modules` (fully_shard'ed modules, in this order) are issued at once, instead of the
        next block's only (zerolab's default, prefetch depth 1). [] : none ahead."""
        _state_of(self).unit_attr("prefetch_forward", _units_of(modules))

    def set_modules_to_backward_prefetch(self, modules: list):
        """FSDP2's: as set_modules_to_forward_prefetch, when this module's backward gathers its
        weights (default: the block before it in forward order)."""
        _state_of(self).unit_attr("prefetch_backward", _units_of(modules))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full tensor} under the original names (those of the unwrapped module's
        state_dict), parameters in their own dtype, on every rank: one all_gather of each unit's
        master shard (ledger phase "eval"). A collective: call it on every rank."""
        return full_tensors(_root_state(self), self)

    def __getstate__(self):
        raise TypeError(not_picklable("fully_shard", "model.full_state_dict()"))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, and a full state dict too, at any world size (`checkpoint.own_rows`)."""
        own = self.state_dict(keep_vars=True)
        return super().load_state_dict({k: own_rows(k, t, own.get(k))
                                        for k, t in state_dict.items()}, strict, assign)

    @property
    def comm(self):
        """The zerolab.comm.Comm every collective of this model goes through (`.records`): the
        root's, one ledger for every fully_shard call of the model."""
        return _state_of(self).comm

    @property
    def zerolab_strategy(self):
        """The zerolab.variants.loopstep.LoopStepZeRO3 running this model (on the root)."""
        return _root_state(self).strategy

    def _apply(self, fn, recurse=True):
        """module.to(dtype / device), .double(), .cuda(), ...: as FSDP2, the shard parameters
        take the new dtype and device, and the unit is rebuilt around them (`reshard_unit`):
        it gathers, computes and reduces in the new dtype (unless mp_policy says otherwise)."""
        out = super()._apply(fn, recurse)
        state = self.__dict__.get("_zerolab_fsdp")
        u = state.unit if state is not None else None
        if u is not None and replaced(u) and len({(sp.dtype, sp.device)
                                                  for sp in u.shard_params}) == 1:
            reshard_unit(u, state.comm)     # (a group's other modules: at their own _apply)
        return out


class _State:
    """One fully_shard call: its modules, its unit (None: nothing of its own to shard), its
    policy; `root` the state of the outermost call that took it in (itself for that one), whose
    `strategy`, `comm` and `backward` every state of the model shares."""

    def __init__(self, comm, unit, policy, modules):
        self.comm, self.unit, self.policy, self.modules = comm, unit, policy, modules
        self.hooks, self.frozen, self.phase_before = [], [], None
        self.strategy, self.root, self.backward, self.sync = None, None, None, True

    def unit_attr(self, name, value):
        if self.unit is not None:
            setattr(self.unit, name, value)


def _state_of(module) -> _State:
    return module.__dict__["_zerolab_fsdp"]


def _root_state(module) -> _State:
    state = module.__dict__.get("_zerolab_fsdp")
    if state is None or state.strategy is None:
        raise RuntimeError("call this on the outermost module given to fully_shard (the root)")
    return state


def _units_of(modules) -> list:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(m)}: {type(m).__name__}")
    return [u for u in dict.fromkeys(_state_of(m).unit for m in modules) if u is not None]


_CLASSES: dict = {}


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), offload_policy=None,
                ignored_params=None, layout: str = "dim0", process_group=None, comm=None):
    """Shard `module`'s trainable parameters that no inner fully_shard call took, in place, and
    return `module` (its class now also an FSDPModule). Call it on inner blocks first, the root
    last, as with FSDP2; FSDP2's keywords. module: an nn.Module, or a list of them sharded as
    one unit (FSDP2's `fully_shard([norm, head])`: gathered when the first of them runs, freed
    once all have; the list is returned; the root must be a module that contains them).
    mesh: a 1-D DeviceMesh (its group is used) or None.
    reshard_after_forward: None / True / False (the root always keeps its weights from forward
    into backward, as FSDP2's). mp_policy: MixedPrecisionPolicy (per call, as FSDP2's).
    ignored_params: parameters left alone (replicated, like frozen ones: FSDP2 shards frozen
    parameters too). shard_placement_fn and offload_policy other than None / the default are
    refused. layout: "dim0" (FSDP2's) or "flat" (zerolab's). process_group / comm: as
    DistributedDataParallel; every call of one model writes into one ledger (the root's Comm:
    `module.comm` of any of them). Raises ValueError / TypeError (one line) for a bad value,
    RuntimeError for a parameter shared by two modules sharded by separate calls."""
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
    modules = _modules_of(module)
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward {reshard_after_forward!r} must be True or False "
                         "(an int, ZeRO++'s hpZ, is zerolab.variants.hybrid.HpZ, not offered by fully_shard)")
    if type(mp_policy).__name__ == "MixedPrecisionPolicy" and not isinstance(
            mp_policy, MixedPrecisionPolicy):           # torch's own: the same four fields
        mp_policy = MixedPrecisionPolicy(**{f.name: getattr(mp_policy, f.name)
                                            for f in dataclasses.fields(MixedPrecisionPolicy)})
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy {mp_policy!r} is not a MixedPrecisionPolicy")
    if layout not in ("dim0", "flat"):
        raise ValueError(f"layout {layout!r} is not one of 'dim0', 'flat'")
    for m in modules:
        if m.__dict__.get("_zerolab_fsdp") is not None:
            raise RuntimeError(f"{type(m).__name__} was given to fully_shard already")
    group = {id(m) for m in modules}
    inner = list(dict.fromkeys(                     # earlier calls inside: distinct, in order
        m.__dict__["_zerolab_fsdp"] for top in modules for m in top.modules()
        if id(m) not in group and m.__dict__.get("_zerolab_fsdp") is not None))
    _check_leaves(modules, inner)
    if comm is None:
        comm = inner[0].comm if inner else LedgerComm(process_group)
    inside = {id(x) for s in inner for m in s.modules for x in m.modules()}
    ignored = {id(p) for p in (ignored_params or ())}
    # --- the parameters this call manages, and every place the module holds each ------------
    places, params, rest, frozen = {}, {}, [], []
    for k, top in enumerate(modules):
        for mname, m in top.named_modules():
            if id(m) in inside:
                continue
            for attr, p in m._parameters.items():
                if p is None or getattr(p, "_zerolab_shard", False):
                    continue
                qual = ".".join(x for x in (str(k) if len(modules) > 1 else "", mname, attr) if x)
                if is_placeholder(p):
                    raise RuntimeError(f"parameter {qual} is shared with a module that fully_shard "
                                       "sharded on its own: shard their common parent instead (the "
                                       "shared weight then lives in its unit)")
                if id(p) in ignored:                # the loop's own: not cast, not reduced
                    p._zerolab_ignored = True
                    continue
                if not p.requires_grad:
                    rest.append(p)
                    frozen.append((m, attr, p))
                    continue
                params.setdefault(id(p), (qual, p))
                places.setdefault(id(p), []).append((m, attr))
            rest += [b for b in m._buffers.values() if b is not None]
    if not params and (len(modules) > 1 or all(s.unit is None for s in inner)):
        raise ValueError(f"{_names(modules) if len(modules) > 1 else type(modules[0]).__name__} "
                         "has no trainable parameter to shard")
    one_ledger(comm, [s.comm for s in inner])     # every block's broadcasts in one ledger
    sync_module_states(modules[0], comm, [p for _, p in params.values()] + rest)
    unit = None
    if params:
        unit = FlatUnit(ROOT, [p for _, p in params.values()], comm.world_size, comm.rank,
                        module=modules if len(modules) > 1 else None,
                        names=[q for q, _ in params.values()], layout=layout)
        unit.grad_dtype, unit.reshard = mp_policy.reduce_dtype, reshard_after_forward
        unit.param_dtype = mp_policy.param_dtype
        shard_unit(unit, mp_policy.reduce_dtype, mp_policy.param_dtype)
        unit.shard_params = []
        for (_, full), view, shape in zip(params.values(), unit.shard_views(unit.master),
                                          unit.shapes):
            shard = torch.nn.Parameter(view, requires_grad=True)
            shard._zerolab_shard, shard._zerolab_layout = True, layout    # (optimizers.py's
            shard._zerolab_full_shape = torch.Size(shape)                    # step check and
            full._zerolab_sharded_away = True                                # Adafactor)
            unit.shard_params.append(shard)
            unit.swap += [(m, attr, full, shard) for m, attr in places[id(full)]]
        for m, attr, _, shard in unit.swap:
            m._parameters[attr] = shard
    state = _State(comm, unit, mp_policy, modules)
    for shard in (unit.shard_params if unit is not None else ()):
        shard._zerolab_state = state
    install_step_check()                    # the loop's optimizer: element-wise, or refused
    state.frozen = frozen if mp_policy.param_dtype is not None else []
    for m in modules:
        m._zerolab_fsdp = state
    if len(modules) == 1:
        _take_in(state, inner)              # the root, until an outer call takes it in
    for m in modules:                       # (after the strategy's: the post-hook runs last)
        state.hooks += [m.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True),
                        m.register_forward_hook(_post_forward)]
        cls = type(m)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _CLASSES[cls]
    return module


def _modules_of(module) -> list:
    """fully_shard's argument as a list of modules (FSDP2's checks; a list keeps only the
    modules no other of it contains)."""
    many = isinstance(module, (list, tuple))
    modules = list(module) if many else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got "
                            f"{type(m).__name__}")
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) and \
                type(m).forward is torch.nn.Module.forward:
            raise ValueError("fully_shard does not support containers that do not implement "
                             f"forward: {type(m).__name__} (shard each module in it)")
    if many:
        within = [{id(x) for x in m.modules()} for m in modules]
        modules = [m for m in modules
                   if not any(id(m) in w and m is not o for o, w in zip(modules, within))]
    return modules


def _check_leaves(modules, inner):
    """ValueError (one line) when an earlier call sharded blocks inside a leaf module
    (zerolab.set_leaf_modules: the layer whose blocks run in a varying order is one unit)."""
    sharded = {id(m) for s in inner for m in s.modules}
    for top in modules:
        for name, leaf in top.named_modules():
            if not getattr(leaf, MARK, False) or id(leaf) in sharded:
                continue
            within = [n for n, m in leaf.named_modules() if n and id(m) in sharded]
            if within:
                raise ValueError(
                    f"fully_shard was called on {', '.join(within)} inside {name or 'the root'} "
                    f"({type(leaf).__name__}), which set_leaf_modules made one unit: call "
                    f"fully_shard on the {type(leaf).__name__} itself, not on the blocks in it")


def _names(modules) -> str:
    return "[" + ", ".join(type(m).__name__ for m in modules) + "]"


def _take_in(state, inner):
    """`state`'s call is the outermost so far: every earlier call inside it becomes a block of
    one strategy (ZeRO-3 for a loop that steps) over all their units, in forward order (the
    order of named_modules), with the root's own unit first."""
    module = state.modules[0]
    qual = {id(m): name for name, m in module.named_modules()}
    units = [state.unit] if state.unit is not None else []
    for s in inner:
        if s.strategy is not None:
            s.strategy.close()
            s.strategy = None
        s.root, s.comm, s.backward = state, state.comm, None
        u = s.unit
        if u is None:
            continue
        if u.module is None:                        # it was a root: now a block of this one
            u.modules, u.module = list(s.modules), s.modules[-1]
        first = {}                                  # names as this module's state_dict has them
        for mm, attr, full, _ in u.swap:
            first.setdefault(id(full), f"{qual[id(mm)]}.{attr}")
        u.name = "+".join(qual[id(m)] for m in s.modules)
        u.names, u._messages = [first[id(p)] for p in u.params], {}
        units.append(u)
    state.root = state
    state.backward = Backward(lambda: state.strategy.begin_backward(state.sync),
                              lambda: state.strategy.end_backward())
    # find_unused_parameters: a parameter no rank used keeps .grad None, as in FSDP2
    state.strategy = LoopStepZeRO3(module, state.comm, units=units, find_unused_parameters=True,
                                   enter_backward=state.backward.enter)


def _pre_forward(module, args, kwargs):
    state = _state_of(module)
    root = state.root
    if root is None or root.strategy is None:
        raise RuntimeError(f"fully_shard({_names(state.modules)}) made one unit of several modules"
                           ": shard a module that contains them too (the root), as FSDP2 needs "
                           "a single root module")
    if not in_backward():                           # (a recomputation in backward stays there)
        if state is root:
            root.backward.reset()
            root.strategy.refresh()                 # shards the loop gave new data: taken in
        phase = "forward" if torch.is_grad_enabled() else "eval"      # (as the stages name it)
        state.phase_before, state.comm.current_phase = state.comm.current_phase, phase
    dtype = state.policy.param_dtype
    for m, attr, p in state.frozen:                 # frozen weights computed in param_dtype too
        m._parameters[attr] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
    if dtype is not None and state.policy.cast_forward_inputs:
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)
    return args, kwargs


def _post_forward(module, args, output):
    state = _state_of(module)
    for m, attr, p in state.frozen:                 # (the cast copy stays saved for backward)
        m._parameters[attr] = p
    if state.policy.output_dtype is not None:       # every module's, as FSDP2's
        output = cast_floats(output, state.policy.output_dtype)
    if state.phase_before is not None:
        state.comm.current_phase, state.phase_before = state.phase_before, None
    if state.strategy is None:
        return output
    return state.backward.arm(output)


def register_fsdp_forward_method(module: torch.nn.Module, method_name: str) -> None:
    """FSDP2's: `module.method_name(...)` runs fully_shard's forward hooks around it, as
    `module(...)` does - its weights gathered before and freed after, the ledger tagging it
    "forward", inputs and outputs cast by the module's MixedPrecisionPolicy, and (on the root)
    the backward through its outputs armed. A module fully_shard did not shard: nothing
    (FSDP2's). ValueError (one line) if the module has no such method."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        return _hooked(self, method, args, kwargs)
    setattr(module, method_name, wrapped.__get__(module, type(module)))


def _hooked(module, method, args, kwargs):
    """`method(*args, **kwargs)` with the forward hooks zerolab put on `module` (fully_shard's
    and its strategy's, in the order nn.Module runs them; the loop's own hooks are left out)."""
    state = _state_of(module)
    root = state.root if state.root is not None else state
    handles = list(state.hooks) + list(root.strategy.handles if root.strategy else ())
    ours = {getattr(h, "handle", h).id for h in handles if hasattr(getattr(h, "handle", h), "id")}
    for hid, hook in list(module._forward_pre_hooks.items()):
        if hid not in ours:
            continue
        if hid in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    output = method(*args, **kwargs)
    for hid, hook in list(module._forward_hooks.items()):
        if hid not in ours:
            continue
        result = (hook(module, args, kwargs, output) if hid in module._forward_hooks_with_kwargs
                  else hook(module, args, output))
        if result is not None:
            output = result
    return output
