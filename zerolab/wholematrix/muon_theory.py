"""Distributed whole-matrix optimizers in numbers: owners, bytes, Newton-Schulz FLOPs, held bytes.

Idea: Muon (Jordan et al. 2024; torch.optim.Muon), Adafactor and LAMB read a parameter's whole
matrix (Muon orthogonalises it, Adafactor factors its second moment by rows and columns, LAMB
scales it by its norm), so ZeRO's flat 1/N ranges cannot step them. Three layouts make a matrix
whole somewhere (zerolab/wholematrix/muon_owner.py, muon_a2a.py, muon_replicate.py); this module gives what
each costs a rank per step, from the parameters' shapes alone (no torch.distributed), so the
ledger of a run can be held to it and `table` can price a 7.5B model on 64 ranks.

Notation: N ranks, b bytes an element (4 for fp32), S = Σ_p s_p with s_p = ⌈R_p/N⌉·(numel_p/R_p)
a parameter's dim-0 shard (R_p rows, padded to a multiple of N rows), L_r the elements whose
owner is rank r, L = max_r L_r.

    layout      collectives a step (per-rank bytes)                      Newton-Schulz on rank r
    owner       reduce_scatter grads (N-1)·L·b + all_gather params (N-1)·L·b    its own matrices
    replicate   reduce_scatter grads (N-1)·S·b + all_gather grads (N-1)·S·b     every matrix
    a2a         reduce_scatter grads (N-1)·S·b, all_to_all to owners
                Σ_{m not r's} s_m·b, all_to_all back (N-1)·Σ_{m r's} s_m·b,
                all_gather params (N-1)·S·b                                     its own matrices

With even owners (L = Ψ/N, S = Ψ/N) owner and replicate move DDP's 2(N-1)/N·Ψ·b, and a2a adds
about 2(N-1)/N·Ψ_muon/N·b to ZeRO-2's (a rank routes only its own shards); an owner holding more
than the mean (L > Ψ/N: one big embedding) pads every rank's piece to its L, so imbalance costs
bytes and memory as well as time.

Owners: greedy by size, as torch's ZeroRedundancyOptimizer (`_partition_parameters`): parameters
largest first (stable), each to the rank holding the fewest elements so far (lowest rank on a
tie); the owner layout places every parameter, the a2a layout only the matrices (the others are
stepped element-wise on dim-0 shards). Newton-Schulz (torch's `_zeropower_via_newtonschulz`,
ns_steps = 5): for an m x n matrix with a = min(m, n), c = max(m, n), each iteration is
X·Xᵀ (2a²c), A·A (2a³) and B·X (2a²c): 4a²c + 2a³ FLOPs (a matmul of m x k by k x n = 2mnk).
"""
from __future__ import annotations

import math

NS_STEPS = 5          # torch.optim.Muon's default ns_steps (DEFAULT_NS_STEPS)
LAYOUTS = ("owner", "a2a", "replicate")
# compose.make_muon's default: at 7.5B on 64 ranks a2a moves 2.4x fewer bytes than owner (no
# padding to the largest owner), computes nothing twice (replicate: 56x the Newton-Schulz),
# and holds the least (`python -m zerolab.course.muontable`)
DEFAULT_LAYOUT = "a2a"


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    return layout


def numel(shape) -> int:
    return math.prod(shape) if len(shape) else 1


def assign_owners(numels, n: int, groups=None) -> list[int]:
    """The owning rank of each parameter (numels: elements of each, in order), greedy by size as
    torch's ZeroRedundancyOptimizer: group by group (groups[i]: parameter i's group, default one
    group), largest first within a group (stable), each to the least-loaded rank so far (the
    lowest on a tie), loads carried from group to group."""
    if n < 1:
        raise ValueError(f"n = {n!r} ranks: needs at least 1")
    groups = list(groups) if groups is not None else [0] * len(numels)
    loads, owners = [0] * n, [0] * len(numels)
    for g in dict.fromkeys(groups):
        members = [i for i, gi in enumerate(groups) if gi == g]
        for i in sorted(members, key=lambda i: -numels[i]):     # stable: ties in order
            r = loads.index(min(loads))
            owners[i], loads[r] = r, loads[r] + numels[i]
    return owners


def loads(numels, owners, n: int) -> list[int]:
    """Elements each rank owns (L_r)."""
    out = [0] * n
    for k, r in zip(numels, owners):
        if r is not None:
            out[r] += k
    return out


def imbalance(values) -> float:
    """max / mean of per-rank values (1.0 = even; nan when all are 0)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else float("nan")


def rows(shape) -> int:
    """Rows of dim 0 (a 0-d parameter counts as one row of one element)."""
    return shape[0] if len(shape) else 1


def shard_numel(shape, n: int) -> int:
    """s_p: elements of one rank's dim-0 shard of a parameter of `shape`, rows padded to a
    multiple of n (⌈R/n⌉ rows of numel/R elements)."""
    r = rows(shape)
    return math.ceil(r / n) * (numel(shape) // r if r else 0)


def own_rows_numel(shape, n: int, rank: int) -> int:
    """Elements of rank `rank`'s real rows of a parameter (its shard without the padding)."""
    R = rows(shape)
    k = math.ceil(R / n)
    return max(0, min((rank + 1) * k, R) - rank * k) * (numel(shape) // R if R else 0)


def ns_flops(shape, steps: int = NS_STEPS) -> int:
    """FLOPs of Newton-Schulz on one m x n matrix: steps·(4a²c + 2a³), a = min, c = max (0 for a
    tensor that is not 2-D: nothing is orthogonalised)."""
    if len(shape) != 2:
        return 0
    a, c = sorted(shape[:2])
    return steps * (4 * a * a * c + 2 * a ** 3)


def owners_of(layout, shapes, whole, n, groups=None):
    """Owner per parameter (None: stepped on shards / by every rank) in `layout`."""
    if layout == "replicate":
        return [None] * len(shapes)
    groups = list(groups) if groups is not None else [0] * len(shapes)
    if layout == "owner":
        return assign_owners([numel(s) for s in shapes], n, groups)
    idx = [i for i, w in enumerate(whole) if w]
    owners = [None] * len(shapes)
    for i, r in zip(idx, assign_owners([numel(shapes[i]) for i in idx], n,
                                       [groups[i] for i in idx])):
        owners[i] = r
    return owners


def layout_costs(layout: str, shapes, whole, n: int, elem_bytes: int = 4,
                 steps: int = NS_STEPS, groups=None) -> list[dict]:
    """Per rank (a list of N dicts) for one step of `layout` over parameters of `shapes`
    (whole[i]: parameter i goes to the whole-matrix optimizer - Muon - the others to the
    element-wise fallback, AdamW): "bytes" {op: per-rank bytes sent}, "ns_flops" (Newton-Schulz
    FLOPs this rank runs), "state_bytes" (Muon's momentum, 1 element a matrix element; AdamW's
    exp_avg and exp_avg_sq, 2, on a2a's real rows of a shard; fp32 at elem_bytes) and
    "buffer_bytes" (what the layout keeps besides: owner the [N·L] flat buffer; replicate the
    [N·S] one; a2a the [N·S] one, the all_to_all's send and receive buffers, the owner's
    direction tensors and the fallback's rows of the weights). groups: parameter group of each (owners are assigned group by
    group). Raises ValueError for an unknown layout."""
    check_layout(layout)
    sizes = [numel(s) for s in shapes]
    owners = owners_of(layout, shapes, whole, n, groups)
    flops = [ns_flops(s, steps) if w else 0 for s, w in zip(shapes, whole)]
    state = [k if w else 2 * k for k, w in zip(sizes, whole)]
    shard = [shard_numel(s, n) for s in shapes]
    S, b = sum(shard), elem_bytes
    out = []
    for r in range(n):
        mine = [i for i, o in enumerate(owners) if o == r]
        if layout == "owner":
            L = max(loads(sizes, owners, n))
            ops = {"reduce_scatter": (n - 1) * L * b, "all_gather": (n - 1) * L * b}
            buffers, st = n * L * b, sum(state[i] for i in mine) * b
            fl = sum(flops[i] for i in mine)
        elif layout == "replicate":
            ops = {"reduce_scatter": (n - 1) * S * b, "all_gather": (n - 1) * S * b}
            buffers, st, fl = n * S * b, sum(state) * b, sum(flops)
        else:
            there = sum(shard[i] for i, o in enumerate(owners) if o is not None and o != r)
            back = (n - 1) * sum(shard[i] for i in mine)
            ops = {"reduce_scatter": (n - 1) * S * b, "all_to_all": (there + back) * b,
                   "all_gather": (n - 1) * S * b}
            muon_shards = sum(shard[i] for i, o in enumerate(owners) if o is not None)
            own_whole = sum(n * shard[i] for i in mine)
            pieces = sum(own_rows_numel(shapes[i], n, r) for i, o in enumerate(owners)
                         if o is None)
            buffers = (n * S + muon_shards + own_whole + sum(sizes[i] for i in mine)
                       + pieces) * b
            st = (sum(state[i] for i in mine) + 2 * pieces) * b
            fl = sum(flops[i] for i in mine)
        out.append({"bytes": ops, "ns_flops": fl, "state_bytes": st, "buffer_bytes": buffers})
    return out


def summary(layout: str, shapes, whole, n: int, elem_bytes: int = 4) -> dict:
    """One row of the trade-off table: the busiest rank's bytes a step, its Newton-Schulz FLOPs,
    the redundant FLOPs (all ranks' minus one copy of every matrix's), imbalance (max/mean of
    FLOPs), held bytes (state + buffers, the largest rank's)."""
    per = layout_costs(layout, shapes, whole, n, elem_bytes)
    total = sum(ns_flops(s) for s, w in zip(shapes, whole) if w)
    fl = [p["ns_flops"] for p in per]
    return {"layout": layout, "n": n,
            "bytes": max(sum(p["bytes"].values()) for p in per),
            "ns_flops": max(fl), "redundant_flops": sum(fl) - total,
            "imbalance": imbalance(fl),
            "held_bytes": max(p["state_bytes"] + p["buffer_bytes"] for p in per)}
