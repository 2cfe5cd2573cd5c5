"""Every collective zerolab issues goes through `Comm`, which records it in a per-rank ledger.

Idea: a strategy never calls torch.distributed directly. It calls `comm.all_reduce`,
`comm.reduce_scatter`, `comm.all_gather` or `comm.broadcast`, saying what it moves (grads /
params / metric) and for which bucket or block; the ledger keeps op, phase, dtype, numel, group
size, per-rank ring bytes, wall time, algbw and busbw. Summing the ledger per step gives the
measured traffic that the labs put next to `theory.traffic_bytes`.

    torchrun --standalone --nproc-per-node 4 -m zerolab.run.train --stage 2 --preset tiny --steps 3

Sub-groups (`zerolab.variants.tiers`: a node's ranks, the ranks across nodes) have Comms of their own that
write into their parent's ledger, each record tagged with the tier it stays on, so one ledger per
rank holds every collective of a step.

Conventions (nccl-tests PERFORMANCE.md): S is the full, unsharded array in bytes; a rank moves
2(n-1)/n·S for all_reduce, (n-1)/n·S for reduce_scatter and all_gather, S for broadcast; algbw =
S / t and busbw = algbw × the same factor. On gloo, reduce_scatter is an all_reduce plus a local
slice underneath (Comm issues exactly that: an in-place all_reduce, then the slice), so its wall
time looks like an all_reduce: the ledger counts the *logical* ring bytes, not what gloo puts on
the wire.

Time: each record's `time_s` is that collective's own duration, not "issue to wait() returned"
(which would include the compute done meanwhile and the collectives queued ahead of it). The host
never synchronises once per collective; `settle()` fills the durations (train calls it once per
step, after the step's one device synchronise). How depends on the backend (`time_source`,
explained by `TIME_SOURCES`):

- nccl: NCCL's own CUDA events around the kernel on its stream (the process group's timing,
  `TORCH_NCCL_ENABLE_TIMING=1`, switched on by `Comm`), read with `work._get_duration()` once the
  work has completed. Includes time a rank waits inside the kernel for a late peer.
- gloo: torch offers no per-op duration for gloo, so the ledger takes the completion time where
  the work runs (a done-callback on gloo's worker thread) and subtracts the moment the op could
  start: its issue, or - when earlier ops of the group still occupied gloo's worker threads (2 by
  default; gloo starts a group's ops in issue order) - the moment one became free. `issue_to_done_s`
  keeps the plain host-side "issue to completion" next to it. A gloo work without a future
  (gloo's own reduce_scatter, which Comm no longer issues) is seen complete only when wait()
  returns ("gloo_wait", an upper bound that includes whatever ran between its completion and the
  wait).
"""
from __future__ import annotations

import bisect
import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed as dist
from torch.profiler import record_function

from . import theory
from .loop.order import watched_wait

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases (2.11 on the GPU
# machine) only have the old names. This is the one compatibility shim.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PHASES = ("setup", "forward", "backward", "step", "eval")

# What each record's time_s is, by how it was measured (shown next to every time / busbw figure).
TIME_SOURCES = {
    "nccl": "per-op: NCCL's CUDA events around the kernel (TORCH_NCCL_ENABLE_TIMING), read once a step",
    "gloo": "per-op: completion on gloo's worker thread minus when a worker could start it "
            "(torch gives gloo no duration; queue wait removed)",
    "gloo_wait": "upper bound: gloo op with no completion callback (gloo's own reduce_scatter), "
                 "queue-corrected issue to wait() returning",
    "none": "not timed (this backend gave no duration; NCCL needs TORCH_NCCL_ENABLE_TIMING=1)",
}


@dataclass
class Record:
    """One collective on one rank. Sizes in elements and bytes, time in seconds."""
    step: int
    phase: str            # forward / backward / step / eval / setup
    op: str               # all_reduce / reduce_scatter / all_gather / broadcast / all_to_all
    what: str             # grads / params / metric
    unit: str             # bucket or block name, e.g. "block.3"
    dtype: str            # e.g. "torch.bfloat16"
    numel: int            # elements of the full (unsharded) array S
    group_size: int       # n, ranks in the group the collective ran on
    size_bytes: int       # S in bytes
    bytes: float          # per-rank ring bytes: S × RING_FACTOR[op](n)
    time_s: float = float("nan")   # this op's own duration (see time_source); nan until settled
    seq: int = 0          # order of issue on this rank
    time_source: str = ""          # a key of TIME_SOURCES, set when settled
    issue_to_done_s: float = float("nan")   # gloo: issue -> completion on the host (queue included)
    tier: str = ""        # "" the Comm's whole group; "intra" / "inter" a sub-group's (zerolab.variants.tiers)

    @property
    def algbw(self) -> float:
        """S / t in bytes/s (nan until timed)."""
        return self.size_bytes / self.time_s if self.time_s > 0 else float("nan")

    @property
    def busbw(self) -> float:
        """algbw × ring factor, in bytes/s (nccl-tests)."""
        return theory.busbw(self.op, self.size_bytes, self.time_s, self.group_size)


# --- labels in a profile: each collective's issue and wait, named by its record ------------------
# (zerolab.timing.trace writes and reads the traces; the ranges cost one attribute read when no
# profiler is recording)
def label(record) -> str:
    """"all_gather params block.3 [forward]": a Record as a trace label."""
    return f"{record.op} {record.what} {record.unit or '-'} [{record.phase}]".replace("  ", " ")


def profiling() -> bool:
    """True while a torch profiler records (one attribute read)."""
    return bool(_autograd_profiler._is_profiler_enabled)


@contextlib.contextmanager
def _issuing(record):
    """A range "issue LABEL" around the call that starts a collective (when profiling)."""
    if not profiling():
        yield
        return
    with record_function(f"issue {label(record)}"):
        yield


class LabelledWork:
    """Wraps a Work (or linkemu.EmulatedWork): its wait() is a range "wait LABEL" in the trace."""

    def __init__(self, work, name: str):
        self.work, self.name = work, name

    def wait(self, *args):
        with record_function(self.name):
            return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name):            # e.g. NCCL's _get_duration: the real Work's
        return getattr(self.work, name)


def _waiting(work, record):
    """`work` itself, or a LabelledWork when a profiler is recording."""
    return LabelledWork(work, f"wait {label(record)}") if profiling() and work is not None else work


@dataclass
class Handle:
    """A collective in flight. `wait()` makes its result usable, then runs `on_done`.

    wait() never synchronises the host with the device: on NCCL it only orders the current CUDA
    stream after the collective; on gloo it blocks until gloo's worker finished the op. The
    duration is filled later by `Comm.settle()`.
    """
    work: object
    record: Record
    started: float                          # perf_counter() just before the op was issued
    comm: object = None
    cuda: bool = False                      # the tensors are on a CUDA device
    on_done: object = None
    post: object = None                     # finishes the result (gloo reduce_scatter: copy out)
    done: bool = field(default=False)
    completed_at: float | None = None       # gloo: perf_counter() when the worker finished it
    no_stamp: bool = False                  # gloo op without a future: seen at wait() only

    def wait(self):
        if self.done:
            return
        if self.work is not None:
            if self.comm is not None and self.comm.backend != "nccl":
                watched_wait(self.work, self.comm, self.record)     # stalls compared: order.py
            else:
                self.work.wait()
            if self.comm is not None and self.comm.backend != "nccl":
                now = time.perf_counter()   # completion happened before wait() returned
                self.completed_at = min(self.completed_at or now, now)
        self.done = True
        if self.post is not None:
            post, self.post = self.post, None
            post()
        if self.record.time_source:         # already settled: the Work is no longer needed
            self.work = None
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()
        if self.comm is not None:
            self.comm.settle(block=False)


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
        # the group's global ranks in its rank order (two emulated tiers time by their nodes)
        self.ranks = (tuple(dist.get_process_group_ranks(group)) if group is not None
                      else tuple(range(self.world_size)))
        self.records: list[Record] = []
        self.root, self.tier, self.children = self, "", []   # a sub-group's: zerolab.variants.tiers
        self._step, self._phase = 0, "setup"
        self.passes, self.parents = {0: 0}, {}  # order: forward passes per step, units' layers
        self.backend = dist.get_backend(group)
        self._pending: list[Handle] = []        # issued, duration not read yet (issue order)
        self._gloo_free: list[float] = []       # gloo: the latest completions settled so far
        self._gloo_last_start = 0.0
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if self.backend == "nccl" and hasattr(pg, "_enable_collectives_timing"):
            pg._enable_collectives_timing()     # = TORCH_NCCL_ENABLE_TIMING=1 for this group
        try:
            self.gloo_threads = int(pg._get_backend(torch.device("cpu")).options._threads)
        except Exception:  # noqa: BLE001 - not gloo, or an older torch: gloo's default
            self.gloo_threads = 2
        self.link = None        # a linkemu.LinkEmulator: collectives end no sooner than its model

    # step and phase live at the root Comm: a sub-group's collectives carry its parent's
    step = property(lambda self: self.root._step,
                    lambda self, v: setattr(self.root, "_step", v))
    current_phase = property(lambda self: self.root._phase, lambda self, v: self._enter(v))

    def _enter(self, phase: str):
        """Set the phase, counting forward passes between optimizer steps (`passes`: {k: forward
        passes after the k-th entry into "step"}): zerolab.loop.order tells a rank that ran more
        micro-steps than the others from other faults by it."""
        root = self.root
        passes = root.__dict__.setdefault("passes", {0: 0})    # (a Comm-like without __init__)
        k = max(passes)
        if phase == "forward" and root._phase != "forward":
            passes[k] += 1
        elif phase == "step" and root._phase != "step" and passes[k]:
            passes[k + 1] = 0
            passes.pop(k - 8, None)
        root._phase = phase

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
                   async_op: bool = False, op: str = "sum") -> Handle:
        """Sum `tensor` [S] over the group in place (op="max": the largest); every rank ends
        with the same result."""
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._issue("all_reduce", tensor, what, unit, async_op,
                           lambda: dist.all_reduce(tensor, op=red, group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, what: str,
                       unit: str = "", async_op: bool = False) -> Handle:
        """Sum `input` [S] over the group; rank r receives chunk r into `output` [S/n].

        `output` may be input's own chunk r (in place), as NCCL allows. Afterwards `input`'s
        contents are undefined: on gloo it holds the full sum. gloo's own reduce_scatter is an
        all_reduce of a *copy* of `input` plus a slice, and its issue call blocks until that
        copy is made (measured, 2 ranks, 1.77 MB fp32: median 3.1 ms against 1.9 ms for an
        in-place all_reduce and the slice); on gloo, Comm therefore all_reduces `input` in place
        and copies rank r's chunk into `output` when the op is waited for. Same result, same
        logical ring bytes in the ledger, and gloo gives the all_reduce a future to time it by.
        """
        self._check_chunk(output, input, "reduce_scatter")
        if self.backend == "gloo":
            return self._issue("reduce_scatter", input, what, unit, async_op,
                               lambda: dist.all_reduce(input, group=self.group, async_op=True),
                               post=lambda: self._copy_chunk(output, input))
        return self._issue("reduce_scatter", input, what, unit, async_op,
                           lambda: _reduce_scatter_single(output, input, group=self.group,
                                                          async_op=True))

    def _copy_chunk(self, output, input):
        k = output.numel()
        chunk = input.reshape(-1).narrow(0, self.rank * k, k)
        if chunk.data_ptr() != output.data_ptr():        # not in place: copy rank r's chunk out
            output.reshape(-1).copy_(chunk)

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

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], *, what: str, unit: str = "",
                   async_op: bool = False) -> Handle:
        """Rank r sends `input`'s j-th piece (`input_splits[j]` elements, in order) to rank j and
        receives rank j's r-th piece into `output`'s j-th (`output_splits[j]`): torch's
        all_to_all_single with split sizes (1-D tensors). The ledger's `bytes` are what this
        rank sends to the others (its own piece stays); its `size_bytes` S is the uniform
        all_to_all that moves as much as this rank's busier direction, n/(n-1)·max(sent,
        received), so that an emulated link times it as (n-1)·α + max(sent, received)/β."""
        if sum(input_splits) != input.numel() or sum(output_splits) != output.numel():
            raise ValueError(f"all_to_all: splits {input_splits} / {output_splits} do not add up "
                             f"to the tensors' {input.numel()} / {output.numel()} elements")
        size = input.element_size()
        sent = (input.numel() - input_splits[self.rank]) * size
        received = (output.numel() - output_splits[self.rank]) * size
        n = self.world_size
        s_bytes = max(sent, received) * n / (n - 1) if n > 1 else 0
        return self._issue("all_to_all", input, what, unit, async_op,
                           lambda: dist.all_to_all_single(output, input, output_splits,
                                                          input_splits, group=self.group,
                                                          async_op=True),
                           sizes=(s_bytes, sent))

    # --- bookkeeping ----------------------------------------------------------------------
    def _check_chunk(self, chunk, full, op):
        if full.numel() != chunk.numel() * self.world_size:
            raise ValueError(f"{op}: full tensor has {full.numel()} elements, expected "
                             f"{self.world_size} x {chunk.numel()} (chunk size x world_size)")

    def _record(self, op, full, what, unit) -> Record:
        """The ledger's record of `op` on `full` [S] (appended to `records`)."""
        size = full.numel() * full.element_size()
        record = Record(step=self.step, phase=self.current_phase, op=op, what=what, unit=unit,
                        dtype=str(full.dtype), numel=full.numel(), group_size=self.world_size,
                        size_bytes=size, bytes=size * theory.RING_FACTOR[op](self.world_size),
                        seq=len(self.records), tier=self.tier)
        self.records.append(record)
        return record

    def _issue(self, op, full, what, unit, async_op, call, post=None, sizes=None) -> Handle:
        record = self._record(op, full, what, unit)
        if sizes is not None:                    # all_to_all: (S, bytes) of uneven splits
            record.size_bytes, record.bytes = sizes
        handle = Handle(work=None, record=record, started=time.perf_counter(), comm=self,
                        cuda=full.is_cuda, post=post)
        with _issuing(record):                   # labelled ranges in a --trace profile
            handle.work = call()
        if self.backend != "nccl":
            self._stamp_completion(handle)
        if self.link is not None:                # emulated network: done no sooner than the model
            handle.work = self.link.issue(handle.work, op, record.size_bytes, handle,
                                          ranks=self.ranks)
        handle.work = _waiting(handle.work, record)
        self._pending.append(handle)
        if not async_op:
            handle.wait()
        return handle

    # --- durations --------------------------------------------------------------------------
    def _stamp_completion(self, handle):
        """gloo: note when the op completes, where it runs (its future's done-callback runs on
        gloo's worker thread). Works without a future (gloo's reduce_scatter) are only seen
        complete when their owner's wait() returns: an upper bound (time_source "gloo_wait").
        (Waiting for them from a watcher thread races with the owner's wait: the result is
        copied out inside wait().)"""
        def stamp(*_, handle=handle):
            now = time.perf_counter()
            handle.completed_at = min(handle.completed_at or now, now)
        try:
            handle.work.get_future().add_done_callback(stamp)
        except RuntimeError:                # "Work::getFuture not implemented"
            handle.no_stamp = True

    def settle(self, block: bool = True):
        """Fill `time_s` (seconds) of the collectives issued so far, in issue order.

        block=True (once per step, and before the ledger is read): on CUDA one
        `torch.cuda.synchronize()`, on gloo a wait for ops nobody waited for; then every pending
        record gets its duration. block=False: settle only those already complete, without
        waiting (what `Handle.wait` does). A sub-group's Comms (`children`) are settled too.
        """
        for child in self.children:
            child.settle(block)
        if block and self._pending:
            if any(h.cuda for h in self._pending):
                torch.cuda.synchronize()
        while self._pending:
            h = self._pending[0]
            if self.backend == "nccl":
                if not (block or h.work.is_completed()):
                    return
                self._settle_nccl(h)
            else:
                if h.completed_at is None:
                    if not block:
                        return
                    watched_wait(h.work, self, h.record)    # nobody waited: now (no on_done)
                    h.completed_at = h.completed_at or time.perf_counter()
                self._settle_gloo(h)
            if h.done:                      # drop the Work and the tensors it references
                h.work = None               # (not before its owner waited: CUDA stream order)
            self._pending.pop(0)

    def _settle_nccl(self, h):
        get = getattr(h.work, "_get_duration", None) or getattr(h.work, "get_duration", None)
        try:
            h.record.time_s, h.record.time_source = get() / 1e3, "nccl"
        except Exception:  # noqa: BLE001 - timing off, or an older torch
            h.record.time_source = "none"

    def _settle_gloo(self, h):
        # gloo starts a group's ops in issue order on `gloo_threads` workers: an op starts at
        # its issue, after the previous op started, and once fewer than gloo_threads earlier
        # ops are still running (the gloo_threads-th latest earlier completion).
        k = self.gloo_threads
        busy_until = self._gloo_free[-k] if len(self._gloo_free) >= k else 0.0
        start = max(h.started, self._gloo_last_start, busy_until)
        h.record.time_s = max(h.completed_at - start, 0.0)
        h.record.issue_to_done_s = h.completed_at - h.started
        h.record.time_source = "gloo_wait" if h.no_stamp else "gloo"
        self._gloo_last_start = start
        # an upper-bound completion ("gloo_wait") would make later ops look as if they started
        # late; count it as no worker time instead (later ops' times may then be upper bounds)
        bisect.insort(self._gloo_free, h.started if h.no_stamp else h.completed_at)
        del self._gloo_free[:-k]

    def time_sources(self) -> list[str]:
        """The TIME_SOURCES keys of the settled records (usually one)."""
        return sorted({r.time_source for r in self.records if r.time_source})

    def bytes_by_op(self, step: int | None = None, what=("grads", "params")) -> dict[str, float]:
        """Per-rank ring bytes summed by op, for one step (or all) and the given `what` kinds."""
        out = {op: 0.0 for op in theory.RING_FACTOR if op != "all_to_all"}   # + any other used
        for r in self.records:
            if (step is None or r.step == step) and r.what in what:
                out[r.op] = out.get(r.op, 0.0) + r.bytes
        return out

    def to_json(self) -> list[dict]:
        """The ledger as a list of plain dicts (with algbw / busbw in bytes/s); settles first."""
        self.settle()
        return [{**asdict(r), "algbw": r.algbw, "busbw": r.busbw} for r in self.records]


