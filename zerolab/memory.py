"""Measured memory: the bytes each rank really holds, by category, and their peaks within a step.

Idea: a strategy knows which tensors hold which state (`state_tensors()`); the meter sums the
bytes of their distinct storages at named points of the step (after each bucket's
reduce-scatter, each block's all-gather and free, ...), keeping the current value, the peak and a
timeline per category. That is the "measured" column next to `theory.model_state_bytes`. An
independent figure comes from the allocator: `torch.cuda.max_memory_allocated` on GPU; on CPU
`torch.distributed._tools.mem_tracker.MemTracker`'s peak, which also sees activations and
temporaries the meter does not.

Categories (bytes): params, grads, master_weights, exp_avg, exp_avg_sq (the five model states of
`theory.STATES`), plus the transients that live only inside a step: gathered_params (ZeRO-3's
full blocks while gathered), grad_buckets (ZeRO-2/3's full-gradient buckets while in flight),
reduce_scatter_out (their [Ψ_u/N] outputs until added into the gradient shard) and grad_fp32 (the fp32 gradient copies that AdamW reads
inside the optimizer step when gradients are bf16: `theory.grad_copy_bytes`). The strategies
sample inside the step too (after the fp32 copies, after the update), so the peak of the step
(`peak_by_phase["step"]`) is `theory.peak_step_bytes`. Not categorised: AdamW's per-parameter
temporaries (one parameter's worth at a time), gradient-norm scalars, the loss all_reduce's scalar.

Cost: a sample walks every storage of `state_tensors()`, and the strategies sample 10-47 times a
step (more units, more samples): 1-8% of a step on the `tiny` and `small` GPTs (measured by
`zerolab bench --meter-cost`). So the meter samples only where a measurement needs it:
`zerolab train` reports the last step's memory and keeps the meter idle (`enabled = False`,
`sample` returns at once: < 0.2% of a step) in the others.
"""
from __future__ import annotations

import contextlib
import time

import torch

from . import theory
from .sharding import storage_bytes

TRANSIENT = ("grad_buckets", "gathered_params", "grad_fp32",   # come and go within a step
             "reduce_scatter_out")
HOST = "host_"      # categories in host memory (zerolab.variants.offload): totals and peaks of their own


class MemoryMeter:
    """Samples a strategy's tensors by category. `timeline` rows: (tag, seconds, {cat: bytes});
    `peak_by_phase`: {phase of the strategy's comm (forward / backward / step ...): peak total}.
    Totals and peaks are the device's: categories named "host_..." (ZeRO-Offload's host
    memory) are summed into `peak_host_total` instead. `enabled = False`: `sample` does
    nothing (a step whose memory nobody reads)."""

    def __init__(self, record_timeline: bool = False, enabled: bool = True):
        self.enabled = enabled
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.peak_total = self.peak_host_total = 0
        self.peak_by_phase: dict[str, int] = {}
        self.timeline: list[tuple[str, float, dict]] = []
        self.record_timeline = record_timeline
        self.t0 = time.perf_counter()

    def sample(self, strategy, tag: str = ""):
        """Measure `strategy.state_tensors()` now; update current, peaks and the timeline.
        Nothing when the meter is not `enabled`."""
        if not self.enabled:
            return
        self.current = {cat: storage_bytes(ts) for cat, ts in strategy.state_tensors().items()}
        for cat, b in self.current.items():
            self.peak[cat] = max(self.peak.get(cat, 0), b)
        total = sum(b for cat, b in self.current.items() if not cat.startswith(HOST))
        self.peak_total = max(self.peak_total, total)
        self.peak_host_total = max(self.peak_host_total, sum(self.current.values()) - total)
        phase = getattr(getattr(strategy, "comm", None), "current_phase", "setup")
        self.peak_by_phase[phase] = max(self.peak_by_phase.get(phase, 0), total)
        if self.record_timeline:
            self.timeline.append((tag, time.perf_counter() - self.t0, dict(self.current)))

    def reset_peaks(self):
        """Start a new window for peaks (and the timeline)."""
        self.peak, self.timeline = dict(self.current), []
        self.peak_total = sum(b for cat, b in self.current.items() if not cat.startswith(HOST))
        self.peak_host_total = sum(self.current.values()) - self.peak_total
        self.peak_by_phase = {}
        self.t0 = time.perf_counter()

    def to_json(self) -> dict:
        return {"current": dict(self.current), "peak": dict(self.peak), "peak_total": self.peak_total,
                "peak_host_total": self.peak_host_total, "peak_by_phase": dict(self.peak_by_phase),
                "timeline": [{"tag": t, "t": s, **c} for t, s, c in self.timeline]}


def allocator_peak(run_step, device: torch.device, external=(), *, micro_steps=False) -> dict:
    """Run `run_step()` once and return the allocator's view of it, independent of the meter.

    micro_steps=True: `run_step(next_forward)` is called instead, and must call `next_forward()`
    before every forward pass after the first (gradient accumulation). MemTracker follows one
    forward per module and refuses a second ("multiple iterative calls"); next_forward clears
    its per-module statistics, which this function does not read, and keeps the peak.

    CUDA: {"source": "torch.cuda", "peak_allocated": max_memory_allocated - baseline,
    "allocated_before", "peak_absolute", "reserved"} in bytes. CPU: MemTracker's peak over the step
    {"source": "MemTracker", "peak_absolute", "by_type": {type: bytes}}; MemTracker counts every live
    CPU tensor it can see: those created during the step, plus `external` (the model, the
    optimizer and the strategy's flat buffers, created before the step).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step(lambda: None) if micro_steps else run_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"source": "torch.cuda", "allocated_before": before, "peak_absolute": peak,
                "peak_allocated": peak - before, "reserved": torch.cuda.memory_reserved(device),
                "device": cuda_memory_figures(device)}
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        run_step(tracker.reset_mod_stats) if micro_steps else run_step()
    snap = tracker.get_tracker_snapshot("peak")
    by_type: dict[str, int] = {}
    for dev, stats in snap.items():
        if str(dev) == "cpu" or getattr(dev, "type", "") == "cpu":
            for k, v in stats.items():
                by_type[str(k).split(".")[-1]] = int(v)
    total = by_type.pop("Total", by_type.pop("total", sum(by_type.values())))
    return {"source": "MemTracker", "peak_absolute": total, "by_type": by_type}


def transient_peak(fn, device: torch.device, external=()):
    """Run `fn()`; return (its result, the peak bytes above what was allocated before the call):
    torch.cuda's max_memory_allocated - memory_allocated before, or on CPU MemTracker's peak
    total minus its total on entry, with `external` (the model, optimizer, strategy buffers:
    tensors created before the call) registered so that touching them is not counted as new.
    Used for the checkpoint saves: what a save costs in memory on top of training."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        value = fn()
        torch.cuda.synchronize(device)
        return value, torch.cuda.max_memory_allocated(device) - before
    from torch.distributed._tools.mem_tracker import MemTracker

    def total(kind):
        snap = tracker.get_tracker_snapshot(kind)
        return sum(int(v) for dev, stats in snap.items() if str(dev) == "cpu"
                   for k, v in stats.items() if str(k).split(".")[-1].lower() == "total")
    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        before = total("current")
        value = fn()
    return value, total("peak") - before


# What each CUDA figure includes (printed next to them by labs/gpu_check.py).
CUDA_FIGURES = {
    "max_allocated": "torch.cuda.max_memory_allocated: peak bytes of live tensors from torch's "
                     "caching allocator (model states, activations, temporaries); not NCCL's own "
                     "buffers, not the CUDA context, not the allocator's cached free blocks",
    "reserved": "torch.cuda.memory_reserved: bytes the caching allocator holds from the driver "
                "(allocated + cached free blocks + fragmentation)",
    "max_reserved": "torch.cuda.max_memory_reserved: its peak",
    "device_used": "total - free of torch.cuda.mem_get_info: everything on the GPU, from every "
                   "process: reserved + CUDA context + NCCL buffers + other processes",
}


def cuda_memory_figures(device) -> dict:
    """Bytes on one CUDA device, from the allocator and from the driver (see CUDA_FIGURES):
    {"allocated", "max_allocated", "reserved", "max_reserved", "device_free", "device_total",
    "device_used"}. CUDA only; call after a synchronize."""
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "max_reserved": torch.cuda.max_memory_reserved(device),
            "device_free": free, "device_total": total, "device_used": total - free}


SNAPSHOT_MAX_ENTRIES = 200_000


@contextlib.contextmanager
def cuda_memory_history(max_entries: int = SNAPSHOT_MAX_ENTRIES):
    """Record the CUDA caching allocator's history inside the block; yields a dict that holds,
    once the block ends, "snapshot": torch's snapshot dict (`torch.cuda.memory._snapshot()`)
    plus "zerolab": {"allocated_at_start", "allocated_at_end" (bytes), "max_entries"}: the
    history keeps only the last `max_entries` events, and blocks allocated before recording
    began are freed inside it, so a plot needs both. The training run writes it as JSON
    (OUT/stage{S}/rank{r}_snapshot.json), which `zerolab.course.timeplots.cuda_snapshot` draws
    offline with matplotlib (torch's HTML viewer needs the internet); JSON, not torch's
    `_dump_snapshot` pickle: reading a snapshot must never unpickle (run) a file someone else
    put there. CUDA only."""
    start = torch.cuda.memory_allocated()
    record: dict = {}
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield record
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        snap["zerolab"] = {"allocated_at_start": start, "max_entries": max_entries,
                           "allocated_at_end": torch.cuda.memory_allocated()}
        record["snapshot"] = snap


def padding_bytes(units, stage: int, precision: str = "bf16", grad_dtype=None,
                  states: str = "fp32", rounding: str = "nearest") -> dict[str, int]:
    """Bytes of padding this rank holds inside each model state: the zeros that round every unit
    up to a multiple of N. Replicated buffers carry (padded_numel - numel) of them, shards only
    the part of the padding that falls in this rank's range (the last ranks). Included in the
    measured bytes; `theory.model_state_bytes` at the padded Ψ counts them too. states,
    rounding: the optimizer's low-precision rung (`theory.bytes_per_param`)."""
    per = theory.bytes_per_param(precision, grad_dtype, states, rounding)
    return {state: sum((u.padding_in_shard() if theory.is_sharded(state, stage)
                        else u.padded_numel - u.numel) * per[state] for u in units)
            for state in theory.STATES}
