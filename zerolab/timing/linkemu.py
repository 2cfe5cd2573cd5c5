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

    def issue(self, work, op: str, size_bytes: float, handle=None) -> EmulatedWork:
        """Place a just-issued collective on the link (after the ones before it)."""
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
