"""Flat buffers, padding, owned ranges and buckets: the bookkeeping every strategy shares.

Idea: the trainable parameters of one block (a "unit": the bucket that is reduced together in
backward and, in ZeRO-3, gathered together in forward) are laid end to end in one flat buffer of
Ψ_u elements, padded with zeros to a multiple of N. Rank r owns the contiguous range
[r·Ψ_u/N, (r+1)·Ψ_u/N) of every unit: that range's fp32 master weights, exp_avg and exp_avg_sq
live on rank r only (stage >= 1), and so do its averaged gradients (stage >= 2) and bf16 weights
(stage 3). Padding is zero, receives zero gradient, stays zero under AdamW, and is dropped when
parameters are read back, so it never reaches results, norms or saved state.

Units come from `model.zero_units()` (a list of (name, module)); parameters that belong to no
unit, or to more than one (tied embedding and head), form the "root" unit, which stays gathered
for a whole forward (or backward) pass, like FSDP's root module.
"""
from __future__ import annotations

import math

import torch

ROOT = "root"


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s owned range [start, stop) of a flat buffer of `numel` elements padded with
    zeros to a multiple of `world_size`: every rank owns ceil(numel / N) elements, the padded
    buffer has N times that, and the last ranks' ranges may reach into (or lie wholly in) the
    padding. numel >= 1, world_size >= 1, 0 <= rank < world_size (ints).
    Exercise (a) of notebooks/exercises: `zerolab check shard_range --impl FILE` replaces it."""
    shard = math.ceil(numel / world_size)
    return rank * shard, (rank + 1) * shard


class FlatUnit:
    """The trainable parameters of one unit, flattened and padded for `world_size` ranks.

    params: list of nn.Parameter. The flat order is the list order.
    Attributes: numel (Ψ_u), padded_numel (multiple of world_size), shard_numel (= padded/N),
    start (first element of this rank's range), offsets (element offset of each param).
    """

    def __init__(self, name: str, params: list, world_size: int, rank: int, module=None):
        self.name, self.params, self.module = name, list(params), module
        self.numel = sum(p.numel() for p in self.params)
        self.start, stop = shard_range(max(self.numel, 1), world_size, rank)
        self.shard_numel = stop - self.start
        self.padded_numel = self.shard_numel * world_size
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        # filled by the strategies
        self.param_flat = self.param_shard = self.grad_flat = self.grad_shard = None
        self.master = None
        self.bucket = None          # transient full-gradient buffer (ZeRO-2/3)
        self.ready = 0              # params whose gradient has been accumulated this backward

    # --- flat <-> per-parameter views -------------------------------------------------------
    def flatten(self, tensors=None, dtype=None) -> torch.Tensor:
        """A new [padded_numel] buffer holding `tensors` (default: the params' data) end to end."""
        tensors = [p.detach() for p in self.params] if tensors is None else tensors
        ref = self.params[0] if self.params else torch.empty(0)
        flat = torch.zeros(self.padded_numel, dtype=dtype or ref.dtype, device=ref.device)
        for t, off in zip(tensors, self.offsets):
            flat[off:off + t.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` [padded_numel] shaped like each parameter (no copy)."""
        return [flat[off:off + p.numel()].view_as(p) for p, off in zip(self.params, self.offsets)]

    def bind_params(self, flat: torch.Tensor):
        """Make every parameter's data a view of `flat`, so writes to `flat` update the model."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view

    def bind_grads(self, flat: torch.Tensor):
        """Make every parameter's .grad a view of `flat`: autograd accumulates straight into it."""
        for p, view in zip(self.params, self.views(flat)):
            p.grad = view

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous range of `flat` [padded_numel] -> view [shard_numel]."""
        return flat[self.start:self.start + self.shard_numel]

    def padding_in_shard(self) -> int:
        """Padding elements inside this rank's range (only the last ranks hold any)."""
        end = self.start + self.shard_numel
        return max(0, end - max(self.start, self.numel))


def build_units(model: torch.nn.Module, world_size: int, rank: int) -> list[FlatUnit]:
    """Split `model`'s trainable parameters into FlatUnits: the root unit first, then one per
    module of `model.zero_units()` in forward order. Frozen parameters are left out (they stay
    replicated and untouched). Tied parameters appear once (in the root unit)."""
    named_units = list(model.zero_units()) if hasattr(model, "zero_units") else []
    owners: dict[int, list[str]] = {}
    for name, module in named_units:
        for p in module.parameters():
            owners.setdefault(id(p), []).append(name)
    seen, root, per_unit = set(), [], {name: [] for name, _ in named_units}
    for p in model.parameters():           # deduplicated: a tied weight appears once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        names = owners.get(id(p), [])
        (per_unit[names[0]] if len(names) == 1 else root).append(p)
    units = [FlatUnit(ROOT, root, world_size, rank)] if root else []
    units += [FlatUnit(name, per_unit[name], world_size, rank, module)
              for name, module in named_units if per_unit[name]]
    return units


# --- hooks ---------------------------------------------------------------------------------
def on_grads_ready(units: list[FlatUnit], callback):
    """Call `callback(unit)` once every parameter of `unit` has its gradient accumulated in a
    backward pass (a post-accumulate-grad hook per parameter). Reset `unit.ready = 0` before
    each backward. Returns the hook handles."""
    handles = []
    for unit in units:
        for p in unit.params:
            def hook(_, unit=unit):
                unit.ready += 1
                if unit.ready == len(unit.params):
                    callback(unit)
            handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


def on_pre_backward(module: torch.nn.Module, callback):
    """Call `callback()` when the gradient of `module`'s output arrives, i.e. just before the
    module's own backward runs (FSDP's pre-backward hook). Output: a tensor or tuple of them."""
    def forward_hook(mod, args, output):
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = []
        for t in tensors:
            def grad_hook(grad):
                if not fired:
                    fired.append(True)
                    callback()
                return grad
            t.register_hook(grad_hook)
    return module.register_forward_hook(forward_hook)


# --- storage that comes and goes (ZeRO-3's gathered blocks, ZeRO-2/3's gradient buckets) ----
def free_storage(t: torch.Tensor):
    """Release `t`'s memory but keep the tensor (and every view of it) for later refilling."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor):
    """Give `t` back its full storage (contents undefined) after `free_storage`."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


# --- the update, shared by every stage ------------------------------------------------------
def make_optimizer(masters: list[torch.Tensor], lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                   weight_decay=0.1) -> torch.optim.AdamW:
    """torch's AdamW over this rank's fp32 master weights (full or shards). The math is torch's;
    where the state lives is the lesson. exp_avg / exp_avg_sq appear in optimizer.state."""
    return torch.optim.AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def clip_grad_norm_(masters: list[torch.Tensor], max_norm: float, comm=None) -> torch.Tensor:
    """Global L2 norm of the gradients in `masters[i].grad` (fp32), summed over ranks when they
    hold disjoint shards (`comm` given: one all_reduce of a scalar), then scaled like
    torch.nn.utils.clip_grad_norm_ (coef = max_norm / (norm + 1e-6), capped at 1). max_norm <= 0
    only measures. Returns the norm (fp32 scalar tensor), equal on every rank."""
    sq = torch.zeros((), dtype=torch.float32, device=masters[0].device)
    for m in masters:
        sq += m.grad.float().pow(2).sum()
    if comm is not None:
        comm.all_reduce(sq, what="metric", unit="grad_norm")
    norm = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for m in masters:
            m.grad.mul_(coef)
    return norm


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once; freed ones are 0)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def optimizer_states(optimizer, masters) -> dict[str, list[torch.Tensor]]:
    """{"master_weights", "exp_avg", "exp_avg_sq"} tensors of `optimizer` (empty before step 1)."""
    state = [optimizer.state.get(m, {}) for m in masters]
    return {"master_weights": list(masters),
            "exp_avg": [s["exp_avg"] for s in state if "exp_avg" in s],
            "exp_avg_sq": [s["exp_avg_sq"] for s in state if "exp_avg_sq" in s]}


# --- checkpoints: one unit's AdamW state out and in (zerolab.checkpoint) ---------------------
def adam_state(optimizer, master: torch.Tensor, own=None) -> dict[str, torch.Tensor]:
    """{"master", "exp_avg", "exp_avg_sq"} of the fp32 tensor `master` (views, fp32), each
    through `own` (e.g. FlatUnit.own, when `master` is a full replica); zeros before step 1."""
    own = own or (lambda t: t)
    state = optimizer.state.get(master, {})
    zeros = torch.zeros_like(master)
    return {"master": own(master), "exp_avg": own(state.get("exp_avg", zeros)),
            "exp_avg_sq": own(state.get("exp_avg_sq", zeros))}


def set_adam_state(optimizer, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, step: int):
    """Give torch's AdamW the state of `master` after `step` updates, laid out as AdamW itself
    stores it (an fp32 scalar "step", moments shaped like `master`). step 0: no state."""
    optimizer.state.pop(master, None)
    if step > 0:
        optimizer.state[master] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                   "exp_avg": exp_avg.to(master).clone(),
                                   "exp_avg_sq": exp_avg_sq.to(master).clone()}
