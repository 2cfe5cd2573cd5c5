"""One collective's time on a network: α-β rings (and NCCL's tree) on one link, or on two tiers.

Idea: a ring collective on n ranks takes a latency α per ring step plus its per-rank ring bytes
over the link bandwidth β (nccl-tests, scaling-book; `collective_time`):

    all_reduce              2(n-1)·α + 2(n-1)/n · S/β
    reduce_scatter          (n-1)·α  +  (n-1)/n · S/β        S = the full (unsharded) array, bytes
    all_gather              (n-1)·α  +  (n-1)/n · S/β        α in seconds, β in bytes/s per rank
    broadcast (pipelined)   (n-1)·α  +            S/β

(and NCCL's tree all_reduce, 2·⌈log2 n⌉·α + 2·S/β: costmodel's docstring says when).

Two tiers (a `hardware.Topology`: nodes of k ranks, an intra link inside a node, an inter link
between nodes, each rank its own share of both). A collective is timed by the tiers its group's
ring crosses: inside one node, the formulas above on the intra link; through several nodes the
ring runs in lock-step and each step waits for its slowest hop, so a flat ring pays the slow tier
on every step (`flat_leg`):

    flat all_reduce over n ranks on m > 1 nodes    2(n-1) · (α_inter + S/(n·β_inter))

A hierarchical all_reduce pays each tier for its own part (`hierarchical_all_reduce`; k ranks
per node, m nodes):

    reduce_scatter inside the node      (k-1) · (α_intra + S/(k·β_intra))
    all_reduce of S/k across nodes      2(m-1) · (α_inter + S/(k·m·β_inter))
    all_gather inside the node          (k-1) · (α_intra + S/(k·β_intra))

so the slow tier carries 2(m-1)/m · S/k per rank instead of 2(n-1)/n · S. `tier_bytes` says how
many bytes a rank sends over each tier. In a replayed step each tier's link serves its legs in
issue order (`Clocks`, as `linkemu.TieredLinkEmulator` does); a flat ring through several nodes
keeps both busy.

Times are seconds, sizes bytes. `costmodel` re-exports everything here and replays a step with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import theory
from .hardware import TIERS, Link, Topology

OPS = tuple(theory.RING_FACTOR)
ALGORITHMS = ("ring", "tree", "auto")      # how an all_reduce is modelled (`collective_time`)


# --- one collective on one link ---------------------------------------------------------------
def ring_steps(op: str, n: int) -> int:
    """Latency-bound steps of the ring: 2(n-1) for all_reduce, n-1 for the others."""
    if op not in theory.RING_FACTOR:
        raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}")
    return (2 if op == "all_reduce" else 1) * (theory.check_world_size(n) - 1)


def tree_steps(n: int) -> int:
    """Latency-bound steps of a binary-tree all_reduce: 2·⌈log2 n⌉ (reduce up, broadcast down)."""
    return 2 * math.ceil(math.log2(theory.check_world_size(n)))


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return algorithm


def collective_time(op: str, size_bytes: float, n: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds for `op` of the full array S = size_bytes on n ranks: steps·α + bytes/β.

    algorithm "ring": 2(n-1)·α + 2(n-1)/n · S/β for all_reduce, (n-1)·α + (n-1)/n · S/β for
    reduce_scatter and all_gather. "tree" (all_reduce only; the others stay ring, as in NCCL):
    2·⌈log2 n⌉·α + 2·S/β. "auto": the cheaper of the two, as NCCL's tuner picks per call.
    0 for n = 1 (nothing moves). Raises ValueError for an unknown op or algorithm, or a bad n.
    Source: nccl-tests PERFORMANCE.md (ring bytes), scaling-book (α-β model), NVIDIA/nccl#457
    (a tree all_reduce sends 2S per rank).
    """
    steps = ring_steps(op, n)
    check_algorithm(algorithm)
    if n == 1:
        return 0.0
    ring = steps * link.latency + theory.RING_FACTOR[op](n) * size_bytes / link.bandwidth
    if op != "all_reduce" or algorithm == "ring":
        return ring
    tree = tree_steps(n) * link.latency + 2 * size_bytes / link.bandwidth
    return tree if algorithm == "tree" else min(ring, tree)


# --- two tiers: ranks in nodes (hardware.Topology) --------------------------------------------
@dataclass(frozen=True)
class Leg:
    """One part of a collective that runs on one tier: `op` of `size_bytes` (its full array S)
    on `n` ranks, `seconds` long, paid at `tier`'s link; `uses`: the tiers whose links it keeps
    busy (a flat ring through several nodes: both)."""
    op: str
    tier: str
    n: int
    size_bytes: float
    seconds: float
    uses: tuple = ()


def flat_leg(op: str, size_bytes: float, ranks, topology: Topology, algorithm: str = "ring") -> Leg:
    """A collective on the group `ranks` (global ranks in ring order, n of them) as one ring.

    Inside one node every hop is intra: the one-tier time on the intra link. A ring through
    several nodes has hops of both tiers and runs in lock-step, so each of its steps waits for its
    slowest hop: for a ring all_reduce 2(n-1)·max_l(α_l + S/(n·β_l)), the longer of its one-tier
    times on the two links - the inter link's, 2(n-1)·(α_inter + S/(n·β_inter)), for every
    profile pair of hardware.py. The leg is paid at that tier and keeps both links busy. A group
    with one rank per node has inter hops only. algorithm: as `collective_time`."""
    ranks = list(ranks)
    n, hops = len(ranks), topology.hop_tiers(ranks)
    times = {t: collective_time(op, size_bytes, n, topology.link(t), algorithm) for t in hops}
    tier = max(reversed(hops), key=times.get) if hops else "intra"     # a tie: inter
    return Leg(op, tier, n, size_bytes, times.get(tier, 0.0), hops)


def hierarchical_all_reduce(size_bytes: float, ranks, topology: Topology,
                            algorithm: str = "ring") -> list[Leg]:
    """An all_reduce of S bytes over `ranks` in three legs, each on its own tier:

        reduce_scatter inside each node     (g-1)·α_intra + (g-1)/g · S/β_intra
        all_reduce of S/g across nodes      2(m-1)·α_inter + 2(m-1)/m · (S/g)/β_inter
        all_gather inside each node         (g-1)·α_intra + (g-1)/g · S/β_intra

    g: the group's ranks per node, m: its nodes. The g chunks cross nodes in parallel, each over
    its own rank's share of the inter link, so the slow tier carries S/g per rank instead of S.
    One node (m = 1) or one rank per node (g = 1): the single flat leg. algorithm: how the
    inter-node all_reduce is modelled (`collective_time`). ValueError unless every node of the
    group holds the same number of its ranks."""
    ranks = list(ranks)
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[topology.node(r)] = per_node.get(topology.node(r), 0) + 1
    g, m = (per_node[min(per_node)] if per_node else 1), len(per_node)
    if any(c != g for c in per_node.values()):
        raise ValueError(f"a hierarchical all_reduce needs the same number of ranks in every node; "
                         f"ranks {ranks} hold {sorted(per_node.values())} per node")
    if m <= 1 or g == 1:
        return [flat_leg("all_reduce", size_bytes, ranks, topology, algorithm)]
    intra, inter = topology.intra, topology.inter
    inside = collective_time("reduce_scatter", size_bytes, g, intra)
    return [Leg("reduce_scatter", "intra", g, size_bytes, inside, ("intra",)),
            Leg("all_reduce", "inter", m, size_bytes / g,
                collective_time("all_reduce", size_bytes / g, m, inter, algorithm), ("inter",)),
            Leg("all_gather", "intra", g, size_bytes, inside, ("intra",))]


def legs(op: str, size_bytes: float, n: int, network: Link | Topology, algorithm: str = "ring",
         hierarchical: bool = False) -> list[Leg]:
    """A collective of S = size_bytes on the first n ranks of `network`, as legs: one Link, one
    leg on it (tier "link", the one-tier `collective_time`); a Topology, `flat_leg` - or, for an
    all_reduce with `hierarchical`, `hierarchical_all_reduce`."""
    if isinstance(network, Topology):
        if hierarchical and op == "all_reduce":
            return hierarchical_all_reduce(size_bytes, range(n), network, algorithm)
        ring_steps(op, n)                       # ValueError for an unknown op or a bad n
        return [flat_leg(op, size_bytes, range(n), network, algorithm)]
    return [Leg(op, "link", n, size_bytes, collective_time(op, size_bytes, n, network, algorithm),
                ("link",))]


def flat_link(network: Link | Topology, n: int) -> Link:
    """The link a flat ring on the first n ranks is bandwidth-bound by: the Link itself, or the
    slower (smaller β) of the tiers the ring has hops on."""
    if not isinstance(network, Topology):
        return network
    hops = network.hop_tiers(range(n)) or ("intra",)
    return min((network.link(t) for t in hops), key=lambda link: link.bandwidth)


def tier_bytes(op: str, size_bytes: float, ranks, topology: Topology, rank: int | None = None,
               hierarchical: bool = False) -> dict[str, float]:
    """Bytes a rank sends over each tier for `op` of S = size_bytes on the group `ranks` (global
    ranks in ring order): {"intra": bytes, "inter": bytes}, ring bytes as the ledger counts them
    (`theory.RING_FACTOR`: 2(n-1)/n·S for all_reduce, (n-1)/n·S for reduce_scatter / all_gather,
    S for broadcast).

    Flat ring: a rank sends all its ring bytes to its successor, so they go on the tier of that
    one hop: intra for most ranks, inter for the last rank of each node in the group. rank: a
    global rank of the group; None: the mean over the group's ranks (inter: hops crossing nodes
    / n of the ring bytes). hierarchical (all_reduce only): every rank sends 2(g-1)/g·S inside
    its node and 2(m-1)/m·S/g across nodes (`hierarchical_all_reduce`). ValueError for an op
    other than all_reduce with hierarchical, or a rank outside the group."""
    ranks = list(ranks)
    n = len(ranks)
    out = {t: 0.0 for t in TIERS}
    if hierarchical:
        if op != "all_reduce":
            raise ValueError(f"hierarchical is an all_reduce, not {op!r}")
        for leg in hierarchical_all_reduce(size_bytes, ranks, topology):
            out[leg.tier] += theory.RING_FACTOR[leg.op](leg.n) * leg.size_bytes
        return out
    ring = theory.RING_FACTOR[op](theory.check_world_size(n)) * size_bytes if n > 1 else 0.0
    nxt = dict(zip(ranks, ranks[1:] + ranks[:1]))
    if rank is not None and rank not in nxt:
        raise ValueError(f"rank {rank} is not in the group {ranks}")
    senders = [rank] if rank is not None else ranks
    for r in senders:
        if n > 1:
            tier = "inter" if topology.node(r) != topology.node(nxt[r]) else "intra"
            out[tier] += ring / len(senders)
    return out


class Clocks:
    """When each tier's link is next free (seconds): a collective's legs run one after another,
    each once every link it uses is free; collectives queue per tier in the order they are placed."""

    def __init__(self):
        self.free: dict[str, float] = {}

    def place(self, legs: list[Leg], now: float) -> tuple[float, float]:
        """Put `legs` on their links from time `now` (seconds) on; return (start of the first,
        end of the last)."""
        t, first = now, None
        for leg in legs:
            t = max([t] + [self.free.get(u, 0.0) for u in leg.uses])
            first = t if first is None else first
            t += leg.seconds
            for u in leg.uses:
                self.free[u] = t
        return (now if first is None else first), t
