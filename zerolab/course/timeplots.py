"""The course's figures of time: one step's collectives and memory, per-rank traces, CUDA allocator
snapshots (lab 3), the cost model's curves (notebook 12) and measured step time by stage (lab 6).

Idea: as in `plots`, a figure is drawn from the ranks' JSON files (or the cost model's results),
never from the kernel's own memory, in the course's colours (`plots.COLLECTIVE_COLORS`: one colour
per collective across the course).

    fig = timeplots.step_trace("runs/labs/lab3_step_timeline"); plots.save(fig, out, "trace")
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt

from .. import theory
from ..memory import TRANSIENT
from .plots import (COLLECTIVE_COLORS, FONT, MB, PHASE_COLORS, STATE_COLORS, has_label,
                    legend_below, run_title)
from .results import step_records, step_timeline, unit_bytes


# --- lab 3 ---------------------------------------------------------------------------------------
def collective_timeline(runs: dict[int, list[dict]], rank: int = 0):
    """One lane per stage: the collectives of the last step in issue order (boxes coloured by
    op, labelled by bucket / block), over the phase they ran in."""
    stages = sorted(runs)
    fig, ax = plt.subplots(figsize=(15, 1.6 + 0.9 * len(stages)))
    right = 0                    # boxes sit at seq - first: the skipped metric records leave gaps
    for lane, s in enumerate(stages):
        recs = step_records(runs[s][rank])
        y = len(stages) - 1 - lane
        first = recs[0]["seq"] if recs else 0
        for x in recs:
            i = x["seq"] - first
            right = max(right, i + 1)
            ax.add_patch(plt.Rectangle((i, y - 0.42), 1, 0.84, color=PHASE_COLORS[x["phase"]], zorder=0))
            ax.barh(y, 0.9, left=i + 0.05, height=0.5, color=COLLECTIVE_COLORS[x["op"]],
                    label=x["op"] if not has_label(ax, x["op"]) else None)
            ax.text(i + 0.5, y, x["unit"].replace("block.", "b"), ha="center", va="center",
                    fontsize=FONT - 1, color="white")
            ax.text(i + 0.5, y - 0.4, x["phase"][0], ha="center", va="bottom", fontsize=FONT - 1, color="0.3")
    ax.set_yticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in reversed(stages)], fontsize=FONT)
    ax.set_xlim(0, right + 0.2)
    ax.tick_params(axis="x", labelsize=FONT)
    ax.set_xlabel("collectives of one step, in issue order (background / small letter: "
                  "f = forward, b = backward, s = step)", fontsize=FONT)
    ax.set_title(f"one training step, rank {rank}: {run_title(runs)}", fontsize=FONT + 1)
    legend_below(ax, ncol=4, offset=-0.16 if len(stages) > 2 else -0.35)
    fig.tight_layout()
    return fig


def memory_timeline(runs: dict[int, list[dict]], stages=(2, 3), rank: int = 0):
    """Stacked bytes of each category at every sample of the last step (x: sample, labelled by
    its tag), one panel per stage; the dark line is the total. A category that stays at zero
    in a panel is neither drawn nor listed in its legend."""
    stages = [s for s in stages if s in runs]
    fig, axes = plt.subplots(len(stages), 1, figsize=(15, 4.4 * len(stages)), squeeze=False)
    for ax, s in zip(axes[:, 0], stages):
        tl = step_timeline(runs[s][rank])
        xs = range(len(tl))
        cats = [c for c in (*theory.STATES, *TRANSIENT) if any(row.get(c, 0) for row in tl)]
        ys = [[row.get(c, 0) / MB for row in tl] for c in cats]
        colors = [STATE_COLORS[c] for c in cats]
        polys = ax.stackplot(xs, ys, labels=cats, colors=colors, step="post", alpha=0.8)
        for poly, c in zip(polys, cats):
            if c in TRANSIENT:
                poly.set_hatch("xx")
                poly.set_alpha(0.45)
        ax.plot(xs, [sum(col) for col in zip(*ys)], color="0.2", lw=1, drawstyle="steps-post",
                label="total")
        ax.set_xticks(list(xs), [row["tag"] for row in tl], rotation=70, fontsize=FONT - 1, ha="right")
        ax.tick_params(axis="y", labelsize=FONT)
        ax.set_ylabel("MB", fontsize=FONT)
        ax.set_title(f"{theory.STAGE_NAMES[s]}: bytes held by rank {rank} over one step "
                     f"(units: {', '.join(f'{k} {v:,} B' for k, v in unit_bytes(runs[s][rank]).items())})",
                     fontsize=FONT + 1)
        ax.legend(fontsize=FONT, loc="upper left", bbox_to_anchor=(1.005, 1), frameon=False)
    fig.tight_layout()
    return fig


LIVE_BLOCK_STATES = ("active_allocated", "active_pending_free")


COMPUTE_GREYS = {"phase": "0.85", "block": "0.55"}   # a phase's range, a block's compute


def step_trace(out, stages=(2, 3), ranks=None):
    """Lab 3: one traced step per rank as a Gantt chart, from the `--trace` files
    OUT/stage{S}/trace_rank{r}.json (zerolab.timing.trace.spans). One panel per stage, two lanes per
    rank on one clock (ms from the first rank's forward): "compute" - the forward / backward /
    step ranges in light grey, each block's compute in dark grey (f0, b1: forward / backward of
    block.0 / block.1), the rank's thread blocked in a collective's wait hatched in its colour;
    "collectives" - each collective where it ran (gloo's worker thread, an NCCL kernel) in its
    colour, a tick where it was issued (its issue-to-wait range, pale, when the trace does not
    show where it ran). Raises FileNotFoundError when a stage has no trace."""
    from matplotlib.patches import Patch
    from ..timing import trace
    out = Path(out)
    stages = list(stages)
    fig, axes = plt.subplots(len(stages), 1, figsize=(15, 0.6 + 2.3 * len(stages)), squeeze=False)
    drawn_ops, meta = set(), {}
    for ax, stage in zip(axes[:, 0], stages):
        paths = sorted((out / f"stage{stage}").glob("trace_rank*.json"),
                       key=lambda p: int(p.stem[len("trace_rank"):]))
        if ranks is not None:
            paths = [p for p in paths if int(p.stem[len("trace_rank"):]) in ranks]
        if not paths:
            raise FileNotFoundError(f"no trace in {str(out / f'stage{stage}')!r}: launch with trace=True")
        per_rank = {int(p.stem[len("trace_rank"):]): trace.spans(p) for p in paths}
        meta = trace.metadata(paths[0]) or meta
        t0 = min(s.start_s for sp in per_rank.values() for s in sp if s.kind == "phase")
        end = (max(s.end_s for sp in per_rank.values() for s in sp) - t0) * 1e3    # ms
        ms = lambda t: (t - t0) * 1e3  # noqa: E731
        ticks, labels = [], []
        for k, (rank, sp) in enumerate(sorted(per_rank.items())):
            yc, yn = -2 * k, -2 * k - 0.9          # compute lane, collectives lane
            for s in sp:
                if s.kind in ("phase", "block"):
                    h = 0.7 if s.kind == "phase" else 0.5
                    ax.barh(yc, s.dur_s * 1e3, left=ms(s.start_s), height=h,
                            color=COMPUTE_GREYS[s.kind], zorder=1 if s.kind == "phase" else 2)
                    text = s.name if s.kind == "phase" else f"{s.phase[0]}{s.unit.split('.')[-1]}"
                    if s.dur_s * 1e3 > end * (0.012 * len(text) if s.kind == "phase" else 0.008):
                        ax.text(ms(s.start_s) + s.dur_s * 5e2, yc + (0.42 if s.kind == "phase" else 0),
                                text, ha="center", va="bottom" if s.kind == "phase" else "center",
                                fontsize=FONT - 1, color="0.15", zorder=5, clip_on=True)
                elif s.kind == "wait":
                    ax.barh(yc, s.dur_s * 1e3, left=ms(s.start_s), height=0.5, zorder=3,
                            color="white", edgecolor=COLLECTIVE_COLORS[s.op], hatch="////", lw=0.8)
            runs = [s for s in sp if s.kind == "run"]
            threads = sorted({s.thread for s in runs}, key=str)
            for s in runs:
                j = threads.index(s.thread)
                h = 0.6 / max(len(threads), 1)
                ax.barh(yn + 0.3 - h * (j + 0.5), s.dur_s * 1e3, left=ms(s.start_s), height=h * 0.9,
                        color=COLLECTIVE_COLORS[s.op], zorder=3)
                drawn_ops.add(s.op)
            issues = [s for s in sp if s.kind == "issue"]
            if not runs:                          # no run ranges: from issue to the end of its wait
                waits = {s.index: s for s in sp if s.kind == "wait"}
                for s in issues:
                    w = waits.get(s.index)
                    if w is not None:
                        ax.barh(yn, (w.end_s - s.start_s) * 1e3, left=ms(s.start_s), height=0.5,
                                color=COLLECTIVE_COLORS[s.op], alpha=0.45, zorder=3)
                        drawn_ops.add(s.op)
            for s in issues:
                ax.plot([ms(s.start_s)] * 2, [yn - 0.38, yn + 0.38], color="k", lw=0.8, zorder=4)
            ticks += [yc, yn]
            labels += [f"rank {rank}\ncompute", f"rank {rank}\ncollectives"]
        ax.set_yticks(ticks, labels, fontsize=FONT)
        ax.set_ylim(ticks[-1] - 0.6, 0.75)
        ax.set_xlim(0, end * 1.01)
        ax.tick_params(axis="x", labelsize=FONT)
        ax.grid(axis="x", color="0.9", zorder=0)
        ax.set_title(f"{theory.STAGE_NAMES[stage]}: step {meta.get('step', '?')} of every rank "
                     "(--trace), one clock", fontsize=FONT + 1)
    axes[-1, 0].set_xlabel("ms since the first rank's forward began", fontsize=FONT)
    handles = [Patch(color=COMPUTE_GREYS["phase"], label="forward / backward / step"),
               Patch(color=COMPUTE_GREYS["block"], label="a block's compute (f = forward, b = backward)"),
               Patch(facecolor="white", edgecolor="0.3", hatch="////", label="waiting for a collective"),
               plt.Line2D([], [], color="k", lw=0.8, label="| issued")]
    handles += [Patch(color=COLLECTIVE_COLORS[op], label=f"{op} in progress") for op in COLLECTIVE_COLORS
                if op in drawn_ops]
    axes[-1, 0].legend(handles=handles, fontsize=FONT, ncol=4, loc="upper center",
                       bbox_to_anchor=(0.5, -0.32 if len(stages) > 1 else -0.4), frameon=False)
    fig.tight_layout()
    return fig


def snapshot_series(snap: dict, max_entries: int | None = None) -> list[dict]:
    """Per device of a `torch.cuda.memory._dump_snapshot` dict: the allocated bytes after each
    recorded event, absolute. The running sum of alloc / free_completed sizes starts at zero
    when recording begins and goes negative when blocks allocated earlier are freed, so it is
    anchored at the end instead: the blocks still live at the dump (segments' active blocks)
    minus what the recorded events added. That stays right even when the ring buffer dropped
    the oldest events. Returns [{"device", "bytes": [int per event], "dropped": bool,
    "events": int}]; `dropped` when the history holds `max_entries` events (it was full)."""
    out = []
    for dev, trace in enumerate(snap.get("device_traces", [])):
        live_end = sum(b.get("size", 0) for seg in snap.get("segments", [])
                       if seg.get("device", 0) == dev
                       for b in seg.get("blocks", []) if b.get("state") in LIVE_BLOCK_STATES)
        deltas = [ev.get("size", 0) if ev.get("action") == "alloc"
                  else -ev.get("size", 0) if ev.get("action") == "free_completed" else 0
                  for ev in trace]
        live, series = live_end - sum(deltas), []
        for d in deltas:
            live += d
            series.append(live)
        out.append({"device": dev, "bytes": series, "events": len(trace),
                    "dropped": bool(max_entries) and len(trace) >= max_entries})
    return out


def cuda_snapshot(path, title: str = ""):
    """Allocated bytes (absolute, see `snapshot_series`) over the events of a CUDA allocator
    snapshot that `memory.cuda_memory_history` wrote as JSON, drawn offline (the built-in HTML
    viewers load JavaScript from the internet). Never unpickles: a pickle could run code. Reads
    what `cuda_memory_history` adds under "zerolab" when present: the allocated bytes when
    recording began (a dotted line) and the buffer size, to say on the plot when old events
    were dropped."""
    from ..memory import SNAPSHOT_MAX_ENTRIES
    snap = json.loads(Path(path).read_text())
    snap = snap.get("snapshot", snap)
    meta = snap.get("zerolab") or {}
    fig, ax = plt.subplots(figsize=(14, 3.6))
    notes = []
    for row in snapshot_series(snap, meta.get("max_entries", SNAPSHOT_MAX_ENTRIES)):
        if row["bytes"]:
            ax.plot(range(len(row["bytes"])), [b / MB for b in row["bytes"]], drawstyle="steps-post",
                    label=f"cuda:{row['device']}")
        if row["dropped"]:
            notes.append(f"cuda:{row['device']}: buffer full ({row['events']:,} events): older "
                         "events were dropped, the curve starts mid-run")
    if "allocated_at_start" in meta:
        ax.axhline(meta["allocated_at_start"] / MB, color="0.4", ls=":", lw=1,
                   label="allocated when recording began")
    notes.append("absolute: anchored at the blocks still allocated at the dump")
    ax.set(xlabel="allocator event", ylabel="MB allocated (absolute)")
    ax.set_title("\n".join([title or f"CUDA allocator over the last step ({Path(path).name})",
                             *notes]), fontsize=9)
    if ax.get_legend_handles_labels()[1]:       # outside the axes: never over the data
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# --- time (notebook 12, lab 6): drawn from costmodel results and run JSON ------------------------
def _nbytes(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def ring_latency(link, sizes=(8, 1e6, 1e9), ns=(2, 4, 8, 16, 64, 256, 1024)):
    """All_reduce and all_gather time vs N on `link` (a costmodel.Link) for a few message sizes
    S (bytes): small messages grow with N (latency, 2(N-1)α), large ones level off (bandwidth)."""
    from ..timing import costmodel
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = ["-", "--", ":"]
    for op in ("all_reduce", "all_gather"):
        for size, ls in zip(sizes, styles):
            ax.plot(ns, [costmodel.collective_time(op, size, n, link) * 1e3 for n in ns], ls,
                    marker="o", ms=4, color=COLLECTIVE_COLORS[op], label=f"{op}, S = {_nbytes(size)}")
    ax.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="time (ms)",
           title=f"ring collectives on {link.name}: α = {link.latency * 1e6:g} us, "
                 f"β = {link.bandwidth / 1e9:g} GB/s")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def step_replay(replays: dict):
    """One pair of lanes per replay ({label: costmodel.StepTime}): compute (grey spans; the gaps
    are waits for communication) and the link (each collective in its op's colour). The right end
    of the compute lane is the step time."""
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.9 * len(replays)))
    ticks, labels = [], []
    for k, (label, st) in enumerate(replays.items()):
        y = 2 * (len(replays) - 1 - k)
        for a, b in st.compute_spans:
            ax.barh(y + 0.5, (b - a) * 1e3, left=a * 1e3, height=0.35, color="0.7",
                    edgecolor="white", linewidth=0.3)
        for c in st.collectives:
            ax.barh(y, (c.end - c.start) * 1e3, left=c.start * 1e3, height=0.35,
                    color=COLLECTIVE_COLORS[c.op], edgecolor="white", linewidth=0.5)
        ax.text(st.total * 1e3, y + 0.5, f" {st.total * 1e3:.3g} ms (compute {st.compute * 1e3:.3g})",
                va="center", fontsize=8)
        ticks += [y, y + 0.5]
        labels += [f"{label}: link", f"{label}: compute"]
    ax.barh(0, 0, color="0.7", label="compute")
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        ax.barh(0, 0, color=COLLECTIVE_COLORS[op], label=op)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set(xlabel="time in the step (ms)", title="one step replayed: compute (gaps = waiting) and the link")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.margins(x=0.25)
    fig.tight_layout()
    return fig


def comm_bound(block_params: float, world_size: int, link, device, tokens=None, mfu=None):
    """A block's forward compute (rises with tokens per rank) against its all_gather (flat);
    they cross at the ZeRO-3 threshold T* (costmodel.zero3_comm_bound_tokens). Compute runs at
    `mfu` of the device's peak (default the cost model's, flops.MFU), which title and label say."""
    from ..timing import costmodel
    mfu = costmodel.MFU if mfu is None else costmodel.check_mfu(mfu)
    t_star = costmodel.zero3_comm_bound_tokens(block_params, world_size, link, device, mfu=mfu)
    tokens = tokens or [2 ** k for k in range(6, 18)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, [costmodel.compute_time(block_params, t, device, passes="fwd", mfu=mfu) * 1e3
                     for t in tokens], color="0.3", marker="o", ms=3,
            label=f"block forward compute (MFU {mfu:g})")
    gather = costmodel.collective_time("all_gather", 2 * block_params, world_size, link) * 1e3
    ax.axhline(gather, color=COLLECTIVE_COLORS["all_gather"], label="block all_gather (bf16)")
    ax.axvline(t_star, color="0.5", ls=":", label=f"T* = {t_star:,.0f} tokens per rank")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank per step", ylabel="ms")
    ax.set_title(f"Ψ_block = {block_params:.3g}, N = {world_size}, {device.name} at MFU {mfu:g} "
                 f"on {link.name}", fontsize=11)
    legend_below(ax, ncol=2, offset=-0.2)
    fig.tight_layout()
    return fig


def time_by_stage(rows: list[dict]):
    """Lab 6: per link and stage, the measured median step time (bar, min-max whisker) next to the
    cost model's prediction with overlap (black tick) and without (open circle).
    rows: {"link", "label", "median_s", "min_s", "max_s", "model_s", "serial_s"}."""
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        sub = [r for r in rows if r["link"] == link]
        measured_vs_model(ax, sub)
        ax.set_xticks(range(len(sub)), [r["label"] for r in sub], rotation=20, fontsize=8)
        ax.set(title=f"emulated link {link}")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    fig.tight_layout()
    return fig


def measured_vs_model(ax, rows: list[dict]):
    """Per row, the measured median step time (bar, min-max whisker) next to the cost model's
    prediction with overlap (black tick) and without (open circle), in ms (labs 6 and 8).
    rows: {"median_s", "min_s", "max_s", "model_s", "serial_s"}."""
    x = range(len(rows))
    med = [r["median_s"] * 1e3 for r in rows]
    err = [[m - r["min_s"] * 1e3 for m, r in zip(med, rows)],
           [r["max_s"] * 1e3 - m for m, r in zip(med, rows)]]
    ax.bar(x, med, 0.6, yerr=err, color="C0", alpha=0.7, capsize=3, label="measured (median, min-max)")
    ax.plot(x, [r["model_s"] * 1e3 for r in rows], "_", color="k", ms=22, mew=2,
            label="model, with overlap")
    ax.plot(x, [r["serial_s"] * 1e3 for r in rows], "o", mfc="none", color="k",
            label="model, no overlap")
    ax.set(ylabel="step time (ms)")
    ax.set_ylim(0, max(max(r["max_s"], r["serial_s"]) for r in rows) * 1e3 * 1.1)


TIER_HATCH = {"world": "", "intra": "..", "inter": "//"}     # the group a collective ran on


def tiers_sweep(rows: list[dict]):
    """Lab 8: left, per variant the measured median step time (bar, min-max whisker) next to the
    cost model's (black tick: with overlap; open circle: without); right, the ledger's bytes per
    rank per step, coloured by collective and hatched by the group they ran on (world: a ring
    through every node; intra: inside a node; inter: one rank per node), the formula's total as
    a black outline.
    rows: `zerolab.course.tiersweep.table`."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = list(range(len(rows)))
    measured_vs_model(ax, rows)
    ax.set_xticks(x, [r["name"] for r in rows], fontsize=9)
    ax.set(title="step time on two emulated tiers")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    for i, r in enumerate(rows):
        bottom = 0.0
        for tier, hatch in TIER_HATCH.items():
            for op, b in r["bytes_by_op"].get(tier, {}).items():
                ax2.bar(i, b / 1e3, 0.6, bottom=bottom, color=COLLECTIVE_COLORS[op],
                        edgecolor="white", hatch=hatch,
                        label=op if not has_label(ax2, op) else None)
                bottom += b / 1e3
        ax2.bar(i, sum(r["bytes_formula"].values()) / 1e3, 0.6, fill=False, edgecolor="k", lw=1.5,
                label="formula" if not has_label(ax2, "formula") else None)
    for tier, hatch in TIER_HATCH.items():              # the hatches' key: which group
        ax2.bar(0, 0, color="white", edgecolor="#444444", hatch=hatch, label=f"on {tier}")
    ax2.set_xticks(x, [r["name"] for r in rows], fontsize=9)
    ax2.set(ylabel="KB per rank per step", title="bytes by op (colour) and group (hatch)")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    fig.tight_layout()
    return fig
