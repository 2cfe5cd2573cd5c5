"""The exercise checker's spy for `comm`, inside every rank: it records each collective a learner's
function starts (which of the unit's buffers, the line of the learner's file), starts it only when
the function returns or waits, and checks what was returned (a handle, not None). watch.py wraps
the learner's functions with it; diagnose.py holds what the findings are reported as.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

from .diagnose import Mistake, _same


def _file(fn) -> str:
    fn = inspect.unwrap(fn)                 # sandbox.marked's wrapper: the learner's function
    return getattr(getattr(fn, "__code__", None), "co_filename", "")


def _line(file: str):
    """The line of `file` (the learner's) on the call stack now, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == file:
            return frame.f_lineno
        frame = frame.f_back
    return None


def _holds_memory(t) -> bool:
    need = (t.storage_offset() + t.numel()) * t.element_size()
    return t.untyped_storage().nbytes() >= need


def _name(t, unit) -> str:
    """Which of `unit`'s buffers `t` is, in the learner's words ("unit.own(unit.param_flat)")."""
    if t is None:
        return "None"
    if not torch.is_tensor(t):
        return f"a {type(t).__name__}"
    sid = t.untyped_storage()._cdata
    for attr in ("grad_flat", "param_flat", "bucket", "grad_shard", "param_shard", "master",
                 "rs_out"):
        base = getattr(unit, attr, None)
        if not torch.is_tensor(base) or base.untyped_storage()._cdata != sid:
            continue
        lo = t.storage_offset() - base.storage_offset()
        hi = lo + t.numel()
        if lo == 0 and t.numel() == base.numel():
            return f"unit.{attr}"
        k = unit.shard_numel
        if base.numel() == unit.padded_numel and lo % k == 0 and t.numel() == k:
            r = lo // k
            return f"unit.own(unit.{attr})" if r == unit.rank else \
                f"rank {r}'s range of unit.{attr} ([{lo}:{hi}])"
        return f"unit.{attr}[{lo}:{hi}]"
    for attr in ("grad_flat", "param_flat", "bucket", "master", "param_shard", "grad_shard"):
        base = getattr(unit, attr, None)
        if (torch.is_tensor(base) and base.shape == t.shape and _holds_memory(base)
                and _same(base.detach(), t.detach())):
            return f"a copy of unit.{attr}"
    return "a tensor of your own (none of unit's buffers)"


class _Call:
    """One collective the learner's code started through the spy."""

    def __init__(self, op, roles, read, names, line, kw):
        self.op, self.roles, self.read, self.names, self.line, self.kw = op, roles, read, names, line, kw
        self.snapshot = None        # the input when the learner started it (async ops)
        self.real = None            # comm's Handle, once started
        self.issue = self.lazy = None


class _Lazy:
    """The handle the learner gets: its collective starts when the learner's function returns
    (or when it waits); `on_done` runs after the real wait, as on comm's own handle."""

    def __init__(self, spy, call):
        self._spy, self._call, self.on_done, self.done = spy, call, None, False

    def wait(self):
        if self.done:
            return
        self._spy._start_upto(self._call)
        self._call.real.wait()
        self.done = True
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()

    def __getattr__(self, attr):        # record, work, ...: comm's handle's
        if attr.startswith("_"):
            raise AttributeError(attr)
        self._spy._start_upto(self._call)
        return getattr(self._call.real, attr)


# what to do when a tensor changed while its collective was in flight, per learner function
IN_FLIGHT = {
    "all_reduce_bucket": "the sum may overwrite the change or meet it half-way: divide in "
                         "handle.on_done, which runs once the sum has arrived",
    "publish_update": "the other ranks then receive your range's OLD weights: copy unit.master "
                      "into unit.own(unit.param_flat) BEFORE starting the all_gather",
    "reduce_scatter_bucket": "leave unit.bucket as it is until the reduce_scatter is done: "
                             "divide your chunk and free the bucket in handle.on_done",
}
# what to do when a collective's tensor is None, per learner function
NONE_ARG = {
    "reduce_scatter_bucket": "unit.bucket was freed before its reduce_scatter read it: free it "
                             "(unit.bucket = None, p.grad = None) in handle.on_done",
    "gather_params": "keep unit.param_flat and unit.param_shard: free_params frees only the "
                     "memory of unit.param_flat (free_storage), never the tensors",
}


class _Spy:
    """Stands in for `comm` (zerolab.comm.Comm) while a learner's function runs: the same
    collectives, recorded, async ones started when the function returns (`flush`)."""

    def __init__(self, comm, unit, fname, file, notes):
        self._comm, self._unit, self._fname, self._file, self._notes = comm, unit, fname, file, notes
        self.calls: list[_Call] = []
        self.flagged = False        # a tensor changed while its collective was in flight

    def __getattr__(self, attr):    # rank, world_size, step, ...: comm's
        return getattr(self._comm, attr)

    def where(self, line) -> str:
        return f"{Path(self._file).name} line {line}" if line else self._fname

    # the collectives, with comm's signatures
    def all_reduce(self, tensor, *, what, unit="", async_op=False, op="sum"):
        return self._record("all_reduce", {"tensor": tensor}, tensor, None, async_op, {"op": op},
                            lambda a: self._comm.all_reduce(tensor, what=what, unit=unit,
                                                            async_op=a, op=op))

    def reduce_scatter(self, output, input, *, what, unit="", async_op=False):
        return self._record("reduce_scatter", {"output": output, "input": input}, input, output,
                            async_op, {}, lambda a: self._comm.reduce_scatter(
                                output, input, what=what, unit=unit, async_op=a),
                            check=lambda: self._comm._check_chunk(output, input, "reduce_scatter"))

    def all_gather(self, output, input, *, what, unit="", async_op=False):
        return self._record("all_gather", {"output": output, "input": input}, input, output,
                            async_op, {}, lambda a: self._comm.all_gather(
                                output, input, what=what, unit=unit, async_op=a),
                            check=lambda: self._comm._check_chunk(input, output, "all_gather"))

    def broadcast(self, tensor, src=0, *, what, unit="", async_op=False):
        return self._record("broadcast", {"tensor": tensor}, tensor, None, async_op, {},
                            lambda a: self._comm.broadcast(tensor, src, what=what, unit=unit,
                                                           async_op=a))

    def _record(self, op, roles, read, write, async_op, kw, issue, check=None):
        line = _line(self._file)
        names = {role: _name(t, self._unit) for role, t in roles.items()}
        here = self.where(line)
        for role, t in roles.items():
            if t is None:
                raise Mistake(self._fname, f"passes None as the {role} of comm.{op} ({here}): "
                              + NONE_ARG.get(self._fname, "pass the tensor itself"))
            if torch.is_tensor(t) and not _holds_memory(t):
                if names[role] == "unit.param_flat" and role == "output":
                    fix = ("give it its memory back first, alloc_storage(unit.param_flat) "
                           "(free_params released it)")
                elif names[role] == "unit.param_shard":
                    fix = "free_params must keep unit.param_shard, this rank's only copy"
                else:
                    fix = "that memory was freed"
                raise Mistake(self._fname, f"calls comm.{op} ({here}) with {names[role]} as "
                              f"{role} while it holds no memory: {fix}")
        if check is not None:
            check()                 # comm's own size check, at the learner's line
        call = _Call(op, roles, read, names, line, kw)
        call.issue = issue
        self.calls.append(call)
        lazy = call.lazy = _Lazy(self, call)
        if not async_op:            # blocking: start what came before, then this one, now
            self._start_upto(call)
            call.real.wait()
            lazy.done = True
            return lazy
        call.snapshot = read.detach().clone()
        if (write is not None and write.is_floating_point()
                and write.untyped_storage()._cdata != read.untyped_storage()._cdata):
            write.detach().fill_(float("nan"))   # undefined until the collective is done
        return lazy

    def _start_upto(self, last):
        for call in self.calls:
            if call.real is None:
                self._start(call)
            if call is last:
                return

    def _start(self, call):
        if call.snapshot is not None:
            now = call.read
            if not _holds_memory(now) or not _same(now.detach(), call.snapshot):
                self.flagged = True
                text = (f"your {self._fname} {'freed' if not _holds_memory(now) else 'changed'} "
                        f"{call.names[_input(call)]} after starting its {call.op} "
                        f"({self.where(call.line)}), before it finished: "
                        + IN_FLIGHT.get(self._fname, "wait for it first"))
                if not _holds_memory(now):
                    raise Mistake(self._fname, text)
                self._notes.add(self._fname, text)
            call.snapshot = None
        call.real = call.issue(True)

    def flush(self):
        """Start every collective the learner's function started (it has returned)."""
        if self.calls:
            self._start_upto(self.calls[-1])


def _input(call) -> str:
    return "input" if "input" in call.roles else "tensor"


class _Done:
    """What the wrapper returns in place of the learner's handle: waits for it (or, when the
    learner returned none, for every collective it started), then checks the result."""

    def __init__(self, handles, after):
        self.handles, self.after, self.done, self.on_done = handles, after, False, None

    def wait(self):
        if self.done:
            return
        self.done = True
        for h in self.handles:
            h.wait()
        self.after()
        if self.on_done is not None:
            self.on_done()


WAITER = {"all_reduce_bucket": "backward waits for it before the optimizer step",
          "publish_update": "the step waits for it before the weights are used",
          "reduce_scatter_bucket": "backward waits for it (and runs its on_done)"}


def _returned(returned, spy, notes, after):
    """The learner's handle, checked: a missing one is named before zerolab calls .wait() on it
    (the wrapper then waits for every collective the function started, so the run goes on)."""
    fname = spy._fname
    if isinstance(returned, _Lazy):
        return _Done([returned], after)
    if not spy.calls:
        notes.add(fname, f"your {fname} started no collective through comm: use comm's "
                  f"collective, whose handle is what {fname} returns")
        return _Done([returned] if hasattr(returned, "wait") else [], after)
    what = "None" if returned is None else f"a {type(returned).__name__}, not the handle"
    first = spy.calls[0]
    notes.add(fname, f"your {fname} returned {what}: return the handle that comm.{first.op}(...) "
              f"gave you ({spy.where(first.line)}); " + WAITER.get(fname, "zerolab waits for it"))
    return _Done([c.lazy for c in spy.calls], after)


