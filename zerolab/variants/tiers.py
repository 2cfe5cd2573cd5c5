"""Two tiers: the ranks of a node and the ranks across nodes, their Comms, and their bytes.

Idea: on a real cluster a node's links (NVLink, PCIe) are 10-50x faster per GPU than the links
between nodes (InfiniBand, Ethernet; a NIC per GPU on HGX / DGX nodes). Ranks sit in nodes of k
consecutive ranks (node = rank // k, as torchrun numbers them); a collective's cost depends on the
tier its group crosses. `node_comms(k)` gives every rank two sub-group Comms - `intra`, its node's
k ranks, and `inter`, the m = N/k ranks with its own local index, one per node - that write into
the world Comm's ledger, each record tagged with its tier. From them:

- `hierarchical_all_reduce`: reduce_scatter inside the node, all_reduce of the 1/k chunk across
  nodes, all_gather inside (NCCL's tree is such a hierarchy): rings of k and m ranks instead of
  N, about the same bytes on a NIC as a flat ring with a NIC per GPU;
- hybrid sharding (`zerolab.variants.hybrid`): HSDP shards over `intra` and all_reduces each gradient shard
  over `inter`; hpZ gathers the backward's weights over `intra` from a secondary shard.

`hybrid_traffic_bytes` and `hybrid_state_bytes` are their per-rank bytes by group, the formulas the
ledger is held to (tests/test_hybrid.py); `zeropp_traffic_bytes` is ZeRO++ whole (hpZ + qwZ +
qgZ in two hops) and `cross_node_bytes` what leaves a node, the paper's 3M -> 0.75M
(`zeropp_cross_node_in_m`: its finite-N form, tests/test_zeropp.py); `hybrid_link_bytes` turns them into bytes per NIC and
per GPU on the intra link, with NCCL's one ring per NIC (a flat ring sends 1/k of a GPU's ring
bytes over the node's NICs). The time of each tier is the cost model's
(`zerolab.timing.collectives`: flat_leg, hierarchical_all_reduce) and the emulator's
(`zerolab.timing.linkemu.TieredLinkEmulator`).

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 3 --preset tiny \\
        --hybrid hsdp --ranks-per-node 2 --intra 1@20 --inter 0.1@200 --backend gloo

Source: FSDP's ShardingStrategy.HYBRID_SHARD (Zhao et al. 2023, "PyTorch FSDP", section 3.2.2);
ZeRO++'s hpZ (Wang et al. 2023, arXiv:2306.10209, section 3.2).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import theory
from ..comm import Comm, Handle

KINDS = ("zero3", "hsdp", "hpz")          # flat ZeRO-3 and its two hybrids (zerolab.variants.hybrid)


def node_comms(ranks_per_node: int, parent: Comm | None = None) -> tuple[Comm, Comm]:
    """This rank's two sub-group Comms when the world is split into nodes of `ranks_per_node`
    consecutive ranks (node = rank // k): `intra`, the k ranks of its node, and `inter`, the ranks
    with its local index (rank % k) on every node, one per node.

    Every rank must call it (creating a process group is collective). parent: the world's Comm,
    whose ledger, step, phase and emulated `link` both share (`sub_comm`: one ledger, one set of
    per-tier clocks). ValueError unless k >= 1 divides the world size. A parent Comm over no
    process group (zerolab.timing.schedule's recorder) splits itself (`parent.node_comms`).
    """
    if hasattr(parent, "node_comms"):
        return parent.node_comms(ranks_per_node)
    world, rank = dist.get_world_size(), dist.get_rank()
    k = ranks_per_node
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or world % k:
        raise ValueError(f"ranks_per_node {k!r} must be an integer >= 1 that divides the world "
                         f"size {world}")
    intra = inter = None
    for node in range(world // k):                  # every rank creates every group, in order
        group = dist.new_group(list(range(node * k, (node + 1) * k)))
        if rank // k == node:
            intra = sub_comm(group, parent, "intra")
    for local in range(k):
        group = dist.new_group(list(range(local, world, k)))
        if rank % k == local:
            inter = sub_comm(group, parent, "inter")
    return intra, inter


def sub_comm(group, parent: Comm | None, tier: str) -> Comm:
    """A Comm over `group` whose records go into `parent`'s ledger tagged `tier`, whose step and
    phase are the parent's, which shares the parent's emulated link, and which the parent settles
    (a Comm of its own, tier `tier`, when parent is None)."""
    comm = Comm(group)
    comm.tier = tier
    if parent is not None:
        comm.root, comm.records, comm.link = parent.root, parent.records, parent.link
        parent.children.append(comm)
    return comm


def hierarchical_all_reduce(tensor: torch.Tensor, intra: Comm, inter: Comm, *, what: str,
                            unit: str = "") -> list[Handle]:
    """Sum `tensor` [S] over every rank of every node, in place, in three collectives that each
    stay on one tier (`node_comms` gives `intra` and `inter`; k = intra.world_size):

        reduce_scatter over the node    G{U} [S]  ->  G[S/k], summed over the node's k ranks
        all_reduce across nodes         G[S/k]    ->  G[S/k], summed over every node
        all_gather over the node        G[S/k]    ->  G[S]

    The k chunks cross nodes in parallel, one per local rank, each through its own rank's NIC: a
    NIC carries 2(m-1)/m·S/k, about what a flat ring puts on it with a NIC per GPU (2(n-1)/n·S/k),
    in 2(m-1) steps across instead of 2(n-1) (costmodel.hierarchical_all_reduce times it). Each collective is recorded
    in its own Comm's ledger. Returns their three Handles, waited for. ValueError unless `tensor`
    is contiguous and k divides its numel (pad first, as the strategies' flat buffers are).
    """
    k = intra.world_size
    if not tensor.is_contiguous() or tensor.numel() % k:
        raise ValueError(f"hierarchical_all_reduce needs a contiguous tensor whose {tensor.numel()} "
                         f"elements the node's {k} ranks divide")
    flat = tensor.view(-1)                                                  # [S]
    chunk = flat.narrow(0, intra.rank * (flat.numel() // k), flat.numel() // k)   # [S/k], own
    rs = intra.reduce_scatter(chunk, flat, what=what, unit=unit)    # chunk: summed over the node
    ar = inter.all_reduce(chunk, what=what, unit=unit)              # chunk: summed over all nodes
    ag = intra.all_gather(flat, chunk, what=what, unit=unit)        # in place, as ZeRO-1/2 gather
    return [rs, ar, ag]


# --- bytes per rank, by tier ---------------------------------------------------------------------
def hybrid_traffic_bytes(psi: float, world_size: int, ranks_per_node: int, kind: str = "zero3",
                         precision: str = "bf16", grad_accum: int = 1,
                         grad_dtype: str | None = None,
                         no_sync: bool = False) -> dict[str, dict[str, float]]:
    """Per-rank ring bytes a step of ZeRO-3 (`kind` "zero3"), HSDP ("hsdp") or hpZ ("hpz") moves,
    by the group it runs on - "world" (a ring through all N ranks, crossing nodes), "intra" (a
    node's k ranks), "inter" (one rank per node, m = N/k) - and by op. P = Ψ·bytes per param, G =
    Ψ·bytes per gradient, A = grad_accum: A all_gathers a step, and A reductions (one with
    no_sync: the micro-steps before the last ran backward(sync=False); R below is A or 1):

        zero3   world: all_gather 2A(N-1)/N·P, reduce_scatter R(N-1)/N·G
        hsdp    intra: all_gather 2A(k-1)/k·P, reduce_scatter R(k-1)/k·G;
                inter: all_reduce of the 1/k shard, R·2(m-1)/m·G/k
        hpz     world: all_gather (forward) A(N-1)/N·P, reduce_scatter R(N-1)/N·G;
                intra: all_gather (backward, from the secondary shards) A(k-1)/k·P

    HSDP's inter bytes, 2(m-1)/m·G/k = 2G(N-k)/(kN) a rank, are a ring's count (the ledger meets
    them exactly); the FSDP paper's 2M(W-1)/(GW) for hybrid sharding's cross-host traffic
    (M = G, W = N, its G = k) is larger: 0.4375·G against 0.25·G at N = 8, k = 4 (notebook 13
    runs the ledger). ValueError for an unknown kind or k not dividing N."""
    n = theory.check_world_size(world_size)
    k, m = _node_split(n, ranks_per_node)
    per = theory.bytes_per_param(precision, grad_dtype)
    p, g = psi * per["params"], psi * per["grads"]
    ag, rs, ar = (theory.RING_FACTOR[op] for op in ("all_gather", "reduce_scatter", "all_reduce"))
    a, r = grad_accum, 1 if no_sync else grad_accum
    if kind == "zero3":
        return {"world": {"all_gather": 2 * a * ag(n) * p, "reduce_scatter": r * rs(n) * g}}
    if kind == "hsdp":
        return {"intra": {"all_gather": 2 * a * ag(k) * p, "reduce_scatter": r * rs(k) * g},
                "inter": {"all_reduce": r * ar(m) * g / k}}
    if kind == "hpz":
        return {"world": {"all_gather": a * ag(n) * p, "reduce_scatter": r * rs(n) * g},
                "intra": {"all_gather": a * ag(k) * p}}
    raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")


def hybrid_link_bytes(psi: float, world_size: int, ranks_per_node: int, kind: str = "zero3",
                      nics_per_node: int | None = None, **traffic) -> dict[str, float]:
    """Bytes a step of `kind` puts on each NIC of a node ("nic") and on each GPU's intra link
    ("intra", the mean over a node's GPUs), from `hybrid_traffic_bytes` (its keywords pass
    through). c: `nics_per_node` (None: one per GPU, c = k), of which min(c, k) carry traffic
    (a GPU drives at most one NIC's worth: hardware.Topology.nic_share).

    A flat ring through m > 1 nodes: NCCL runs one ring per NIC, each leaving a node once, so of
    a GPU's ring bytes W a node sends k·W/k = W across, spread over its NICs, and each GPU W·(k-1)/k
    inside. A group of one rank per node (HSDP's inter all_reduce, E a rank): all of it crosses,
    k·E a node. Intra groups (I a rank) stay inside. So per NIC (W + k·E)/min(c, k), per GPU
    inside (k-1)/k·W + I. One node (m = 1): nothing crosses. ValueError as hybrid_traffic_bytes,
    or for c < 1."""
    n = theory.check_world_size(world_size)
    k, m = _node_split(n, ranks_per_node)
    c = check_nics_per_node(nics_per_node, "nics_per_node") or k
    by = {g: sum(ops.values()) for g, ops in
          hybrid_traffic_bytes(psi, n, k, kind, **traffic).items()}
    w, i, e = by.get("world", 0.0), by.get("intra", 0.0), by.get("inter", 0.0)
    if m == 1:
        return {"nic": 0.0, "intra": w + i}
    return {"nic": (w + k * e) / min(c, k), "intra": (k - 1) / k * w + i}


def hybrid_state_bytes(psi: float, world_size: int, ranks_per_node: int, kind: str = "zero3",
                       precision: str = "bf16", grad_dtype: str | None = None) -> dict[str, float]:
    """Per-rank bytes of the model states (`theory.model_state_bytes`' keys) between steps, and
    "secondary_params": what hpZ adds from a forward to its backward. zero3 and hpz shard
    everything over the N ranks (16Ψ/N in bf16 + AdamW); hsdp over a node's k ranks only (16Ψ/k:
    every node holds a full replica); hpz's secondary shard holds P/k (2Ψ/k)."""
    n = theory.check_world_size(world_size)
    k, _ = _node_split(n, ranks_per_node)
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    out = theory.model_state_bytes(psi, k if kind == "hsdp" else n, 3, precision,
                                   grad_dtype=grad_dtype)
    per = theory.bytes_per_param(precision, grad_dtype)
    return {**out, "secondary_params": psi * per["params"] / k if kind == "hpz" else 0.0}


# --- ZeRO++ as the paper builds it: hpZ + qwZ + qgZ (two hops), and the bytes that leave a node --
def zeropp_traffic_bytes(shard_numels, world_size: int, ranks_per_node: int,
                         weights: str | None = "int8", grads: str | None = "int4",
                         block: int = 256, hpz: bool = True, precision: str = "bf16",
                         grad_accum: int = 1,
                         grad_dtype: str | None = None) -> dict[str, dict[str, float]]:
    """Per-rank ring bytes of one step of ZeRO-3 with ZeRO++'s parts, by group
    ("world", "intra", "inter"; `hybrid_traffic_bytes`' keys) and op, from the units' padded shard
    sizes s_u = Ψ_u/N in elements (blocks restart in every chunk, as `theory.quantized_bytes`).
    weights "int8" (qwZ) or None (bf16), grads "int8"/"int4" (qgZ) or None, hpz: the backward
    gathers inside the node (zerolab.variants.hybrid.HpZ; qgZ then runs in two hops). W(s), Q(s): bytes of
    a weight / gradient chunk of s values (quantized, or s·2 in bf16); N = k·m:

        world  all_gather   (N-1)·ΣW(s_u) for the forward, the same again for the backward
                            without hpZ
        intra  all_gather   hpZ's backward, bf16 from the secondary shards: (k-1)/k·N·Σ2s_u
        grads  hpZ + qgZ    intra reduce_scatter (k-1)·m·ΣQ(s_u) (hop 1), inter (m-1)·ΣQ(s_u)
                            (hop 2: `quant.reduce_scatter_two_hop`)
               otherwise    world reduce_scatter (N-1)·ΣQ(s_u) (a ring, or qgZ's one all_to_all)

    each of them grad_accum times (A micro-steps, each reducing: zerolab train's accumulation).

    The ledger of `make_strategy(3, ..., quantize=..., hybrid="hpz")` meets them exactly
    (tests/test_zeropp.py). ValueError for a format other than None / int8 / int4 or a k that
    does not divide N."""
    n = theory.check_world_size(world_size)
    k, m = _node_split(n, ranks_per_node)
    per, a = theory.bytes_per_param(precision, grad_dtype), grad_accum

    def chunk_bytes(fmt, plain):            # one chunk of every unit, summed
        if fmt is not None and fmt not in theory.QUANT_BITS:
            raise ValueError(f"{fmt!r} is not one of None, "
                             f"{', '.join(map(repr, theory.QUANT_BITS))}")
        return sum(theory.quantized_bytes(s, theory.QUANT_BITS[fmt], block) if fmt
                   else s * plain for s in shard_numels)
    w, q = chunk_bytes(weights, per["params"]), chunk_bytes(grads, per["grads"])
    out = {"world": {"all_gather": a * (1 if hpz else 2) * (n - 1) * w}}
    if hpz:
        out["intra"] = {"all_gather": a * (k - 1) / k * n * per["params"] * sum(shard_numels)}
    if hpz and grads is not None:
        out["intra"]["reduce_scatter"] = a * (k - 1) * m * q
        out["inter"] = {"reduce_scatter": a * (m - 1) * q}
    else:
        out["world"]["reduce_scatter"] = a * (n - 1) * q
    return out


def cross_node_bytes(by_group: dict[str, dict[str, float]], ranks_per_node: int) -> float:
    """Bytes that leave one node a step, summed over its NICs, from per-rank ring bytes by group
    (a ledger's, summed by tier, or `hybrid_traffic_bytes` / `zeropp_traffic_bytes`): a "world"
    ring (W a rank) is NCCL's one ring per NIC, each leaving the node once, so the node sends W
    across (`hybrid_link_bytes`); an "inter" group (E a rank, one rank per node) sends k·E;
    "intra" stays inside. Divide by the NICs for a NIC's bytes. This is the count the ZeRO++
    paper's 3M -> 0.75M is in (M = 2Ψ, the fp16 model): flat ZeRO-3 sends 3(N-1)/N·M.
    A "world" record that is not a ring, qgZ's one-hop all_to_all (ZeRO-3 + qgZ without hpZ),
    sends k(N-k)·Q a node, not its ring count (N-1)·Q: k times the two hops' (m-1)·k·Q."""
    k = ranks_per_node
    total = {g: sum(ops.values()) for g, ops in by_group.items()}
    return total.get("world", 0.0) + k * total.get("inter", 0.0)


def zeropp_cross_node_in_m(world_size: int, ranks_per_node: int,
                           block: int | None = None) -> dict[str, float]:
    """Bytes leaving a node a step (`cross_node_bytes`) in units of M = 2Ψ, the fp16 model, for
    flat ZeRO-3 and for ZeRO++ (hpZ + qwZ int8 + qgZ int4 in two hops), with N = k·m ranks and
    Ψ/N a multiple of `block` (None: no scales, the paper's count):

        ZeRO-3   3(N-1)/N                                  -> 3      (the paper's 3M)
        ZeRO++   (N-1)/N·(1/2 + 2/B) + (m-1)/m·(1/4 + 2/B)  -> 0.75   (the paper's 0.75M)

    qwZ's forward gather (N-1)/N·M/2, hpZ's backward gather none, qgZ's second hop (m-1)/m·M/4
    (one node sum per chunk crosses, not the k ranks' own). The paper's 3M -> 0.75M is the
    limit N, m -> infinity; at N = 4, k = 2: 2.25M -> 0.5M; at N = 64, k = 8: 2.95M -> 0.711M
    (B = 256: 0.510M, 0.725M). Source: Wang et al. 2023, arXiv:2306.10209, sections 3-4."""
    n = theory.check_world_size(world_size)
    k, m = _node_split(n, ranks_per_node)
    scale = 0.0 if block is None else 2 / block
    return {"zero3": 3 * (n - 1) / n,
            "zero++": (n - 1) / n * (0.5 + scale) + (m - 1) / m * (0.25 + scale)}


def _node_split(n: int, k) -> tuple[int, int]:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or n % k:
        raise ValueError(f"ranks_per_node {k!r} must be an integer >= 1 that divides the world "
                         f"size {n}")
    return k, n // k


def check_nics_per_node(nics_per_node, flag: str = "--nics-per-node") -> int | None:
    """`nics_per_node` as an int (None stays None: one NIC per GPU); ValueError (one line)
    unless it is an integer >= 1."""
    if nics_per_node is None:
        return None
    if isinstance(nics_per_node, bool) or not isinstance(nics_per_node, int) or nics_per_node < 1:
        raise ValueError(f"{flag} {nics_per_node!r} must be an integer >= 1 (network cards in "
                         "each node; default one per GPU)")
    return nics_per_node
