"""Links and devices for the cost model: bandwidth and latency of a link, peak FLOP/s of a device.

Idea: the cost model's inputs are two numbers per machine, β (bytes/s per rank per direction)
and α (seconds per ring step) for the link, F (FLOP/s) for the device. Each named profile below
carries the datasheet arithmetic it comes from (`source`); `get_link` / `get_device` build a
custom one from Gb/s, microseconds or TFLOP/s, and name it custom.

    get_link("ib-ndr").bandwidth          # 50e9 bytes/s: one 400 Gb/s NIC port
    get_link("ib-ndr", gbps=200).name     # 'ib-ndr with a custom bandwidth'
    get_device("h100").flops              # 989e12 FLOP/s, bf16 dense

Two tiers (`Topology`): ranks grouped into nodes of k consecutive ranks (rank r on node r // k),
an intra-node link between the ranks of a node (NVLink, PCIe) and an inter-node link between
nodes (InfiniBand, Ethernet): `intra` per GPU per direction, `inter` per NIC per direction, and
c NICs per node (`nics_per_node`; default one per GPU, c = k, as HGX / DGX nodes are built). NCCL
runs one ring per NIC, each entering and leaving a node through its own NIC
(`collectives.flat_leg`), so a GPU has a NIC share of min(c, k)/k (`Topology.nic_share`): one
NIC with c = k, 1/k of one with c = 1. `parse_link` reads a profile name or a custom
GBPS[@LATENCY_US]; `get_topology` checks k and c against the world size.

    get_topology(8, "nvlink4", "ib-ndr", world_size=64)   # 8 nodes x 8 ranks, 8 NICs per node
    get_topology(8, "nvlink4", "ib-hdr", 24, nics_per_node=4)   # nccl-tests#119: 8 A100, 4 HDR NICs
    get_topology(2, "1@20", "0.1@200", world_size=4)       # 2 x 2, slow links for gloo on a laptop
"""
from __future__ import annotations

from dataclasses import dataclass

from ..variants.tiers import check_nics_per_node  # noqa: F401 - re-exported: the flag's check


@dataclass(frozen=True)
class Link:
    """A link: bandwidth β in bytes/s per rank per direction, latency α in seconds per ring step."""
    name: str
    bandwidth: float
    latency: float
    source: str = "custom"

    @property
    def gbps(self) -> float:
        """β in gigabits per second (1e9 bit/s), the unit networks are sold in."""
        return self.bandwidth * 8 / 1e9


@dataclass(frozen=True)
class Device:
    """A device's peak dense FLOP/s (bf16 on GPUs), its memory in bytes (0: not given) and
    where the numbers come from."""
    name: str
    flops: float
    source: str = "custom"
    memory: float = 0.0


_ALPHA = ("α is a typical order of magnitude per ring step (nccl-tests small-message latencies), "
          "not a datasheet figure")
LINKS = {
    "nvlink3": Link("nvlink3", 300e9, 2e-6, "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional "
                    "per GPU -> 300 GB/s each way; " + _ALPHA),
    "nvlink4": Link("nvlink4", 450e9, 2e-6, "NVIDIA H100/H200 SXM datasheets: NVLink 900 GB/s "
                    "bidirectional per GPU -> 450 GB/s each way; " + _ALPHA),
    "nvlink5": Link("nvlink5", 900e9, 2e-6, "NVIDIA Blackwell datasheet: NVLink 1.8 TB/s "
                    "bidirectional per GPU -> 900 GB/s each way; " + _ALPHA),
    "pcie4": Link("pcie4", 31.5e9, 3e-6, "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 / 8 = "
                  "31.5 GB/s each way; " + _ALPHA),
    "pcie5": Link("pcie5", 63e9, 3e-6, "PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 / 8 = "
                  "63 GB/s each way; " + _ALPHA),
    "ib-ndr": Link("ib-ndr", 50e9, 5e-6, "InfiniBand NDR (ConnectX-7): 400 Gb/s per port -> 50 "
                   "GB/s each way per NIC (DGX H100: 8 NICs, one per GPU); " + _ALPHA),
    "ib-hdr": Link("ib-hdr", 25e9, 5e-6, "InfiniBand HDR (ConnectX-6): 200 Gb/s per port -> 25 "
                   "GB/s each way per NIC (DGX A100: 8 NICs, one per GPU); " + _ALPHA),
    "400gbe": Link("400gbe", 50e9, 10e-6, "400 Gigabit Ethernet (e.g. RoCE v2 on ConnectX-7 / "
                   "Spectrum-X): 50 GB/s each way per NIC; " + _ALPHA),
    "100gbe": Link("100gbe", 12.5e9, 20e-6, "100 Gigabit Ethernet: 12.5 GB/s each way per NIC; " + _ALPHA),
    "25gbe": Link("25gbe", 3.125e9, 30e-6, "25 Gigabit Ethernet: 3.125 GB/s each way per NIC; " + _ALPHA),
}

DEVICES = {
    "h100": Device("h100", 989e12, "NVIDIA H100 SXM5 datasheet: bf16 dense 989 TFLOP/s "
                   "(1979 with sparsity), 80 GB HBM3", 80e9),
    "h200": Device("h200", 989e12, "NVIDIA H200 SXM datasheet: bf16 dense 989 TFLOP/s "
                   "(1979 with sparsity), the same chip as H100 with 141 GB HBM3e", 141e9),
    "a100": Device("a100", 312e12, "NVIDIA A100 SXM datasheet: bf16 dense 312 TFLOP/s "
                   "(624 with sparsity), 80 GB HBM2e (the 80 GB model)", 80e9),
}


def get_link(name: str | None = None, gbps: float | None = None,
             latency_us: float | None = None) -> Link:
    """A named link (`LINKS`), optionally with its bandwidth or latency replaced; or a custom one.

    gbps: gigabits per second (1e9 bit/s) per rank per direction; latency_us: α in microseconds.
    Raises ValueError for an unknown name, a bandwidth <= 0, a latency < 0, or neither name nor gbps.
    """
    if name is not None and name not in LINKS:
        raise ValueError(f"link {name!r} is not one of {', '.join(LINKS)} "
                         "(or a bandwidth in Gb/s for a custom one)")
    if gbps is not None and not gbps > 0:
        raise ValueError(f"link bandwidth {gbps!r} Gb/s must be > 0")
    if latency_us is not None and not latency_us >= 0:
        raise ValueError(f"link latency {latency_us!r} us must be >= 0")
    if name is None and gbps is None:
        raise ValueError("give a link name or a bandwidth in Gb/s")
    base = LINKS[name] if name is not None else Link("custom", 0.0, 0.0)
    if gbps is None and latency_us is None:
        return base
    given = " and ".join(w for w, v in (("bandwidth", gbps), ("latency", latency_us)) if v is not None)
    if gbps is not None and latency_us is not None:
        name = None                         # nothing of the named link is left
    return Link(f"{name} with a custom {given}" if name is not None else "custom",
                gbps * 1e9 / 8 if gbps is not None else base.bandwidth,
                latency_us * 1e-6 if latency_us is not None else base.latency,
                f"custom {given}; the rest from {name}: {base.source}" if name is not None
                else "custom")


def get_device(name: str | None = None, tflops: float | None = None) -> Device:
    """A named device (`DEVICES`) or a custom one of `tflops` (1e12 FLOP/s); ValueError otherwise."""
    if tflops is not None:
        if not tflops > 0:
            raise ValueError(f"device TFLOP/s {tflops!r} must be > 0")
        return Device(f"custom ({tflops:g} TFLOP/s peak)", tflops * 1e12)
    if name not in DEVICES:
        raise ValueError(f"device {name!r} is not one of {', '.join(DEVICES)} "
                         "(or a peak in TFLOP/s for a custom one)")
    return DEVICES[name]


# --- two tiers: ranks in nodes ----------------------------------------------------------------
TIERS = ("intra", "inter")      # inside a node, between nodes


def parse_link(spec: str, what: str = "link") -> Link:
    """A link from text: a profile name (`LINKS`), or a custom "GBPS" or "GBPS@LATENCY_US"
    (gigabits per second per rank per direction, α in microseconds per ring step; "1@200" is
    1 Gb/s with α = 200 us, "10" is 10 Gb/s with α = 0). what: how the error names the value
    (e.g. "--inter"). Raises ValueError (one line, listing the profiles) otherwise."""
    text = str(spec).strip()
    if text in LINKS:
        return LINKS[text]
    gbps, _, lat = text.partition("@")
    try:
        bandwidth, latency = float(gbps), float(lat) if lat else 0.0
    except ValueError:
        bandwidth = latency = float("nan")
    if not (0 < bandwidth < float("inf") and 0 <= latency < float("inf")):
        raise ValueError(f"{what} {spec!r} is not one of {', '.join(LINKS)}, nor a custom "
                         "GBPS[@LATENCY_US] (Gb/s > 0 per rank, α >= 0 us; e.g. 1@200)")
    return Link(f"custom {bandwidth:g} Gb/s, {latency:g} us", bandwidth * 1e9 / 8, latency * 1e-6)


@dataclass(frozen=True)
class Topology:
    """Ranks in nodes of `ranks_per_node` consecutive ranks (rank r on node r // k), linked by
    `intra` inside a node (per GPU) and `inter` between nodes (per NIC), with `nics_per_node`
    NICs in each node (None: one per GPU, c = k)."""
    ranks_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int | None = None

    @property
    def nics(self) -> int:
        """c, the NICs of a node (`nics_per_node`, or k when not given)."""
        return self.ranks_per_node if self.nics_per_node is None else self.nics_per_node

    @property
    def nic_share(self) -> float:
        """The NIC bandwidth a GPU has, in NICs: min(c, k)/k. 1 with a NIC per GPU; 1/k with one
        NIC per node; never more than 1: a GPU reaches the network through its own PCIe x16
        link (63 GB/s on PCIe 5.0, about one 400 Gb/s NIC), so NICs beyond one per GPU do not
        add to a GPU's share (nccl-tests#232: one H100 per node over 4 NICs, about one NIC's
        bus bandwidth)."""
        return min(self.nics, self.ranks_per_node) / self.ranks_per_node

    def node(self, rank: int) -> int:
        """The node of global rank `rank`: rank // ranks_per_node."""
        return rank // self.ranks_per_node

    def nodes(self, ranks) -> list[int]:
        """The distinct nodes of the global ranks `ranks`, ascending."""
        return sorted({self.node(r) for r in ranks})

    def link(self, tier: str) -> Link:
        """The Link of a tier, "intra" or "inter" (inter: one NIC's)."""
        if tier not in TIERS:
            raise ValueError(f"tier {tier!r} is not one of {', '.join(TIERS)}")
        return self.intra if tier == "intra" else self.inter

    def hop_tiers(self, ranks) -> tuple[str, ...]:
        """The tiers a ring over `ranks` (global ranks, in ring order) has hops on: ("intra",),
        ("inter",) or ("intra", "inter"); () for one rank (no hop)."""
        ranks = list(ranks)
        if len(ranks) < 2:
            return ()
        crossing = {self.node(a) != self.node(b) for a, b in zip(ranks, ranks[1:] + ranks[:1])}
        return tuple(t for t, c in (("intra", False), ("inter", True)) if c in crossing)

    def describe(self, world_size: int | None = None) -> str:
        """One line: nodes x ranks per node, NICs per node and the two links (GB/s, us)."""
        shape = (f"{world_size // self.ranks_per_node} nodes x {self.ranks_per_node} ranks"
                 if world_size else f"{self.ranks_per_node} ranks per node")
        return (f"{shape}, {self.nics} NIC{'s' if self.nics > 1 else ''} per node; intra "
                f"{self.intra.name} {self.intra.bandwidth / 1e9:.4g} GB/s, "
                f"{self.intra.latency * 1e6:.3g} us; inter {self.inter.name} "
                f"{self.inter.bandwidth / 1e9:.4g} GB/s per NIC, {self.inter.latency * 1e6:.3g} us")


def check_ranks_per_node(ranks_per_node, world_size: int | None = None,
                         flag: str = "--ranks-per-node") -> int:
    """`ranks_per_node` as an int; ValueError (one line) unless it is >= 1 and divides the world
    size (when given): every node holds the same number of ranks."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"{flag} {ranks_per_node!r} must be an integer >= 1 (ranks in each node)")
    if world_size is not None and world_size % ranks_per_node:
        raise ValueError(f"{flag} {ranks_per_node} does not divide the world size {world_size}: "
                         "every node holds the same number of ranks")
    return ranks_per_node


def get_topology(ranks_per_node: int, intra: str | Link, inter: str | Link,
                 world_size: int | None = None, nics_per_node: int | None = None) -> Topology:
    """A Topology of nodes of `ranks_per_node` ranks and `nics_per_node` NICs (None: one per
    GPU); intra / inter: Links, or text for `parse_link` (a profile name or GBPS[@LATENCY_US]).
    ValueError (one line) for a bad value: ranks_per_node < 1 or not dividing world_size,
    nics_per_node < 1, an unknown profile (the error lists them)."""
    k = check_ranks_per_node(ranks_per_node, world_size)
    c = check_nics_per_node(nics_per_node)
    links = [x if isinstance(x, Link) else parse_link(x, f"--{name}")
             for name, x in (("intra", intra), ("inter", inter))]
    return Topology(k, *links, c)
