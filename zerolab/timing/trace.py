"""Traces: one step of a rank as a Chrome / Perfetto timeline, every collective labelled.

Idea: `torch.profiler` records every op a rank runs; on gloo it records nothing about the
collectives themselves. So `Comm` puts a named range around each collective's issue and another
around the wait for it, labelled with its ledger record (op, what, unit, phase), e.g.
"wait all_gather params block.3 [forward]". Open OUT/stage{S}/trace_rank{r}.json in
https://ui.perfetto.dev or chrome://tracing: the forward / backward / step ranges, the compute ops
inside them and the waits for communication lie side by side; with the link emulator
(`--link-gbps`) the waits show the time on the wire that compute did not hide.

    python -m zerolab train --stage 3 --preset tiny --trace --link-gbps 1

With `--trace` each block's compute is named too ("forward block.3", "backward block.3":
`UnitRanges`), and the file carries zerolab's own metadata (run, stage, rank, step, and which
ledger records were issued while it recorded), so that `spans(path)` reads a trace back as one
list of compute ranges and labelled collectives and `check_labels` holds it against the ledger:

    from zerolab.timing import trace
    for s in trace.spans("runs/x/stage2/trace_rank0.json"): print(s.kind, s.name, s.dur_s)

The ranges cost nothing when no profiler is running (the check is one attribute read).
"""
from __future__ import annotations

import contextlib
import json
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..comm import LabelledWork, label  # noqa: F401 - the labels Comm puts on each collective
from ..comm import profiling as _enabled


def phase(name: str):
    """A range named `name` (forward / backward / step) when profiling, else nothing."""
    return record_function(name) if _enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def chrome_trace(path, device: torch.device, enabled: bool = True, comm=None, **meta):
    """Profile the block (CPU, plus CUDA on a GPU) and write a Chrome trace JSON to `path`.

    meta: JSON-able values stored in the trace under "zerolab" (e.g. run_id, stage, rank, step);
    with `comm` (a comm.Comm) also "seq_from" / "seq_to": the ledger records issued while the
    profiler recorded are those with seq_from <= seq < seq_to (`metadata`, `traced_records`)."""
    if not enabled:
        yield None
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    first = len(comm.records) if comm is not None else None
    with profile(activities=activities) as prof:
        yield prof
        if comm is not None:
            meta.update(seq_from=first, seq_to=len(comm.records))
        prof.add_metadata_json(META_KEY, json.dumps(meta))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    _blocks_on_their_own_track(path)


BLOCK_TID = 4194304 + 1         # above Linux's largest thread id (pid_max 2^22): no real thread's


def _blocks_on_their_own_track(path: Path):
    """Move the block ranges (UnitRanges) of a Chrome trace to a track of their own, "zerolab:
    blocks", next to the thread that ran them. A backward block range starts and ends inside
    autograd's `evaluate_function` ranges (tensor hooks run there), so on the thread's own track
    it would overlap them without nesting, which trace viewers draw badly or drop."""
    data = json.loads(path.read_text())
    events, moved = data.get("traceEvents", []), set()
    for e in events:
        if e.get("ph") == "X" and _BLOCK.match(e.get("name", "")) and e.get("cat") == "user_annotation":
            moved.add((e.get("pid"), e.get("tid")))
            e["tid"] = BLOCK_TID
    if not moved:
        return
    for pid, tid in sorted(moved, key=str):
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": BLOCK_TID,
                    "args": {"name": "zerolab: blocks (forward / backward of each unit)"}},
                   {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": BLOCK_TID,
                    "args": {"sort_index": tid - 1 if isinstance(tid, int) else 0}}]
    path.write_text(json.dumps(data))


# --- each block's compute, named -------------------------------------------------------------
class UnitRanges:
    """Name each unit's compute in a trace: "forward block.3" from the block's forward pre-hook
    to its forward hook, "backward block.3" from the moment the gradient of its output arrives to
    the moment the gradient of its input is complete (tensor hooks: the autograd graph is not
    changed). Consecutive backward ranges touch, they never overlap. In the written trace they
    lie on a track of their own, "zerolab: blocks" (`chrome_trace`).

    units: [(name, module)] (model.zero_units()). Make it *after* the strategy: its forward
    pre-hook then runs after ZeRO-3's gather (the gather lies before the block's range), its
    forward hook before ZeRO-3's free, and in backward a block's range ends before ZeRO-3's
    pre-backward gather of the next block and starts after it. Does nothing unless a profiler
    is recording. `remove()` takes the hooks away."""

    def __init__(self, units):
        self.open = None                    # the backward range in progress (a record_function)
        self.forward = None                 # the forward range in progress
        self.last_output = None             # weakref to the last unit output that has our hooks
        self.handles = []
        for name, module in units:
            self.handles += [
                module.register_forward_pre_hook(lambda m, args, name=name: self._pre(name, args)),
                module.register_forward_hook(lambda m, a, out, name=name: self._post(name, out),
                                             prepend=True),
                module.register_forward_hook(lambda m, a, out, name=name: self._post_last(name, out))]

    @staticmethod
    def _grad_tensor(x):
        return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()

    def _pre(self, name, args):
        if not _enabled():
            return
        x = args[0] if args else None
        previous = self.last_output() if self.last_output is not None else None
        if self._grad_tensor(x) and x is not previous:
            x.register_hook(self._ends_backward)        # first unit: its input ends its backward
        self.forward = record_function(f"forward {name}").__enter__()

    def _post(self, name, out):             # runs first among the unit's forward hooks
        if not _enabled():
            return
        if self.forward is not None:
            self.forward.__exit__(None, None, None)
            self.forward = None
        if self._grad_tensor(out):
            out.register_hook(self._ends_backward)      # before any other hook on the output

    def _post_last(self, name, out):        # runs last: its tensor hook fires after the others'
        if not _enabled() or not self._grad_tensor(out):
            return
        out.register_hook(lambda grad, name=name: self._starts_backward(name))
        self.last_output = weakref.ref(out)

    def _ends_backward(self, grad):
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None

    def _starts_backward(self, name):
        self._ends_backward(None)
        self.open = record_function(f"backward {name}").__enter__()

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.last_output = None


# --- reading a trace back ----------------------------------------------------------------------
META_KEY = "zerolab"
PHASE_RANGES = ("forward", "backward", "step")
KINDS = ("phase", "block", "issue", "wait", "run")
_COLLECTIVE = re.compile(r"^(issue|wait) (\S+)(?: (\S+))? (\S+) \[(\w+)\]$")
_BLOCK = re.compile(r"^(forward|backward) (\S+)$")
# what a collective runs as where the trace sees it: gloo's worker thread ("gloo:all_reduce";
# gloo runs reduce_scatter as an all_reduce) or an NCCL kernel on the GPU
_RUNS_AS = {"all_reduce": ("all_reduce",), "reduce_scatter": ("reduce_scatter", "all_reduce"),
            "all_gather": ("all_gather",), "broadcast": ("broadcast",)}
_NCCL = {"AllReduce": "all_reduce", "ReduceScatter": "reduce_scatter", "AllGather": "all_gather",
         "Broadcast": "broadcast"}


@dataclass(frozen=True)
class Span:
    """One range of a trace. Times in seconds on the trace's clock (the host's steady clock, so
    the traces of ranks on one host line up); `end_s` = start_s + dur_s.

    kind: "phase" (the forward / backward / step range of the training loop), "block" (one
    unit's compute, UnitRanges), "issue" (the call that starts a collective), "wait" (the
    rank's thread blocked until the collective is done) or "run" (the collective itself where
    it executes: a gloo worker thread, or an NCCL kernel on the GPU).
    phase: forward / backward / step (a collective's: its ledger phase). op / what / unit: the
    collective's ledger record ("" for compute; a block's unit, e.g. "block.3"). index: the
    collective's place in the trace's issue order (issue, wait and run of one collective share
    it; None for compute). thread: the trace's tid."""
    kind: str
    name: str
    start_s: float
    dur_s: float
    phase: str
    op: str = ""
    what: str = ""
    unit: str = ""
    index: int | None = None
    thread: int | str = 0

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def parse_label(name: str) -> dict | None:
    """"wait all_gather params block.3 [forward]" -> {kind, op, what, unit, phase}; None when
    `name` is not a collective's range (the inverse of `label`, with "issue " / "wait ")."""
    m = _COLLECTIVE.match(name)
    if not m:
        return None
    kind, op, what, unit, phase = m.groups()
    if what is None:                        # a record without `what`: "all_reduce block.0 [step]"
        what = ""
    return {"kind": kind, "op": op, "what": what, "unit": "" if unit == "-" else unit,
            "phase": phase}


def _load(path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no trace at {str(path)!r}: launch with trace=True "
                                "(`--trace`)") from None
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{str(path)!r} is not a Chrome trace (no traceEvents)")
    return data


def metadata(path) -> dict:
    """The "zerolab" metadata a `--trace` file carries: run_id, stage, rank, step (the traced
    step), seq_from / seq_to (see chrome_trace); {} for a trace written without it."""
    value = _load(path).get(META_KEY) or {}
    return json.loads(value) if isinstance(value, str) else dict(value)


def keep(event: dict) -> bool:
    """Whether `spans` reads this Chrome trace event (what a cut trace must keep)."""
    if event.get("ph") != "X":
        return False
    name = event.get("name", "")
    return (name in PHASE_RANGES or bool(_BLOCK.match(name)) or bool(_COLLECTIVE.match(name))
            or name.startswith("gloo:") or (event.get("cat") == "kernel" and "nccl" in name.lower()))


def _nccl_op(name: str) -> str | None:
    for key, op in _NCCL.items():
        if key in name:
            return op
    return None


def spans(path) -> list[Span]:
    """Read a `--trace` file (OUT/stage{S}/trace_rank{r}.json) back: every compute range
    (forward / backward / step, and each block's forward / backward when present) and every
    labelled collective (its issue and its wait, and where it ran when the trace shows it), in
    time order. Raises FileNotFoundError / ValueError for a missing file / not a Chrome trace.

    A collective's k-th wait range is matched to its k-th issue range of the same label; its
    "run" range is matched in issue order (gloo starts a group's collectives in issue order on
    its worker threads, NCCL runs them in issue order on its stream) and only when the number
    and kind of the runs agree with the issues, else no "run" spans are returned."""
    events = sorted((e for e in _load(path)["traceEvents"] if keep(e)), key=lambda e: e["ts"])
    out, issues, runs, waits = [], [], [], []
    for e in events:
        name, start, dur = e["name"], e["ts"] / 1e6, e.get("dur", 0) / 1e6
        tid = e.get("tid", 0)
        if name in PHASE_RANGES:
            out.append(Span("phase", name, start, dur, name, thread=tid))
        elif (m := _BLOCK.match(name)):
            out.append(Span("block", name, start, dur, m.group(1), unit=m.group(2), thread=tid))
        elif (c := parse_label(name)):
            (issues if c["kind"] == "issue" else waits).append((e, c))
        elif name.startswith("gloo:"):
            runs.append((e, name[len("gloo:"):]))
        elif (op := _nccl_op(name)):
            runs.append((e, op))
    seen = {}
    for i, (e, c) in enumerate(issues):
        label_ = e["name"][len("issue "):]
        seen.setdefault(label_, []).append(i)
        out.append(Span("issue", e["name"], e["ts"] / 1e6, e.get("dur", 0) / 1e6, c["phase"],
                        c["op"], c["what"], c["unit"], i, e.get("tid", 0)))
    taken = {}
    for e, c in waits:
        label_ = e["name"][len("wait "):]
        k = taken.get(label_, 0)
        taken[label_] = k + 1
        owners = seen.get(label_, [])
        index = owners[min(k, len(owners) - 1)] if owners else None
        out.append(Span("wait", e["name"], e["ts"] / 1e6, e.get("dur", 0) / 1e6, c["phase"],
                        c["op"], c["what"], c["unit"], index, e.get("tid", 0)))
    if len(runs) == len(issues) and all(ran in _RUNS_AS.get(c["op"], ()) for (_, c), (_, ran)
                                        in zip(issues, runs)):
        for i, ((e, ran), (_, c)) in enumerate(zip(runs, issues)):
            out.append(Span("run", e["name"], e["ts"] / 1e6, e.get("dur", 0) / 1e6, c["phase"],
                            c["op"], c["what"], c["unit"], i, e.get("tid", 0)))
    return sorted(out, key=lambda s: (s.start_s, KINDS.index(s.kind)))


def traced_records(result: dict, meta: dict) -> list[dict]:
    """The ledger records (rank JSON `result`) issued while the profiler recorded, in issue
    order: seq_from <= seq < seq_to of the trace's metadata. ValueError when the trace has no
    such metadata or belongs to another run / stage / rank."""
    if "seq_from" not in meta:
        raise ValueError("this trace has no zerolab metadata (seq_from / seq_to): it was not "
                         "written by `zerolab train --trace` of this version")
    for key in ("run_id", "stage", "rank"):
        if key in meta and meta[key] != result.get(key):
            raise ValueError(f"the trace is of {key} {meta[key]!r}, the rank JSON of "
                             f"{result.get(key)!r}")
    return sorted((r for r in result["comm"]["records"]
                   if meta["seq_from"] <= r["seq"] < meta["seq_to"]), key=lambda r: r["seq"])


def check_labels(path, result: dict) -> dict[str, dict[str, int]]:
    """Hold a trace against its rank's ledger: every ledger record issued while the profiler
    recorded has exactly one issue range and one wait range with its op / what / unit / phase,
    in the ledger's issue order, and the trace has no other collective. Returns, per op, the
    counts {"ledger": n, "issue": n, "wait": n}; raises AssertionError naming the first record
    that differs."""
    records = traced_records(result, metadata(path))
    got = spans(path)
    issued = [s for s in got if s.kind == "issue"]
    key = lambda x: (x["op"], x["what"], x["unit"], x["phase"])  # noqa: E731
    want = [key(r) for r in records]
    have = [key(s.__dict__) for s in issued]
    if want != have:
        first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        raise AssertionError(f"collective #{first}: ledger {want[first] if first < len(want) else None}, "
                             f"trace {have[first] if first < len(have) else None} "
                             f"({len(want)} in the ledger, {len(have)} issue ranges in the trace)")
    waits = {}
    for s in got:
        if s.kind == "wait":
            waits[s.index] = waits.get(s.index, 0) + 1
    missing = [i for i in range(len(issued)) if waits.get(i) != 1]
    if missing:
        raise AssertionError(f"collective {want[missing[0]]} has {waits.get(missing[0], 0)} wait "
                             "ranges in the trace, not 1")
    counts = {}
    for kind, ops in (("ledger", [r["op"] for r in records]),
                      ("issue", [s.op for s in issued]),
                      ("wait", [s.op for s in got if s.kind == "wait"])):
        for op in ops:
            counts.setdefault(op, {"ledger": 0, "issue": 0, "wait": 0})[kind] += 1
    return counts
