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
for a whole forward (or backward) pass, like FSDP's root module. With a bucket cap (`bucket_mb`
of DDP / ZeRO-1 / ZeRO-2, torch DDP's bucket_cap_mb) consecutive blocks share one unit, named
"block.0-2": one collective per bucket instead of one per block (`theory.bucket_groups`).
"""
from __future__ import annotations

import math

import torch

from . import theory
from .loop import guards
from .loop.leaves import group_blocks
from .loop.hooks import (GradReady, on_grads_ready, on_post_backward,  # noqa: F401 - re-exported:
                    on_pre_backward)                                # the strategies' hooks

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
    module: the unit's block (None: the root unit), or a list of blocks in forward order (a
    bucket of several). Attributes: modules (that list; [] for the root), module (the last
    block in forward order: its backward runs first, so its pre-backward hook is where the
    unit's backward begins), numel (Ψ_u), padded_numel (multiple of world_size), shard_numel
    (= padded/N), start (first element of this rank's range), offsets (element offset of each
    param).
    """

    def __init__(self, name: str, params: list, world_size: int, rank: int, module=None,
                 names=None, layout: str = "flat"):
        self.modules = (list(module) if isinstance(module, (list, tuple))
                        else [] if module is None else [module])
        self.name, self.params, self.module = name, list(params), (self.modules or [None])[-1]
        self.names = list(names) if names is not None else [f"{name}[{i}]" for i in range(len(params))]
        self.decay = [decays(p) for p in self.params]      # parameter groups (zerolab.optim)
        self.used = [False] * len(self.params)  # got a gradient in some micro-step of this step
        self.numel = sum(p.numel() for p in self.params)
        if layout not in ("flat", "dim0"):
            raise ValueError(f"layout {layout!r} is not one of 'flat', 'dim0'")
        self.layout, self.world_size, self.rank = layout, world_size, rank
        self.offsets, offset = [], 0
        self.shapes = [p.shape for p in self.params]   # kept: ZeRO-3 empties params at rest
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        if layout == "flat":
            self.start, stop = shard_range(max(self.numel, 1), world_size, rank)
            self.shard_numel = stop - self.start
        else:                   # each parameter's rows split N ways, padded to equal row counts
            self.rows = [s[0] if len(s) else 1 for s in self.shapes]
            self.cols = [s.numel() // r if r else 0 for s, r in zip(self.shapes, self.rows)]
            self.row_shard = [math.ceil(r / world_size) for r in self.rows]
            self.packed_offsets, off = [], 0
            for rs, c in zip(self.row_shard, self.cols):
                self.packed_offsets.append(off)
                off += rs * c
            self.shard_numel = max(off, 1)
            self.start = rank * self.shard_numel
        self.padded_numel = self.shard_numel * world_size
        self.swap = []              # fully_shard: (module, attr, full param, shard param)
        self.shard_params = None    # fully_shard: the loop's nn.Parameter per parameter
        self.unsharded = None       # dim0 while gathered: the parameters' own (natural) buffer
        # filled by the strategies
        self.param_flat = self.param_shard = self.grad_flat = self.grad_shard = None
        self.master = None
        self.bucket = None          # transient full-gradient buffer (ZeRO-2/3)
        self.grad_views = None      # set by bind_grads when the buffer's dtype is not the params'
        self.rs_out = None          # a reduce_scatter's output while in flight (ZeRO-2/3)
        self.packed_grad = None     # layout "dim0": the packed bucket while in flight
        self._views, self._messages = {}, {}    # made once (`views`, `messages`)

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
        """Views of `flat` [padded_numel] shaped like each parameter (no copy). The views of
        the unit's own resident buffers (param_flat, grad_flat, unsharded) are made once: they
        hold no memory of their own, and those buffers live as long as the unit."""
        role = next((k for k, t in (("param", self.param_flat), ("grad", self.grad_flat),
                                    ("unsharded", self.unsharded)) if t is flat), None)
        made = self._views.get(role)
        if made is not None and made[0] is flat:
            return made[1]
        views = [flat[off:off + shape.numel()].view(shape)
                 for shape, off in zip(self.shapes, self.offsets)]
        if role is not None:
            self._views[role] = (flat, views)
        return views

    def messages(self, why: str, form: str = "{name}: {why}") -> list[str]:
        """`form` for each parameter of the unit (its name, `why`), made once per (form, why):
        what a placeholder says when it is read (`guards.shard_params`, `guards.shard_grads`)."""
        key = (form, why)
        if key not in self._messages:
            self._messages[key] = [form.format(name=n, why=why) for n in self.names]
        return self._messages[key]

    def bind_params(self, flat: torch.Tensor):
        """Make every parameter's data a view of `flat`, so writes to `flat` update the model.
        layout "dim0": `flat` is the gathered rank-major buffer; its rows are copied out into
        the parameters' own buffer `unsharded` (FSDP2's copy-out) and `flat` is freed."""
        if self.layout == "dim0":
            if self.unsharded is None:
                self.unsharded = torch.empty_like(flat)
            alloc_storage(self.unsharded)
            self.unpack(flat, self.unsharded)
            free_storage(flat)
            flat = self.unsharded
        for p, view in zip(self.params, self.views(flat)):
            guards.unshard_param(p, view)
        for module, attr, full, _ in self.swap:     # the module computes with the full params
            module._parameters[attr] = full

    def bind_grads(self, flat: torch.Tensor):
        """Make every parameter's .grad a view of `flat`: autograd accumulates straight into it.
        When `flat` has another dtype than the parameters (fp32 gradients of bf16 weights,
        `--grad-dtype fp32`), autograd cannot accumulate into it: each parameter's gradient is
        added into its view by the post-accumulate-grad hook instead (GradReady), Megatron's
        `main_grad`."""
        if self.params and flat.dtype != self.params[0].dtype:
            self.grad_views = self.views(flat)
            for p in self.params:
                p.grad = None
            return
        self.grad_views = None
        for p, view in zip(self.params, self.views(flat)):
            p.grad = view

    def unbind_params(self, why: str):
        """Make every parameter a placeholder (ZeRO-3 outside a gather: `guards.shard_params`):
        full shape, dtype and device, no memory, never a view of freed storage; reading or
        changing its values raises `guards.ShardedValues` with `why` and the parameter's name."""
        guards.shard_params(self.params, self.shapes, self.messages(why))
        if self.unsharded is not None:
            free_storage(self.unsharded)
        for module, attr, _, shard in self.swap:    # the loop sees this rank's shards again
            module._parameters[attr] = shard

    # --- layout "dim0" (FSDP2's): rank r holds rows [r*R_i, (r+1)*R_i) of every parameter i ----
    def _row_copies(self):
        # (packed start, natural start, numel) of every piece: parameter i's rows on rank r
        for i, (rs, c, rows, off) in enumerate(zip(self.row_shard, self.cols, self.rows,
                                                   self.offsets)):
            for r in range(self.world_size):
                real = min(max(rows - r * rs, 0), rs)
                if real:
                    yield r, r * self.shard_numel + self.packed_offsets[i], off + r * rs * c, real * c

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        """Natural [padded_numel] (parameters end to end) -> the rank-major buffer the
        collectives use: `flat` itself in layout "flat"; a new buffer (rank r's rows of every
        parameter together, padding rows zero: FSDP2's copy-in) in layout "dim0"."""
        if self.layout == "flat":
            return flat
        out = torch.zeros_like(flat)
        for _, dst, src, k in self._row_copies():
            out[dst:dst + k].copy_(flat[src:src + k])
        return out

    def unpack(self, packed: torch.Tensor, out: torch.Tensor):
        """The inverse of `pack`: copy the rank-major `packed` into natural `out`."""
        for _, src, dst, k in self._row_copies():
            out[dst:dst + k].copy_(packed[src:src + k])

    def shard_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Views of a [shard_numel] buffer shaped like each parameter's piece (`shard_shapes`)."""
        return [shard[lo:max(lo, hi)].view(shape)
                for (lo, hi), shape in zip(self.segments(sharded=True), self.shard_shapes())]

    def shard_shapes(self) -> list[tuple]:
        """Shape of each parameter's piece in this rank's shard: rows x the rest (layout "dim0",
        FSDP2's local shard; the last ranks may hold fewer rows, or none), or 1-D (layout
        "flat", the piece of the flat range; FSDP1's use_orig_params views)."""
        if self.layout == "flat":
            return [(max(hi - lo, 0),) for lo, hi in self.segments(sharded=True)]
        return [(min(max(rows - self.rank * rs, 0), rs), *shape[1:])
                for rows, rs, shape in zip(self.rows, self.row_shard, self.shapes)]

    def segments(self, sharded: bool) -> list[tuple[int, int]]:
        """(lo, hi) of each parameter inside this rank's master buffer: the whole flat buffer
        (sharded=False, DDP) or this rank's range of it (hi <= lo: not in this shard)."""
        if sharded and self.layout == "dim0":
            return [(o, o + math.prod(s)) for o, s in zip(self.packed_offsets, self.shard_shapes())]
        base, size = (self.start, self.shard_numel) if sharded else (0, self.padded_numel)
        return [(min(max(off - base, 0), size), min(max(off + shape.numel() - base, 0), size))
                for shape, off in zip(self.shapes, self.offsets)]

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous range of `flat` [padded_numel] -> view [shard_numel].
        Layout "dim0": this rank's rows of a natural `flat`, packed (a copy)."""
        if self.layout == "dim0":
            out = torch.zeros(self.shard_numel, dtype=flat.dtype, device=flat.device)
            for r, dst, src, k in self._row_copies():
                if r == self.rank:
                    out[dst - self.start:dst - self.start + k].copy_(flat[src:src + k])
            return out
        return flat[self.start:self.start + self.shard_numel]

    def padding_in_shard(self) -> int:
        """Padding elements inside this rank's range (layout "flat": only the last ranks hold
        any; "dim0": every parameter whose rows do not split evenly pads the last ranks)."""
        if self.layout == "dim0":
            return self.shard_numel - sum(math.prod(s) for s in self.shard_shapes())
        end = self.start + self.shard_numel
        return max(0, end - max(self.start, self.numel))


def build_units(model: torch.nn.Module, world_size: int, rank: int,
                bucket_numel: int | None = None, blocks=None, layout: str = "flat") -> list[FlatUnit]:
    """Split `model`'s trainable parameters into FlatUnits: the root unit first, then one per
    block in forward order. Blocks: `blocks` (a list of (name, module)), else
    `model.zero_units()`, else none (one root unit); `module_blocks(model)` finds them in any
    model's own structure. A parameter belongs to the innermost block that holds it (FSDP2's
    rule for nested fully_shard); one held by two blocks neither inside the other (a tied
    embedding and head) goes to the root unit. Frozen parameters are left out (they stay
    replicated and untouched). Tied parameters appear once.
    bucket_numel: merge consecutive blocks into one unit while it holds <= bucket_numel
    elements (a larger block stays alone; the root is never merged; `theory.bucket_groups`),
    named "block.0-2"; None: one unit per block. layout: "flat" or "dim0" (`FlatUnit`)."""
    if blocks is None:
        blocks = list(model.zero_units()) if hasattr(model, "zero_units") else []
    named_units = group_blocks(model, blocks)           # a leaf module: one unit (leaves.py)
    inner = {name: {id(m) for m in module.modules()} for name, module in named_units}
    owners: dict[int, list[str]] = {}
    for name, module in named_units:
        for p in module.parameters():
            owners.setdefault(id(p), []).append(name)
    modules = dict(named_units)
    for key, names in owners.items():   # innermost wins: drop owners that contain another one
        owners[key] = [a for a in names if not any(
            b != a and id(modules[b]) in inner[a] for b in names)]
    seen, root, per_unit = set(), [], {name: [] for name, _ in named_units}
    for pname, p in model.named_parameters():   # deduplicated: a tied weight appears once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        names = owners.get(id(p), [])
        (per_unit[names[0]] if len(names) == 1 else root).append((pname, p))
    units = [FlatUnit(ROOT, [p for _, p in root], world_size, rank,
                      names=[n for n, _ in root], layout=layout)] if root else []
    blocks = [(name, module) for name, module in named_units if per_unit[name]]
    numels = [sum(p.numel() for _, p in per_unit[name]) for name, _ in blocks]
    for idx in theory.bucket_groups(numels, bucket_numel):
        group = [blocks[i] for i in idx]
        named = [pair for name, _ in group for pair in per_unit[name]]
        units.append(FlatUnit(theory.bucket_name([name for name, _ in group]),
                              [p for _, p in named], world_size, rank,
                              [m for _, m in group] if len(group) > 1 else group[0][1],
                              names=[n for n, _ in named], layout=layout))
    return units


def module_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Blocks read from any model's own structure, for `build_units` when it has no
    `zero_units()`: every submodule that directly holds a trainable parameter (a Linear, an
    Embedding, a LayerNorm, ...), in registration order - the order of `model.parameters()`,
    which torch DDP also takes as the forward order for its buckets."""
    return group_blocks(model, [
        (name, m) for name, m in model.named_modules()
        if m is not model and any(p.requires_grad for p in m.parameters(recurse=False))])


def bucket_numel(bucket_mb: float | None, model: torch.nn.Module, grad_dtype=None) -> int | None:
    """Gradient elements in a bucket of `bucket_mb` MiB (2**20 bytes: torch DDP's bucket_cap_mb
    unit) for `build_units`: gradients are `grad_dtype` (default: `model`'s parameters' dtype),
    so 1 MiB holds 262,144 fp32 or 524,288 bf16 gradients. None stays None (one bucket per
    block). Raises ValueError (one line) unless bucket_mb is a finite number > 0."""
    if bucket_mb is None:
        return None
    mb = theory.check_finite("bucket_mb", bucket_mb, positive=True)
    dtype = grad_dtype or next(iter(model.parameters())).dtype
    return max(1, int(mb * theory.MIB // torch.empty(0, dtype=dtype).element_size()))


def decays(p: torch.Tensor) -> bool:
    """The GPT-2 / nanoGPT parameter groups: weight decay for 2-D (and larger) weights -
    matmul weights and embeddings - none for biases and LayerNorm weights (1-D)."""
    return p.dim() >= 2


def check_trainable(model: torch.nn.Module, units: list[FlatUnit]):
    """Raise RuntimeError naming a parameter that requires grad but has no flat buffer: it was
    frozen when the strategy was built, so no strategy would ever update it (torch would)."""
    known = {id(p) for u in units for p in (*u.params, *(u.shard_params or ()))}
    for name, p in model.named_parameters():        # (fully_shard's ignored_params: the loop's)
        if p.requires_grad and id(p) not in known and not getattr(p, "_zerolab_ignored", False):
            raise RuntimeError(f"parameter {name} requires grad but was frozen when the strategy "
                               "was built; set requires_grad before building the strategy")


def check_all_used(units: list[FlatUnit], rank: int):
    """Raise RuntimeError (one line) naming the parameters that got no gradient in this step:
    without find_unused_parameters a strategy cannot tell whether another rank gave them one."""
    unused = [name for u in units for name, used in zip(u.names, u.used) if not used]
    if unused:
        raise RuntimeError(
            f"parameter(s) {', '.join(unused)} got no gradient in this step on rank {rank} "
            "(unused in forward, a branch not taken, or requires_grad turned off after the "
            "strategy was built); pass find_unused_parameters=True (--find-unused-parameters)")


def global_used(units: list[FlatUnit], comm) -> list[list[bool]]:
    """Which parameters got a gradient on *any* rank in this step: one all_reduce of a flag per
    parameter (torch DDP's `local_used_map`, find_unused_parameters=True). A parameter no rank
    used has no gradient in the single-process reference, and torch's AdamW skips it."""
    flags = torch.tensor([float(x) for u in units for x in u.used],
                         device=units[0].params[0].device if units else "cpu")
    comm.all_reduce(flags, what="metric", unit="used_params")
    out, i = [], 0
    for u in units:
        out.append([bool(f > 0) for f in flags[i:i + len(u.params)]])
        i += len(u.params)
    return out


def fp32_grads(units: list[FlatUnit], grads: list[torch.Tensor]):
    """Set each unit's `master.grad` to its gradient range in the master's dtype (fp32; bf16: optim's
    "bf16-master"): a view when the dtypes agree, else a copy (zerolab.memory's "grad_fp32")."""
    for u, g in zip(units, grads):
        u.master.grad = g.to(u.master.dtype)            # [numel of master] fp32 (a bf16 master: bf16)


def grad_copies(units: list[FlatUnit]) -> list[torch.Tensor]:
    """The fp32 gradient copies alive now (not the views that alias a gradient buffer)."""
    bufs = {t.untyped_storage().data_ptr() for u in units
            for t in (u.grad_flat, u.grad_shard, u.bucket) if t is not None}
    return [u.master.grad for u in units if u.master is not None and u.master.grad is not None
            and u.master.grad.untyped_storage().data_ptr() not in bufs]


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
def make_optimizer(params: list[torch.Tensor], lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                   weight_decay=0.1) -> torch.optim.AdamW:
    """torch's AdamW over per-parameter tensors (the references, FSDP2, the notebooks), with the
    GPT-2 / nanoGPT groups the strategies use (`decays`: 2-D weights decayed, biases and
    LayerNorm weights not). The strategies' flat buffers use zerolab.optim.FlatAdamW instead.
    exp_avg / exp_avg_sq appear in optimizer.state."""
    groups = [{"params": [p for p in params if decays(p) == d], "weight_decay": weight_decay * d}
              for d in (True, False)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay)


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


def write_back(strategy, modifier_rank: int, sharded: bool):
    """After a `gathered(modifier_rank=r)` block: broadcast rank r's full weights of every unit
    and write this rank's part of them into its master weights (and, ZeRO-3, its bf16 shard).
    Only elements that changed reach the fp32 master (untouched ones keep their low bits)."""
    with strategy.comm.phase("eval"):
        for u in strategy.units:
            guards.take_replaced(u, u.param_flat)           # `p.data = t` in the block counts
            strategy.comm.broadcast(u.param_flat, modifier_rank, what="params", unit=u.name)
    keep_own_range(strategy, sharded)


def keep_own_range(strategy, sharded: bool):
    """Write this rank's part of every unit's full weights `param_flat` (changed inside
    `gathered()`) into its master weights (only elements that changed: untouched ones keep their
    low fp32 bits) and, ZeRO-3, its bf16 shard."""
    for u in strategy.units:
        own = u.own(u.param_flat) if sharded else u.param_flat
        guards.take_changed(u.master, own)
        if u.param_shard is not None:
            u.param_shard.copy_(own)
