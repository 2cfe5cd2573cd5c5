"""One collective's time on a network: α-β rings (and NCCL's tree) on one link, or on two tiers.

Idea: a ring collective on n ranks takes a latency α per ring step plus its per-rank ring bytes
over the link bandwidth β (nccl-tests, scaling-book; `collective_time`):

    all_reduce              2(n-1)·α + 2(n-1)/n · S/β
    reduce_scatter          (n-1)·α  +  (n-1)/n · S/β        S = the full (unsharded) array, bytes
    all_gather              (n-1)·α  +  (n-1)/n · S/β        α in seconds, β in bytes/s per rank
    broadcast (pipelined)   (n-1)·α  +            S/β

(and NCCL's tree all_reduce, 2·⌈log2 n⌉·α + 2·S/β: costmodel's docstring says when).

Two tiers (a `hardware.Topology`: nodes of k ranks, an intra link per GPU inside a node, c
NICs per node on the inter link between nodes; default c = k, one NIC per GPU as on HGX / DGX
nodes). A collective is timed by the tiers its group crosses. Inside one node: the formulas
above on the intra link. Through several nodes NCCL runs one ring per NIC, each leaving a node
through its own NIC, so a GPU puts 1/k of its ring bytes on a NIC and (k-1)/k on NVLink and the
ring is as fast as the node's NICs together (`flat_leg`; NVIDIA/nccl#569, NVIDIA/nccl#687,
NVIDIA/nccl#412):

    flat all_reduce over n ranks in m nodes, k per node, c = k NICs
        2(m-1)·α_inter + 2(n-m)·α_intra + 2(n-1)/n · S · max(1/(k·β_nic), (k-1)/(k·β_intra))

The latency is NCCL's own tuning model (src/graph/tuning.cc, `ncclTopoTuneModel`: a ring's
nsteps - nInterSteps steps at the intra-node latency, nInterSteps at the network's): of a ring
all_reduce's 2(n-1) steps only the 2(m-1) that cross nodes pay α_inter, the other 2(n-m) pay
α_intra; a reduce_scatter or all_gather pays (m-1)·α_inter + (n-m)·α_intra (`ring_latency`).
(Newer NCCL versions count 2m crossing steps for an all_reduce, one more hop a pass.) With one
NIC per node (c = 1) the bandwidth term is the one-tier ring's on the NIC, 2(n-1)/n · S/β_nic:
the single-NIC case. A hierarchical all_reduce pays each tier for its own part
(`hierarchical_all_reduce`; k ranks per node, m nodes, each rank's own NIC share):

    reduce_scatter inside the node      (k-1) · (α_intra + S/(k·β_intra))
    all_reduce of S/k across nodes      2(m-1) · (α_inter + S/(k·m·β_nic))
    all_gather inside the node          (k-1) · (α_intra + S/(k·β_intra))

so a NIC carries 2(m-1)/m · S/k instead of a flat ring's 2(n-1)/n · S/k - hardly fewer bytes;
what it changes is the latency inside the node: both pay 2(m-1) steps at α_inter, but the
hierarchy 2(k-1) at α_intra where the flat ring pays 2(n-m). NCCL's own tree
all_reduce is hierarchical too (chains inside a node, a tree across nodes: `flat_leg` with
algorithm "tree"). `tier_bytes` says how many bytes a rank sends over each tier. In a replayed
step each tier's link serves its legs in issue order (`Clocks`, as `linkemu.TieredLinkEmulator`
does); a flat ring through several nodes keeps both busy.

Times are seconds, sizes bytes. `costmodel` re-exports everything here and replays a step with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import theory
from .hardware import TIERS, Link, Topology

OPS = tuple(op for op in theory.RING_FACTOR if op != "all_to_all")   # the course's four (all_to_all
                                                                   # is timed too: muon_a2a)
ALGORITHMS = ("ring", "tree", "auto")      # how an all_reduce is modelled (`collective_time`)


# --- one collective on one link ---------------------------------------------------------------
def ring_steps(op: str, n: int) -> int:
    """Latency-bound steps of the ring: 2(n-1) for all_reduce, n-1 for the others."""
    if op not in theory.RING_FACTOR:
        raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}")
    return (2 if op == "all_reduce" else 1) * (theory.check_world_size(n) - 1)


def inter_steps(op: str, nodes: int) -> int:
    """The steps of a ring through `nodes` nodes that cross a node boundary, as NCCL's tuning
    model counts them (src/graph/tuning.cc, nInterSteps): 2(m-1) for all_reduce, m-1 for the
    others. all_to_all, which NCCL's ring model does not cover, counts every one of its n-1 steps
    as crossing (`ring_latency`)."""
    return (2 if op == "all_reduce" else 1) * (nodes - 1)


def ring_latency(op: str, n: int, network: Link | Topology) -> float:
    """Seconds of latency of a flat ring `op` on the first n ranks of `network`.

    One Link: ring_steps·α (every step on that link). A Topology: inside one node, ring_steps·α_intra;
    through m nodes, NCCL's tuning model (src/graph/tuning.cc, `ncclTopoTuneModel`): the
    `inter_steps` that cross nodes at α_inter, the rest at α_intra -
    2(m-1)·α_inter + 2(n-m)·α_intra for an all_reduce, (m-1)·α_inter + (n-m)·α_intra for a
    reduce_scatter or all_gather. all_to_all pays α_inter on each of its n-1 steps."""
    steps = ring_steps(op, n)
    if not isinstance(network, Topology):
        return steps * network.latency
    per_node = _per_node(range(n), network)
    return _latency(op, steps, len(per_node), network)


def _latency(op: str, steps: int, nodes: int, topology: Topology) -> float:
    if nodes <= 1:
        return steps * topology.intra.latency
    cross = steps if op == "all_to_all" else inter_steps(op, nodes)
    return cross * topology.inter.latency + (steps - cross) * topology.intra.latency


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


def _per_node(ranks, topology: Topology) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in ranks:
        counts[topology.node(r)] = counts.get(topology.node(r), 0) + 1
    return counts


def nic_link(topology: Topology, per_node: int = 1) -> Link:
    """The NIC bandwidth a ring with `per_node` of its ranks in each node has there: those
    GPUs' NIC shares together, per_node · min(c, k)/k NICs (`Topology.nic_share`), at the inter
    link's α. One NIC's worth: the inter Link itself."""
    nics = per_node * topology.nic_share
    if nics == 1:
        return topology.inter
    return Link(f"{topology.inter.name} x {nics:g} NICs", topology.inter.bandwidth * nics,
                topology.inter.latency, topology.inter.source)


def nvlink_share(topology: Topology, per_node: int) -> float:
    """The share u of a GPU's ring bytes that a flat ring through several nodes sends over the
    intra link from the busiest GPU: NCCL runs one ring per NIC and each leaves a node through
    its own NIC, from a different GPU; with a NIC per GPU (min(c, k) = k) every GPU is the exit
    of 1/g of the rings and forwards (g-1)/g on NVLink; with fewer NICs some GPU exits none and
    forwards all of it (u = 1). g: the ring's ranks per node (0 when it has one: no intra hop)."""
    if per_node <= 1:
        return 0.0
    return (per_node - 1) / per_node if topology.nic_share == 1 else 1.0


def flat_leg(op: str, size_bytes: float, ranks, topology: Topology, algorithm: str = "ring") -> Leg:
    """A collective on the group `ranks` (global ranks, n of them, g in each of m nodes) as
    NCCL runs it on a flat group.

    Inside one node every hop is intra: the one-tier time on the intra link. Through several
    nodes NCCL runs one ring per NIC (channels), each entering and leaving a node through its
    own NIC and crossing the intra link in between (NVIDIA/nccl#687, NVIDIA/nccl#412). A GPU
    then puts 1/g of its ring bytes on its NIC and (g-1)/g on the intra link, the rings run
    side by side, and the ring is as fast as the node's NICs together (`nic_link`: g · min(c, k)/k
    NICs) or its intra link, whichever is slower. Its latency is NCCL's tuning model
    (src/graph/tuning.cc, `ring_latency`): only the steps that cross nodes pay α_inter:

        ring    L + max( R·S / (g·s·β_nic),  R·S·u / β_intra )
        L       2(m-1)·α_inter + 2(n-m)·α_intra   (all_reduce; (m-1), (n-m) for the others)

    R·S the ring bytes per rank (2(n-1)/n·S for all_reduce), s = min(c, k)/k the NIC share of
    a GPU, u = (g-1)/g with a NIC per GPU, else 1 (`nvlink_share`). With a NIC per GPU and g =
    k the bandwidth term is 2(n-1)/n·S·max(1/(k·β_nic), (k-1)/(k·β_nvlink)) for an all_reduce;
    with one NIC per node (c = 1) it is the one-tier ring's on the slower link, 2(n-1)/n·S/β_nic.
    A group with one rank per node has NIC hops only (m = n: every step pays α_inter), at its
    rank's NIC share.

    NCCL's tree all_reduce (algorithm "tree") is hierarchical (NVIDIA/nccl#545, NVIDIA/nccl#548): a chain
    through each node's g ranks, a double binary tree across the m nodes, each rank sending
    about 2S (up and down) and a node's NICs 2S in all:

        tree    2·⌈log2 m⌉·α_inter + 2(g-1)·α_intra + 2S·max(1/(g·s·β_nic), 1/β_intra)

    "auto": the cheaper of the two for an all_reduce. reduce_scatter and all_gather are rings
    under every algorithm. The leg is paid at the tier whose term is the longer (a tie: inter)
    and keeps both links busy (`uses`: the tiers it has hops on). The ring's leg is paid at the
    tier whose bandwidth term is the longer (a tie: inter)."""
    ranks = list(ranks)
    steps = ring_steps(op, len(ranks))
    check_algorithm(algorithm)
    n, per_node = len(ranks), _per_node(ranks, topology)
    if n < 2:
        return Leg(op, "intra", n, size_bytes, 0.0, ())
    if len(per_node) == 1:
        return Leg(op, "intra", n, size_bytes,
                   collective_time(op, size_bytes, n, topology.intra, algorithm), ("intra",))
    m, g, big = len(per_node), min(per_node.values()), max(per_node.values())
    nic, intra, u = nic_link(topology, g), topology.intra, nvlink_share(topology, big)
    uses = ("intra", "inter") if big > 1 else ("inter",)
    over = {"inter": theory.RING_FACTOR[op](n) * size_bytes / nic.bandwidth}
    if u:
        over["intra"] = theory.RING_FACTOR[op](n) * size_bytes * u / intra.bandwidth
    best = max(("intra", "inter"), key=lambda t: (over.get(t, -1.0), t == "inter"))
    ring = {best: _latency(op, steps, m, topology) + over[best]}
    if op != "all_reduce" or algorithm == "ring":
        return Leg(op, best, n, size_bytes, ring[best], uses)
    chain = 2 * (big - 1) * intra.latency
    over = {"inter": 2 * size_bytes / nic.bandwidth,
            "intra": 2 * size_bytes / intra.bandwidth if big > 1 else -1.0}
    tree_tier = max(("intra", "inter"), key=lambda t: (over[t], t == "inter"))
    tree = tree_steps(m) * nic.latency + chain + over[tree_tier]
    if algorithm == "tree" or tree < ring[best]:
        return Leg(op, tree_tier, n, size_bytes, tree, uses)
    return Leg(op, best, n, size_bytes, ring[best], uses)


def hierarchical_all_reduce(size_bytes: float, ranks, topology: Topology,
                            algorithm: str = "ring") -> list[Leg]:
    """An all_reduce of S bytes over `ranks` in three legs, each on its own tier:

        reduce_scatter inside each node     (g-1)·α_intra + (g-1)/g · S/β_intra
        all_reduce of S/g across nodes      2(m-1)·α_inter + 2(m-1)/m · (S/g)/(s·β_nic)
        all_gather inside each node         (g-1)·α_intra + (g-1)/g · S/β_intra

    g: the group's ranks per node, m: its nodes, s = min(c, k)/k the NIC share of a GPU (1 with
    a NIC per GPU: the g chunks cross nodes in parallel, each through its own rank's NIC). The
    slow tier carries S/g per rank instead of S. One node (m = 1) or one rank per node (g = 1):
    the single flat leg. algorithm: how the inter-node all_reduce is modelled (`flat_leg` with
    one rank per node). ValueError unless every node of the group holds the same number of its
    ranks."""
    ranks = list(ranks)
    per_node = _per_node(ranks, topology)
    g, m = (per_node[min(per_node)] if per_node else 1), len(per_node)
    if any(c != g for c in per_node.values()):
        raise ValueError(f"a hierarchical all_reduce needs the same number of ranks in every node; "
                         f"ranks {ranks} hold {sorted(per_node.values())} per node")
    if m <= 1 or g == 1:
        return [flat_leg("all_reduce", size_bytes, ranks, topology, algorithm)]
    inside = collective_time("reduce_scatter", size_bytes, g, topology.intra)
    heads = [next(r for r in ranks if topology.node(r) == nd) for nd in sorted(per_node)]
    across = flat_leg("all_reduce", size_bytes / g, heads, topology, algorithm)
    return [Leg("reduce_scatter", "intra", g, size_bytes, inside, ("intra",)),
            Leg("all_reduce", "inter", m, size_bytes / g, across.seconds, ("inter",)),
            Leg("all_gather", "intra", g, size_bytes, inside, ("intra",))]


def legs(op: str, size_bytes: float, n: int, network: Link | Topology, algorithm: str = "ring",
         hierarchical: bool = False) -> list[Leg]:
    """A collective of S = size_bytes on the first n ranks of `network`, as legs: one Link, one
    leg on it (tier "link", the one-tier `collective_time`); a Topology, `flat_leg` - or, for an
    all_reduce with `hierarchical`, `hierarchical_all_reduce`."""
    if isinstance(network, Topology):
        if hierarchical and op == "all_reduce":
            return hierarchical_all_reduce(size_bytes, range(n), network, algorithm)
        return [flat_leg(op, size_bytes, range(n), network, algorithm)]
    return [Leg(op, "link", n, size_bytes, collective_time(op, size_bytes, n, network, algorithm),
                ("link",))]


def flat_link(network: Link | Topology, n: int) -> Link:
    """The one link a flat ring on the first n ranks of `network` runs as: the Link itself; on a
    Topology inside one node the intra link, else the slower of the node's NICs together
    (`nic_link`) and the intra link at 1/u (`flat_leg`). Its bandwidth is the ring's bus
    bandwidth; its α is the ring's latency per step, `ring_latency` / ring_steps, so that
    `collective_time` on it gives `flat_leg`'s time for a ring: ((m-1)·α_inter + (n-m)·α_intra)
    / (n-1) through m nodes (the same for all_reduce, 2(m-1) and 2(n-m) steps of 2(n-1))."""
    if not isinstance(network, Topology):
        return network
    per_node = _per_node(range(n), network)
    if len(per_node) <= 1:
        return network.intra
    g, big = min(per_node.values()), max(per_node.values())
    nic, u = nic_link(network, g), nvlink_share(network, big)
    alpha = ring_latency("all_gather", n, network) / (n - 1)
    if not u or nic.bandwidth <= network.intra.bandwidth / u:
        return Link(nic.name, nic.bandwidth, alpha, nic.source)
    return Link(f"{network.intra.name} at 1/{u:.3g} of its bandwidth", network.intra.bandwidth / u,
                alpha, network.intra.source)


def tier_bytes(op: str, size_bytes: float, ranks, topology: Topology, rank: int | None = None,
               hierarchical: bool = False) -> dict[str, float]:
    """Bytes a rank sends over each tier for `op` of S = size_bytes on the group `ranks` (global
    ranks in ring order): {"intra": bytes, "inter": bytes}, ring bytes as the ledger counts them
    (`theory.RING_FACTOR`: 2(n-1)/n·S for all_reduce, (n-1)/n·S for reduce_scatter / all_gather,
    S for broadcast).

    Flat ring through several nodes, a NIC per GPU (`Topology.nic_share` 1): one ring per NIC,
    each leaving a node from a different GPU, so every rank sends 1/g of its ring bytes over
    its NIC and (g-1)/g inside its node (g: the group's ranks in that node). Fewer NICs than
    GPUs: the one ring's picture - a rank sends all its ring bytes to its successor, on the
    tier of that hop (inter for the last rank of each node in the group). rank: a global rank
    of the group; None: the mean over the group's ranks (inter: hops crossing nodes / n of the
    ring bytes, the same in both pictures). hierarchical (all_reduce only): every rank sends
    2(g-1)/g·S inside its node and 2(m-1)/m·S/g across nodes (`hierarchical_all_reduce`).
    ValueError for an op other than all_reduce with hierarchical, or a rank outside the group."""
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
    per_node = _per_node(ranks, topology)
    if rank is not None and len(per_node) > 1 and topology.nic_share == 1:
        g = per_node[topology.node(rank)]
        return {"intra": ring * (g - 1) / g, "inter": ring / g}
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
