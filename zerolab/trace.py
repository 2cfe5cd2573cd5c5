"""Traces: one step of a rank as a Chrome / Perfetto timeline, every collective labelled.

Idea: `torch.profiler` records every op a rank runs; on gloo it records nothing about the
collectives themselves. So `Comm` puts a named range around each collective's issue and another
around the wait for it, labelled with its ledger record (op, what, unit, phase), e.g.
"wait all_gather params block.3 [forward]". Open OUT/stage{S}/trace_rank{r}.json in
https://ui.perfetto.dev or chrome://tracing: the forward / backward / step ranges, the compute ops
inside them and the waits for communication lie side by side; with the link emulator
(`--link-gbps`) the waits show the time on the wire that compute did not hide.

    python -m zerolab train --stage 3 --preset tiny --trace --link-gbps 1

The ranges cost nothing when no profiler is running (the check is one attribute read).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.autograd.profiler as _autograd_profiler
from torch.profiler import ProfilerActivity, profile, record_function


def _enabled() -> bool:
    return bool(_autograd_profiler._is_profiler_enabled)


def label(record) -> str:
    """"all_gather params block.3 [forward]": a comm.Record as a trace label."""
    return f"{record.op} {record.what} {record.unit or '-'} [{record.phase}]".replace("  ", " ")


@contextlib.contextmanager
def issuing(record):
    """A range "issue LABEL" around the call that starts a collective (when profiling)."""
    if not _enabled():
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


def waiting(work, record):
    """`work` itself, or a LabelledWork when a profiler is recording."""
    return LabelledWork(work, f"wait {label(record)}") if _enabled() and work is not None else work


def phase(name: str):
    """A range named `name` (forward / backward / step) when profiling, else nothing."""
    return record_function(name) if _enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def chrome_trace(path, device: torch.device, enabled: bool = True):
    """Profile the block (CPU, plus CUDA on a GPU) and write a Chrome trace JSON to `path`."""
    if not enabled:
        yield None
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield prof
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
