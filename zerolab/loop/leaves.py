"""Leaf modules: a group of blocks gathered and reduced as one unit, whatever order they run in.

ZeRO-3 gathers a unit's weights when its block is about to run, and every rank must issue those
all_gathers (and the backward's reduce_scatters) in one order (`zerolab.loop.order`). A mixture of
experts breaks that when each expert is a unit: the router sends each rank's tokens to the
experts in an order (and a number) that depends on the rank's data. Marking the MoE layer a leaf
makes it one unit: its forward gathers every expert's weights at once, the experts run in any
order inside it, and its backward reduces all their gradients together - one collective of each
kind per layer, the same on every rank, at the price of every expert's weights alive while the
layer runs. DeepSpeed's `deepspeed.utils.set_z3_leaf_modules` does the same; with FSDP2's
`fully_shard`, shard the layer and not its experts.

    from zerolab.loop.leaves import set_leaf_modules
    set_leaf_modules(model, [MoELayer])     # before the strategy is built

`sharding.build_units` and `sharding.module_blocks` read the mark.
"""
from __future__ import annotations

import torch

MARK = "_zerolab_leaf"


def set_leaf_modules(model: torch.nn.Module, classes) -> list[str]:
    """Mark every submodule of `model` that is an instance of one of `classes` (a class or a
    list of them) a leaf. Returns the marked modules' names. ValueError (one line) when
    `classes` holds something that is not an nn.Module subclass, or when no submodule matches."""
    classes = tuple(classes) if isinstance(classes, (list, tuple, set)) else (classes,)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, torch.nn.Module)):
            raise ValueError(f"set_leaf_modules: {c!r} is not a torch.nn.Module subclass "
                             "(pass the class of the layer whose blocks run in varying order)")
    names = []
    for name, m in model.named_modules():
        if isinstance(m, classes):
            setattr(m, MARK, True)
            names.append(name)
    if not names:
        raise ValueError(f"set_leaf_modules: no submodule of {type(model).__name__} is a "
                         f"{' or '.join(c.__name__ for c in classes)}")
    return names


def leaves_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """[(name, module)] of `model`'s leaf modules, outermost only, in registration order."""
    out, inside = [], set()
    for name, m in model.named_modules():
        if getattr(m, MARK, False) and id(m) not in inside and m is not model:
            out.append((name, m))
            inside |= {id(s) for s in m.modules()}
    return out


def group_blocks(model: torch.nn.Module, blocks: list) -> list:
    """`blocks` [(name, module)] with every block inside a leaf replaced by the leaf (once, at
    the place of its first block): the leaf's whole subtree becomes one unit."""
    leaves = leaves_of(model)
    if not leaves:
        return list(blocks)
    owner = {id(s): (name, leaf) for name, leaf in leaves for s in leaf.modules()}
    out, seen = [], set()
    for name, m in blocks:
        name, m = owner.get(id(m), (name, m))
        if id(m) not in seen:
            seen.add(id(m))
            out.append((name, m))
    return out


def holders(model: torch.nn.Module, units) -> dict[str, str]:
    """{unit name: class name of the layer that holds its block} - the class to pass to
    set_leaf_modules when those blocks run in a varying order (`zerolab.loop.order`'s advice). A
    container (ModuleList, ModuleDict, Sequential) is looked through to the layer above it."""
    parent = {id(c): m for m in model.modules() for c in m.children()}
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
    out = {}
    for u in units:
        up = parent.get(id(u.modules[0])) if getattr(u, "modules", None) else None
        while isinstance(up, containers) and id(up) in parent:
            up = parent[id(up)]
        if up is not None and up is not model:
            out[u.name] = type(up).__name__
    return out
