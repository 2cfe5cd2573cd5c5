"""Checkpoints of a fully_shard model at one world size, loaded at another: the model and its
optimizer's state as full tensors.

fully_shard's shards are plain tensors (FSDP2's are DTensors), so torch's
`torch.distributed.checkpoint.state_dict` helpers see each rank's rows as if they were the whole
parameter: a checkpoint written with them loads back only at the same world size. Full tensors
load at any world size:

    import torch.distributed.checkpoint as dcp
    state = {"model": model.full_state_dict(), "optim": full_optim_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=folder)              # on every rank; DCP writes each once

    # later, at another world size: a model built, sharded and given an optimizer again
    state = {"model": {k: torch.empty_like(v) for k, v in Net().state_dict().items()},
             "optim": empty_optim_state_dict(model, folder)}
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state["model"])              # full tensors: this rank's rows
    load_full_optim_state_dict(model, opt, state["optim"])

Layout "dim0" (fully_shard's default): rank r holds rows [r * ceil(d0 / N), ...) of every
parameter and of every optimizer state tensor of that parameter's shape.
"""
from __future__ import annotations

import torch


def own_rows(name, t, shard):
    """`t` as `shard` (this rank's piece of a parameter) holds it: this rank's rows when `t` is
    the full tensor (layout "dim0"), `t` itself otherwise (load_state_dict's own checks then
    apply). So a fully_shard model's `load_state_dict(model.full_state_dict())` loads at any
    world size. ValueError (one line) for a full tensor where the layout is "flat"."""
    if not (getattr(shard, "_zerolab_shard", False) and isinstance(t, torch.Tensor)
            and t.shape == shard.__dict__["_zerolab_full_shape"] and t.shape != shard.shape):
        return t
    if shard.__dict__.get("_zerolab_layout") != "dim0":
        raise ValueError(f"load_state_dict got the full {name} {tuple(t.shape)}, and this rank "
                         f"holds a flat piece of it ({tuple(shard.shape)}): load the full state "
                         "dict into the model before fully_shard (rank 0's values are then "
                         "broadcast), or shard with layout='dim0'")
    comm = shard.__dict__["_zerolab_state"].comm
    chunk = -(-t.shape[0] // comm.world_size)
    start = min(comm.rank * chunk, t.shape[0])
    return t[start:start + shard.shape[0]]


def _named_shards(model) -> dict:
    return {name: p for name, p in model.named_parameters()}


def _rows(t, full_rows, comm):
    chunk = -(-full_rows // comm.world_size)
    start = min(comm.rank * chunk, full_rows)
    return start, chunk


def _per_param(opt, model):
    """{parameter name: (shard parameter, its optimizer state dict)} of the shards `opt` steps."""
    names = {id(p): n for n, p in _named_shards(model).items()}
    return {names[id(p)]: (p, opt.state.get(p, {})) for g in opt.param_groups
            for p in g["params"] if id(p) in names}


@torch.no_grad()
def full_optim_state_dict(model, opt) -> dict:
    """{parameter name: {state key: full tensor}} of `opt` (a torch optimizer over a fully_shard
    model's parameters), on every rank: state tensors shaped as a shard are gathered along dim 0
    (one all_gather each, ledger phase "eval", what "optim_state"); scalars (step) as they are.
    A collective: call it on every rank."""
    comm, out = model.comm, {}
    for name, (p, state) in _per_param(opt, model).items():
        full_shape = p.__dict__.get("_zerolab_full_shape", p.shape)
        out[name] = {}
        for key, t in state.items():
            if not (isinstance(t, torch.Tensor) and t.shape == p.shape and p.dim() > 0
                    and tuple(full_shape) != tuple(p.shape)):
                out[name][key] = t.detach().clone() if isinstance(t, torch.Tensor) else t
                continue
            _, chunk = _rows(t, full_shape[0], comm)
            rest = t[0].numel() if t.shape[0] else int(torch.Size(full_shape[1:]).numel())
            local = torch.zeros(chunk * rest, dtype=t.dtype, device=t.device)
            local[:t.numel()] = t.reshape(-1)
            every = torch.empty(comm.world_size * chunk * rest, dtype=t.dtype, device=t.device)
            with comm.phase("eval"):
                comm.all_gather(every, local, what="optim_state", unit=name)
            out[name][key] = every.view(comm.world_size * chunk, *full_shape[1:])[:full_shape[0]]
    return out


def empty_optim_state_dict(model, checkpoint_id, key: str = "optim") -> dict:
    """The target dcp.load fills with the optimizer state saved under `key` in the checkpoint
    folder `checkpoint_id`: {parameter name: {state key: empty tensor}}, shapes and dtypes read
    from the checkpoint's metadata (a fresh optimizer has no state to copy them from)."""
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    names = sorted(_named_shards(model), key=len, reverse=True)
    out: dict = {}
    for flat, md in meta.items():
        if not flat.startswith(key + "."):
            continue
        rest = flat[len(key) + 1:]
        name = next((n for n in names if rest.startswith(n + ".")), None)
        if name is None or not hasattr(md, "size"):
            continue
        out.setdefault(name, {})[rest[len(name) + 1:]] = torch.empty(
            md.size, dtype=md.properties.dtype)
    return out


@torch.no_grad()
def load_full_optim_state_dict(model, opt, full: dict):
    """Load `full` (`full_optim_state_dict`'s, saved at any world size) into `opt`: each state
    tensor of a parameter's full shape gives this rank its rows. KeyError (one line) for a
    parameter `full` lacks."""
    comm = model.comm
    for name, (p, state) in _per_param(opt, model).items():
        if name not in full:
            raise KeyError(f"the optimizer state has no entry for parameter {name}")
        full_shape = p.__dict__.get("_zerolab_full_shape", p.shape)
        new = {}
        for key, t in full[name].items():
            if isinstance(t, torch.Tensor) and p.dim() > 0 and tuple(t.shape) == tuple(
                    full_shape) and tuple(full_shape) != tuple(p.shape):
                start, _ = _rows(t, full_shape[0], comm)
                t = t[start:start + p.shape[0]]
            new[key] = t.clone() if isinstance(t, torch.Tensor) else t
        opt.state[p] = new


def full_tensors(state, module) -> dict[str, torch.Tensor]:
    """{name: full tensor} of a fully_shard model (`state`: its root's): one all_gather of each
    unit's master shard (ledger phase "eval"), the rest as the state_dict holds it."""
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
