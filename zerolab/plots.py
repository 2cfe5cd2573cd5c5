"""The labs' figures: each function takes runs as `zerolab.report.load_run` returns them (or rows
from `zerolab.labs`) and returns a matplotlib Figure; `save(fig, out, name)` writes it as PNG.

Idea: a figure is drawn only from the ranks' JSON files, never from the kernel's own memory, so
that the same function draws a CPU run here and an 8-GPU run on a cluster. Measured bars are
solid; formula bars are pale and hatched; transient peaks are drawn on top of the resident
bytes, hatched, in the colour of what they hold.

    fig = plots.memory_by_stage(runs); plots.save(fig, "runs/labs/lab1", "memory_by_stage")
"""
from __future__ import annotations

import json

from pathlib import Path

import matplotlib.pyplot as plt

from . import theory
from .labs import COLLECTIVES, TRANSIENT, step_records, step_timeline, unit_bytes

MB = 1e6
STATE_COLORS = {"params": "C0", "grads": "C1", "master_weights": "C2", "exp_avg": "C3",
                "exp_avg_sq": "C4", "grad_buckets": "C1", "gathered_params": "C0"}
OP_COLORS = {"all_reduce": "C5", "reduce_scatter": "C6", "all_gather": "C9", "broadcast": "C7"}
PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fbeee6", "step": "#eaf7ea", "eval": "#f3f3f3"}


def save(fig, out, name: str) -> Path:
    """Write `fig` to OUT/name.png (folders created) and return the path."""
    path = Path(out) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _title(runs) -> str:
    r0 = next(iter(runs.values()))[0]
    return (f"{r0['preset']} GPT, Ψ = {r0['num_params']:,}, N = {r0['world_size']} ranks, "
            f"{r0['precision']}, {r0['backend']} on {r0['device']}")


# --- lab 1 ---------------------------------------------------------------------------------------
def memory_by_stage(runs: dict[int, list[dict]]):
    """Left: per stage, one stacked bar per rank (measured model states, then the transient
    peaks hatched on top) next to the formula bar. Right: the allocator's peak against the
    meter's: model states + transient peaks + what only the allocator sees."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    stages = sorted(runs)
    nranks = len(runs[stages[0]])
    width = 0.8 / (nranks + 1)
    ticks, labels = [], []
    for i, s in enumerate(stages):
        for k, r in enumerate(runs[s]):
            x = i + (k - nranks / 2) * width
            bottom = 0.0
            for state in theory.STATES:
                v = r["memory"]["model_states"][state] / MB
                ax.bar(x, v, width, bottom=bottom, color=STATE_COLORS[state],
                       label=state if (i, k) == (0, 0) else None)
                bottom += v
            for cat in TRANSIENT:
                v = r["memory"]["peak"].get(cat, 0) / MB
                if v:
                    ax.bar(x, v, width, bottom=bottom, color=STATE_COLORS[cat], alpha=0.35,
                           hatch="xx", edgecolor="k", linewidth=0.3,
                           label=f"{cat} (peak)" if not _has_label(ax, f"{cat} (peak)") else None)
                    bottom += v
        x = i + (nranks / 2) * width
        bottom = 0.0
        for state in theory.STATES:
            v = runs[s][0]["theory"]["model_states_padded"][state] / MB
            ax.bar(x, v, width, bottom=bottom, color=STATE_COLORS[state], alpha=0.35, hatch="//",
                   edgecolor="white")
            bottom += v
        ticks.append(i)
        labels.append(f"{theory.STAGE_NAMES[s]}\n" + " ".join(f"r{k}" for k in range(nranks)) + " | f")
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set(title="model states per rank: measured (r0, r1, ...) | formula (f)",
           ylabel="MB (1e6 bytes)")
    ax.legend(fontsize=7, ncol=2)

    width = 0.38
    for i, s in enumerate(stages):
        r = max(runs[s], key=lambda r: (r["memory"].get("allocator") or {}).get("peak_absolute") or 0)
        states = r["memory"]["model_states_total"] / MB
        trans = sum(r["memory"]["peak"].get(c, 0) for c in TRANSIENT) / MB
        ax2.bar(i - width / 2, states, width, color="C2", label="model states" if i == 0 else None)
        ax2.bar(i - width / 2, trans, width, bottom=states, color="C1", alpha=0.35, hatch="xx",
                label="transient peaks (meter)" if i == 0 else None)
        alloc = r["memory"].get("allocator") or {}
        peak = (alloc.get("peak_absolute") or 0) / MB
        by_type = alloc.get("by_type")
        if by_type:                          # CPU: MemTracker's split at its peak
            bottom = 0.0
            for j, (k, v) in enumerate(sorted(by_type.items())):
                if v:
                    ax2.bar(i + width / 2, v / MB, width, bottom=bottom, color=f"C{j}", alpha=0.6,
                            edgecolor="k", linewidth=0.3,
                            label=f"MemTracker {k}" if not _has_label(ax2, f"MemTracker {k}") else None)
                    bottom += v / MB
        elif peak:                           # CUDA: absolute peak; the rest is activations etc.
            ax2.bar(i + width / 2, states + trans, width, color="C2", alpha=0.5)
            ax2.bar(i + width / 2, max(0.0, peak - states - trans), width, bottom=states + trans,
                    color="C7", alpha=0.6, label="activations, temporaries" if i == 0 else None)
        if peak:
            ax2.text(i + width / 2, peak, f"{peak:.2f}", ha="center", va="bottom", fontsize=7)
    src = (next(iter(runs.values()))[0]["memory"].get("allocator") or {}).get("source", "allocator")
    ax2.set_xticks(range(len(stages)), [f"{theory.STAGE_NAMES[s]}\nmeter | {src}" for s in stages],
                   fontsize=8)
    ax2.set(title=f"peak of the last step: meter vs {src}", ylabel="MB (1e6 bytes)")
    ax2.legend(fontsize=7)
    fig.suptitle(_title(runs))
    fig.tight_layout()
    return fig


def _has_label(ax, label):
    return label in ax.get_legend_handles_labels()[1]


# --- lab 2 ---------------------------------------------------------------------------------------
def traffic_by_stage(rows: list[dict]):
    """Left: bytes per rank per step by collective, measured | formula, per stage (rows from
    zerolab.labs.traffic_rows). Right: wall time per step by collective (machine-dependent)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.6))
    width = 0.38
    for i, row in enumerate(rows):
        bm = bf = 0.0
        for op in COLLECTIVES:
            m, f = row["measured"][op] / MB, row["formula"][op] / MB
            ax.bar(i - width / 2, m, width, bottom=bm, color=OP_COLORS[op],
                   label=op if i == 0 else None)
            ax.bar(i + width / 2, f, width, bottom=bf, color=OP_COLORS[op], alpha=0.35, hatch="//",
                   edgecolor="white")
            bm, bf = bm + m, bf + f
        two_psi = 2 * row["num_params_padded"]
        ax.text(i - width / 2, bm, f"{bm * MB / two_psi:.2f}·2Ψ", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"{r['name']}\nmeas | formula" for r in rows], fontsize=7)
    ax.set(title="bytes sent per rank per step (ring algorithm)", ylabel="MB (1e6 bytes)")
    ax.legend(fontsize=8)
    for i, row in enumerate(rows):
        bottom = 0.0
        for op in COLLECTIVES:
            t = row["timing"].get(op, {}).get("seconds_per_step", 0.0) * 1e3
            ax2.bar(i, t, 0.6, bottom=bottom, color=OP_COLORS[op], label=op if i == 0 else None)
            bottom += t
    backend = rows[0]["backend"] if rows else ""
    note = " (gloo: reduce_scatter runs as an all_reduce)" if backend == "gloo" else ""
    ax2.set_xticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
    ax2.set(title=f"wall time per step in collectives, {backend}{note}", ylabel="ms per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- lab 3 ---------------------------------------------------------------------------------------
def collective_timeline(runs: dict[int, list[dict]], rank: int = 0):
    """One lane per stage: the collectives of the last step in issue order (boxes coloured by
    op, labelled by bucket / block), over the phase they ran in."""
    stages = sorted(runs)
    fig, ax = plt.subplots(figsize=(15, 0.9 + 0.9 * len(stages)))
    for lane, s in enumerate(stages):
        recs = step_records(runs[s][rank])
        y = len(stages) - 1 - lane
        first = recs[0]["seq"] if recs else 0
        for x in recs:
            i = x["seq"] - first
            ax.add_patch(plt.Rectangle((i, y - 0.42), 1, 0.84, color=PHASE_COLORS[x["phase"]], zorder=0))
            ax.barh(y, 0.9, left=i + 0.05, height=0.5, color=OP_COLORS[x["op"]],
                    label=x["op"] if not _has_label(ax, x["op"]) else None)
            ax.text(i + 0.5, y, x["unit"].replace("block.", "b"), ha="center", va="center",
                    fontsize=7, color="white")
            ax.text(i + 0.5, y - 0.38, x["phase"][0], ha="center", va="bottom", fontsize=6, color="0.4")
    ax.set_yticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in reversed(stages)])
    ax.set_xlim(0, max(len(step_records(runs[s][rank])) for s in stages) + 0.2)
    ax.set(xlabel="collectives of one step, in issue order (background / small letter: "
                  "f = forward, b = backward, s = step)",
           title=f"one training step, rank {rank}: {_title(runs)}")
    ax.legend(fontsize=8, loc="upper right", ncol=3)
    fig.tight_layout()
    return fig


def memory_timeline(runs: dict[int, list[dict]], stages=(2, 3), rank: int = 0):
    """Stacked bytes of each category at every sample of the last step (x: sample, labelled by
    its tag), one panel per stage; the grey line is the total."""
    stages = [s for s in stages if s in runs]
    fig, axes = plt.subplots(len(stages), 1, figsize=(15, 3.6 * len(stages)), squeeze=False)
    cats = (*theory.STATES, *TRANSIENT)
    for ax, s in zip(axes[:, 0], stages):
        tl = step_timeline(runs[s][rank])
        xs = range(len(tl))
        ys = [[row.get(c, 0) / MB for row in tl] for c in cats]
        colors = [STATE_COLORS[c] for c in cats]
        polys = ax.stackplot(xs, ys, labels=cats, colors=colors, step="post", alpha=0.8)
        for poly, c in zip(polys, cats):
            if c in TRANSIENT:
                poly.set_hatch("xx")
                poly.set_alpha(0.45)
        ax.plot(xs, [sum(col) for col in zip(*ys)], color="0.3", lw=1, drawstyle="steps-post")
        ax.set_xticks(list(xs), [row["tag"] for row in tl], rotation=70, fontsize=6, ha="right")
        ax.set(ylabel="MB", title=f"{theory.STAGE_NAMES[s]}: bytes held by rank {rank} over one step "
                                  f"(units: {', '.join(f'{k} {v:,} B' for k, v in unit_bytes(runs[s][rank]).items())})")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7, loc="upper left", ncol=4)
    fig.tight_layout()
    return fig


def cuda_snapshot(path, title: str = ""):
    """Allocated bytes over the events of a CUDA allocator snapshot that
    `zerolab.memory.cuda_memory_history` wrote as JSON, drawn offline (the built-in HTML viewers
    load JavaScript from the internet). Never unpickles: a pickle could run code."""
    snap = json.loads(Path(path).read_text())
    snap = snap.get("snapshot", snap)
    fig, ax = plt.subplots(figsize=(14, 3.6))
    for dev, trace in enumerate(snap.get("device_traces", [])):
        live, xs, ys = 0, [], []
        for i, ev in enumerate(trace):
            if ev.get("action") == "alloc":
                live += ev.get("size", 0)
            elif ev.get("action") in ("free_completed",):
                live -= ev.get("size", 0)
            xs.append(i)
            ys.append(live / MB)
        if xs:
            ax.plot(xs, ys, drawstyle="steps-post", label=f"cuda:{dev}")
    ax.set(xlabel="allocator event", ylabel="MB allocated since recording began",
           title=title or f"CUDA allocator over the last step ({Path(path).name})")
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- lab 4 ---------------------------------------------------------------------------------------
def scaling(rows: list[dict], preset_rows: list[dict], measured_by_preset: dict, world_size: int,
            extend_to: int = 64):
    """Left: per-rank model states vs N by stage (measured markers, formula lines to
    `extend_to`). Middle: ZeRO-2's states vs N (replicated params stay, the rest fall 1/N).
    Right: vs model size at `world_size` ranks (formula lines, measured markers)."""
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.6))
    psi = rows[0]["psi"]
    ns = [2 ** k for k in range(0, int(extend_to).bit_length())]
    for s in theory.STAGES:
        c = f"C{s}"
        a1.plot(ns, [theory.model_state_total(psi, n, s) / MB for n in ns], color=c, alpha=0.6,
                label=f"{theory.STAGE_NAMES[s]} formula")
        pts = [(r["world_size"], sum(r["measured"].values()) / MB) for r in rows if r["stage"] == s]
        if pts:
            a1.plot(*zip(*pts), "o", color=c, label=f"{theory.STAGE_NAMES[s]} measured")
    a1.set(xscale="log", yscale="log", xlabel="world size N (ranks)", ylabel="MB per rank",
           title=f"model states per rank, Ψ = {psi:,}")
    a1.set_xticks(ns, [str(n) for n in ns])
    a1.legend(fontsize=6, ncol=2)
    for j, state in enumerate(theory.STATES):
        c = f"C{j}"
        a2.plot(ns, [theory.model_state_bytes(psi, n, 2)[state] / MB for n in ns], color=c, alpha=0.6,
                label=state + (" (replicated)" if not theory.is_sharded(state, 2) else " (1/N)"))
        pts = [(r["world_size"], r["measured"][state] / MB) for r in rows if r["stage"] == 2]
        if pts:
            a2.plot(*zip(*pts), "o", color=c)
    a2.set(xscale="log", yscale="log", xlabel="world size N (ranks)", ylabel="MB per rank",
           title="ZeRO-2 by state: the sharded parts fall as 1/N")
    a2.set_xticks(ns, [str(n) for n in ns])
    a2.legend(fontsize=7)
    psis = [r["psi"] for r in preset_rows]
    for s in theory.STAGES:
        name, c = theory.STAGE_NAMES[s], f"C{s}"
        a3.plot(psis, [r[name] / 1e9 for r in preset_rows], "-", color=c, alpha=0.6, label=name)
        pts = [(m["psi"], m["totals"][s] / 1e9) for m in measured_by_preset.values() if s in m["totals"]]
        if pts:
            a3.plot(*zip(*pts), "o", color=c)
    for r in preset_rows:
        a3.annotate(r["preset"], (r["psi"], r["DDP"] / 1e9), fontsize=7, rotation=30)
    a3.set(xscale="log", yscale="log", xlabel="Ψ (parameters)", ylabel="GB per rank",
           title=f"vs model size at N = {world_size} (lines: formula, dots: measured)")
    a3.legend(fontsize=7)
    fig.tight_layout()
    return fig


# --- lab 5 ---------------------------------------------------------------------------------------
def same_training(runs_by_precision: dict[str, dict[int, list[dict]]]):
    """One panel per precision: every stage's loss per step (they should lie on top of each
    other), and the largest loss difference to DDP as text."""
    fig, axes = plt.subplots(1, len(runs_by_precision), figsize=(6.5 * len(runs_by_precision), 4),
                             squeeze=False)
    for ax, (prec, runs) in zip(axes[0], runs_by_precision.items()):
        base = runs[min(runs)][0]["losses"]
        styles = ["-", "--", "-.", ":"]
        for k, s in enumerate(sorted(runs)):
            losses = runs[s][0]["losses"]
            ax.plot(range(1, len(losses) + 1), losses, styles[k % 4], marker="o", ms=9 - 2 * k,
                    label=f"{theory.STAGE_NAMES[s]} (max |Δ| to DDP "
                          f"{max(abs(a - b) for a, b in zip(losses, base)):.1e})")
        ax.set(title=f"{prec}: loss per step, same seed and data", xlabel="step", ylabel="loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
