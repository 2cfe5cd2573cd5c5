"""A link emulator for gloo runs: a collective is not done until the cost model says it would be.

Idea: on a CPU laptop gloo's ranks share the cores, so communication and compute take turns and
step time = compute + communication for every stage: nothing ever overlaps. A real network is a
separate device: while bytes are on the wire the GPU keeps computing. The emulator restores that:
each collective is given a place on one emulated link (in issue order, as NCCL runs a
communicator's collectives) and the time `costmodel.collective_time` gives for its bytes; its
`wait()` first waits for gloo (the data are real and correct), then *sleeps* until that time has
passed since the collective started on the link. Sleeping uses no CPU, so compute issued in
between runs at full speed and the wire time hides behind it exactly as the cost model replays.

    python -m zerolab train --stage 3 --preset small --link-gbps 1 --link-latency-us 100

Limits: the emulated time is a floor (a collective ends at max(gloo's own time, the model's));
the ledger's `time_s` of a collective queued behind another on the link may include part of that
queue (comm.py infers an op's start from gloo's two worker threads, not from the emulated link);
each rank keeps its own link clock from its own issue times; gloo on CPU only (NCCL kernels run
on the GPU's stream and would not wait for a host-side sleep). Validated in tests/test_linkemu.py
and labs/lab6_time_by_stage.ipynb.

Two tiers (`TieredLinkEmulator`, `--ranks-per-node K --intra SPEC --inter SPEC`): ranks are in
nodes of K consecutive ranks (node = rank // K) with c NICs each (one per GPU unless the
Topology says otherwise); each rank has its own intra link (its NVLink / PCIe port) and its NIC
share of the inter link, each with its own clock. A collective is timed as the cost model times
its process group (`costmodel.flat_leg`: the group's global ranks come from its Comm): inside one
node the intra link alone; through several nodes one ring per NIC, as fast as the node's NICs
together or its intra link, whichever is slower, keeping both of the rank's links busy; one rank
per node, the rank's NIC share alone. Collectives queue per tier in issue order
(`costmodel.Clocks`). A hierarchical all_reduce is three collectives on sub-groups
(`tiers.hierarchical_all_reduce`), each timed on its own tier. Validated in
zerolab/timing/tiercheck.py (margins there) and tests/test_tiers.py.

Because a collective sleeps for exactly the model's time, a measured/model ratio on emulated
links checks zerolab's schedule and overlap (what waits for what, what hides behind compute), not
the α-β or two-tier model itself: that is held to published NCCL measurements in
tests/test_nics.py.

    python -m zerolab train --stage 0 --nproc 4 --preset nano --ranks-per-node 2 \\
        --intra 1@20 --inter 0.1@200
"""
from __future__ import annotations

import time

from . import costmodel, hardware


class EmulatedWork:
    """Wraps a torch.distributed Work: `wait()` returns no sooner than `deadline` (perf_counter s).

    handle: the comm.Handle it belongs to; its `completed_at` (what the ledger's duration is
    computed from) becomes at least the deadline, so the ledger times the emulated link."""

    def __init__(self, work, deadline: float, handle=None):
        self.work, self.deadline, self.handle = work, deadline, handle

    def wait(self, *args):
        if self.work is not None:
            self.work.wait(*args)
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)           # waiting, not computing: the core is free
        if self.handle is not None:
            self.handle.completed_at = max(self.handle.completed_at or 0.0, self.deadline)
        return True

    def is_completed(self) -> bool:
        return (self.work is None or self.work.is_completed()) and time.perf_counter() >= self.deadline

    def __getattr__(self, name):            # anything else is the real Work's
        return getattr(self.work, name)


class LinkEmulator:
    """One emulated link per rank. `issue(work, op, size_bytes)` -> EmulatedWork.

    link: a hardware.Link (bandwidth β in bytes/s per rank per direction, latency α in s per
    ring step); world_size: n of the group. `busy` lists (op, start, end) in perf_counter seconds.
    """

    def __init__(self, link: hardware.Link, world_size: int):
        self.link, self.n = link, world_size
        self.free_at = 0.0
        self.busy: list[tuple[str, float, float]] = []

    def duration(self, op: str, size_bytes: float) -> float:
        """The model's seconds for `op` of the full array S = size_bytes on this link."""
        return costmodel.collective_time(op, size_bytes, self.n, self.link)

    def issue(self, work, op: str, size_bytes: float, handle=None, ranks=None) -> EmulatedWork:
        """Place a just-issued collective on the link (after the ones before it). ranks: the
        group's global ranks (unused: one link, n = world_size)."""
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.duration(op, size_bytes)
        self.busy.append((op, start, self.free_at))
        return EmulatedWork(work, self.free_at, handle)


def from_args(gbps: float | None, latency_us: float | None, world_size: int) -> LinkEmulator | None:
    """The emulator for `--link-gbps` / `--link-latency-us` (None when no bandwidth is given).

    Raises ValueError for a bandwidth <= 0, a latency < 0, or a latency without a bandwidth."""
    if gbps is None:
        if latency_us is not None:
            raise ValueError(f"--link-latency-us {latency_us} needs --link-gbps (the bandwidth)")
        return None
    if not gbps > 0:
        raise ValueError(f"--link-gbps {gbps} must be > 0 (gigabits per second per rank)")
    if latency_us is not None and not latency_us >= 0:
        raise ValueError(f"--link-latency-us {latency_us} must be >= 0 (microseconds per ring step)")
    return LinkEmulator(hardware.get_link(gbps=gbps, latency_us=latency_us or 0.0), world_size)


class TieredLinkEmulator:
    """A rank's two emulated links: its intra link and its share of the inter link.

    topology: a hardware.Topology (ranks and NICs per node, intra and inter Links). `issue(work, op,
    size_bytes, handle, ranks)` -> EmulatedWork ending when `costmodel.flat_leg` says for the
    group `ranks` (global ranks; None: the whole world), after the collectives before it on the
    tiers it uses. `busy` lists (op, tier paid, start, end) in perf_counter seconds; `clocks`
    holds when each tier is next free.
    """

    def __init__(self, topology: hardware.Topology, world_size: int):
        self.topology, self.n = topology, world_size
        self.clocks = costmodel.Clocks()
        self.busy: list[tuple[str, str, float, float]] = []

    def legs(self, op: str, size_bytes: float, ranks=None) -> list[costmodel.Leg]:
        """The model's leg for `op` of the full array S = size_bytes on the group `ranks`."""
        ranks = range(self.n) if ranks is None else ranks
        return [costmodel.flat_leg(op, size_bytes, ranks, self.topology)]

    def issue(self, work, op: str, size_bytes: float, handle=None, ranks=None) -> EmulatedWork:
        """Place a just-issued collective on the links of the tiers it uses."""
        legs = self.legs(op, size_bytes, ranks)
        start, end = self.clocks.place(legs, time.perf_counter())
        self.busy.append((op, legs[0].tier, start, end))
        return EmulatedWork(work, end, handle)


def tiers_from_args(ranks_per_node: int | None, intra: str | None, inter: str | None,
                    world_size: int, link_gbps: float | None = None,
                    nics_per_node: int | None = None) -> hardware.Topology | None:
    """The Topology for `--ranks-per-node K --intra SPEC --inter SPEC [--nics-per-node C]` (None
    when K is not given; C defaults to one NIC per GPU).

    SPEC: a profile name of hardware.LINKS or a custom GBPS[@LATENCY_US] (`hardware.parse_link`;
    --inter is one NIC's). Raises ValueError (one line) for K < 1 or not dividing world_size,
    C < 1, a missing or unknown SPEC (the error lists the profiles), --intra / --inter /
    --nics-per-node without K, or K with --link-gbps (the one-tier link)."""
    if ranks_per_node is None:
        given = [f for f, v in (("--intra", intra), ("--inter", inter),
                                ("--nics-per-node", nics_per_node)) if v is not None]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{' and '.join(given)} {verb} --ranks-per-node (ranks in each node)")
        return None
    if link_gbps is not None:
        raise ValueError("--link-gbps is one link for every collective; with --ranks-per-node "
                         "give the two tiers' links as --intra and --inter")
    missing = [f for f, v in (("--intra", intra), ("--inter", inter)) if v is None]
    if missing:
        raise ValueError(f"--ranks-per-node {ranks_per_node} needs {' and '.join(missing)}: a "
                         f"profile ({', '.join(hardware.LINKS)}) or GBPS[@LATENCY_US], e.g. 0.1@200")
    return hardware.get_topology(ranks_per_node, intra, inter, world_size, nics_per_node)


def emulator(gbps: float | None, latency_us: float | None, world_size: int,
             topology: hardware.Topology | None = None):
    """The emulator a training run's Comm gets: TieredLinkEmulator for a topology, else
    `from_args`'s LinkEmulator (or None)."""
    if topology is not None:
        return TieredLinkEmulator(topology, world_size)
    return from_args(gbps, latency_us, world_size)
