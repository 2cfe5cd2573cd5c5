"""Every collective zerolab issues goes through `Comm`, which records it in a per-rank ledger.

Idea: a strategy never calls torch.distributed directly. It calls `comm.all_reduce`,
`comm.reduce_scatter`, `comm.all_gather` or `comm.broadcast`, saying what it moves (grads /
params / metric) and for which bucket or block; the ledger keeps op, phase, dtype, numel, group
size, per-rank ring bytes, wall time, algbw and busbw. Summing the ledger per step gives the
measured traffic that the labs put next to `theory.traffic_bytes`.

    torchrun --standalone --nproc-per-node 4 -m zerolab.train --stage 2 --preset tiny --steps 3

Conventions (nccl-tests PERFORMANCE.md): S is the full, unsharded array in bytes; a rank moves
2(n-1)/n·S for all_reduce, (n-1)/n·S for reduce_scatter and all_gather, S for broadcast; algbw =
S / t and busbw = algbw × the same factor. On gloo, reduce_scatter is an all_reduce plus a local
slice underneath, so its wall time looks like an all_reduce: the ledger counts the *logical*
ring bytes, not what gloo puts on the wire.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from . import theory, trace

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases (2.11 on the GPU
# machine) only have the old names. This is the one compatibility shim.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PHASES = ("setup", "forward", "backward", "step", "eval")


@dataclass
class Record:
    """One collective on one rank. Sizes in elements and bytes, time in seconds."""
    step: int
    phase: str            # forward / backward / step / eval / setup
    op: str               # all_reduce / reduce_scatter / all_gather / broadcast
    what: str             # grads / params / metric
    unit: str             # bucket or block name, e.g. "block.3"
    dtype: str            # e.g. "torch.bfloat16"
    numel: int            # elements of the full (unsharded) array S
    group_size: int       # n, ranks in the group the collective ran on
    size_bytes: int       # S in bytes
    bytes: float          # per-rank ring bytes: S × RING_FACTOR[op](n)
    time_s: float = float("nan")   # issue -> wait() returned (upper bound when overlapped)
    seq: int = 0          # order of issue on this rank

    @property
    def algbw(self) -> float:
        """S / t in bytes/s (nan until timed)."""
        return self.size_bytes / self.time_s if self.time_s > 0 else float("nan")

    @property
    def busbw(self) -> float:
        """algbw × ring factor, in bytes/s (nccl-tests)."""
        return theory.busbw(self.op, self.size_bytes, self.time_s, self.group_size)


@dataclass
class Handle:
    """A collective in flight. `wait()` blocks until done, times it, then runs `on_done`."""
    work: object
    record: Record
    started: float
    events: tuple | None = None
    on_done: object = None
    done: bool = field(default=False)

    def wait(self):
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        if self.events is not None:
            self.events[1].record()
            self.events[1].synchronize()
            self.record.time_s = self.events[0].elapsed_time(self.events[1]) / 1e3
        else:
            self.record.time_s = time.perf_counter() - self.started
        self.done = True
        if self.on_done is not None:
            self.on_done()


class Comm:
    """Instrumented collectives over one process group, with this rank's ledger.

    group: a torch.distributed ProcessGroup (None = the default group). The caller sets `step`
    and enters `phase(...)`; every call appends a `Record` to `records`.
    """

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: launch with torchrun "
                               "(zerolab train) or call dist.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.records: list[Record] = []
        self.step = 0
        self.current_phase = "setup"
        self.link = None        # a linkemu.LinkEmulator: collectives end no sooner than its model

    @contextlib.contextmanager
    def phase(self, name: str):
        """Tag the collectives issued inside the block with phase `name` (one of PHASES)."""
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        previous, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = previous

    # --- the collectives ------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, what: str, unit: str = "",
                   async_op: bool = False) -> Handle:
        """Sum `tensor` [S] over the group in place; every rank ends with the same sum."""
        return self._issue("all_reduce", tensor, what, unit, async_op,
                           lambda: dist.all_reduce(tensor, group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, what: str,
                       unit: str = "", async_op: bool = False) -> Handle:
        """Sum `input` [S] over the group; rank r receives chunk r into `output` [S/n].

        `output` may be input's own chunk r (in place), as NCCL allows.
        """
        self._check_chunk(output, input, "reduce_scatter")
        return self._issue("reduce_scatter", input, what, unit, async_op,
                           lambda: _reduce_scatter_single(output, input, group=self.group,
                                                          async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, what: str,
                   unit: str = "", async_op: bool = False) -> Handle:
        """Concatenate every rank's `input` [S/n] into `output` [S] on every rank (rank order)."""
        self._check_chunk(input, output, "all_gather")
        return self._issue("all_gather", output, what, unit, async_op,
                           lambda: _all_gather_single(output, input, group=self.group,
                                                      async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str, unit: str = "",
                  async_op: bool = False) -> Handle:
        """Copy `tensor` [S] from rank `src` (a rank of the group) to every rank."""
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._issue("broadcast", tensor, what, unit, async_op,
                           lambda: dist.broadcast(tensor, global_src, group=self.group,
                                                  async_op=True))

    # --- bookkeeping ----------------------------------------------------------------------
    def _check_chunk(self, chunk, full, op):
        if full.numel() != chunk.numel() * self.world_size:
            raise ValueError(f"{op}: full tensor has {full.numel()} elements, expected "
                             f"{self.world_size} x {chunk.numel()} (chunk size x world_size)")

    def _issue(self, op, full, what, unit, async_op, call) -> Handle:
        n = self.world_size
        size = full.numel() * full.element_size()
        record = Record(step=self.step, phase=self.current_phase, op=op, what=what, unit=unit,
                        dtype=str(full.dtype), numel=full.numel(), group_size=n,
                        size_bytes=size, bytes=size * theory.RING_FACTOR[op](n),
                        seq=len(self.records))
        self.records.append(record)
        events = None
        if full.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        handle = Handle(work=None, record=record, started=time.perf_counter(), events=events)
        with trace.issuing(record):              # labelled ranges in a --trace profile
            handle.work = call()
        if self.link is not None:
            handle.work = self.link.issue(handle.work, op, size)
        handle.work = trace.waiting(handle.work, record)
        if not async_op:
            handle.wait()
        return handle

    def bytes_by_op(self, step: int | None = None, what=("grads", "params")) -> dict[str, float]:
        """Per-rank ring bytes summed by op, for one step (or all) and the given `what` kinds."""
        out = {op: 0.0 for op in theory.RING_FACTOR}
        for r in self.records:
            if (step is None or r.step == step) and r.what in what:
                out[r.op] += r.bytes
        return out

    def to_json(self) -> list[dict]:
        """The ledger as a list of plain dicts (with algbw / busbw in bytes/s)."""
        return [{**asdict(r), "algbw": r.algbw, "busbw": r.busbw} for r in self.records]
