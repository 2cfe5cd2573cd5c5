"""The course's figures of bytes - memory and traffic by stage, scaling, the same training, and
`zerolab compare`'s - and the course's colours. Each function takes runs as
`results.load_run` returns them (or rows from `checks`) and returns a matplotlib Figure;
`save(fig, out, name)` writes it as PNG. The figures of time are in `timeplots`.

Idea: a figure is drawn only from the ranks' JSON files, never from the kernel's own memory, so
that the same function draws a CPU run here and an 8-GPU run on a cluster. Measured bars are
solid; formula bars are pale and hatched; transient peaks are drawn on top of the resident
bytes, hatched, in the colour of what they hold.

    fig = plots.memory_by_stage(runs); plots.save(fig, "runs/labs/lab1", "memory_by_stage")
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from .. import theory
from ..memory import TRANSIENT
from ..run.folders import atomic_path
from .results import COLLECTIVES

MB = 1e6
# --- the course's colours: every figure (labs, `zerolab compare`, notebooks, scripts/make_images.py)
# takes a collective's / a state's colour from here, so all_gather is the same blue everywhere.
COLLECTIVE_COLORS = {"all_reduce": "#D55E00", "reduce_scatter": "#009E73", "all_gather": "#0072B2",
                     "broadcast": "#CC79A7",           # Okabe-Ito: vermillion, green, blue, purple,
                     "all_to_all": "#E69F00"}          # orange (distributed Muon's a2a, qgZ)
STATE_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "master_weights": "#55A868",
                "exp_avg": "#C44E52", "exp_avg_sq": "#8172B3",
                "grad_buckets": "#DD8452", "gathered_params": "#4C72B0",   # transient: hatched
                "grad_fp32": "#DD8452", "reduce_scatter_out": "#DD8452"}
OP_COLORS = COLLECTIVE_COLORS                          # old name
FONT = 9                                               # pt: tick labels, legends, annotations >= 8
PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fbeee6", "step": "#eaf7ea", "eval": "#f3f3f3"}


def save(fig, out, name: str) -> Path:
    """Write `fig` to OUT/name.png (folders created) and return the path."""
    path = Path(out) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def run_title(runs) -> str:
    r0 = next(iter(runs.values()))[0]
    return (f"{r0['preset']} GPT, Ψ = {r0['num_params']:,}, N = {r0['world_size']} ranks, "
            f"{r0['precision']}, {r0['backend']} on {r0['device']}")


# --- lab 1 ---------------------------------------------------------------------------------------
def legend_below(ax, ncol=3, offset=-0.16):
    """Legend under the axes (never over bars or values); collectives in the course's order."""
    handles, labels = ax.get_legend_handles_labels()
    order = {op: i for i, op in enumerate(COLLECTIVE_COLORS)}
    pairs = sorted(zip(handles, labels), key=lambda hl: order.get(hl[1], -1))
    ax.legend(*zip(*pairs) if pairs else ([], []), fontsize=FONT, ncol=ncol, loc="upper center",
              bbox_to_anchor=(0.5, offset), frameon=False)


def identical_style(k: int) -> dict:
    """Marker style of the k-th of several curves that may coincide: hollow markers of different
    shapes and sizes, so that every curve stays visible where they lie on top of each other."""
    return {"marker": "osD^x"[k % 5], "ms": max(5, 15 - 3 * k), "mfc": "none", "mew": 2}


def _wrap(name: str) -> str:
    """"ZeRO-1 (reduce_scatter)" -> two lines, so that neighbouring tick labels do not collide."""
    return name.replace(" (", "\n(")


def memory_by_stage(runs: dict[int, list[dict]]):
    """Left: per stage, one stacked bar per rank (measured model states, then the transient
    peaks hatched on top) next to the formula bar, the bars of one stage grouped with a gap
    between stages. Right: the allocator's peak against the meter's: model states + transient
    peaks + what only the allocator sees."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5.6), gridspec_kw={"width_ratios": [3, 2]})
    stages = sorted(runs)
    nranks = len(runs[stages[0]])
    group = nranks + 1                                   # rank bars + the formula bar
    width = 0.85
    ticks, labels = [], []
    for i, s in enumerate(stages):
        x0 = i * (group + 1.2)                           # 1.2 bar widths of gap between stages
        for k, r in enumerate(runs[s]):
            x = x0 + k
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
                           label=f"{cat} (peak)" if not has_label(ax, f"{cat} (peak)") else None)
                    bottom += v
            ticks.append(x)
            labels.append(f"r{k}")
        x = x0 + nranks
        bottom = 0.0
        for state in theory.STATES:
            v = runs[s][0]["theory"]["model_states_padded"][state] / MB
            ax.bar(x, v, width, bottom=bottom, color=STATE_COLORS[state], alpha=0.35, hatch="//",
                   edgecolor="white", label="formula (hatched)" if (i, state) == (0, "params") else None)
            bottom += v
        ticks.append(x)
        labels.append("f")
        ax.text(x0 + nranks / 2, -0.09, theory.STAGE_NAMES[s], ha="center", va="top", fontsize=FONT + 1,
                transform=ax.get_xaxis_transform())
    ax.set_xticks(ticks, labels, fontsize=FONT)
    ax.tick_params(axis="y", labelsize=FONT)
    ax.set_title("model states per rank: measured on each rank (r0, r1, ...) | formula (f)", fontsize=FONT + 1)
    ax.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    legend_below(ax, ncol=4, offset=-0.17)

    width = 0.38
    for i, s in enumerate(stages):
        r = max(runs[s], key=lambda r: (r["memory"].get("allocator") or {}).get("peak_absolute") or 0)
        states = r["memory"]["model_states_total"] / MB
        trans = sum(r["memory"]["peak"].get(c, 0) for c in TRANSIENT) / MB
        ax2.bar(i - width / 2, states, width, color="0.45", label="model states (meter)" if i == 0 else None)
        if trans:
            ax2.bar(i - width / 2, trans, width, bottom=states, color="#DD8452", alpha=0.35, hatch="xx",
                    label="transient peaks (meter)" if not has_label(ax2, "transient peaks (meter)") else None)
        alloc = r["memory"].get("allocator") or {}
        peak = (alloc.get("peak_absolute") or 0) / MB
        by_type = alloc.get("by_type")
        if by_type:                          # CPU: MemTracker's split at its peak
            bottom = 0.0
            for j, (k, v) in enumerate(sorted(by_type.items())):
                if v:
                    ax2.bar(i + width / 2, v / MB, width, bottom=bottom, color=f"C{j}", alpha=0.6,
                            edgecolor="k", linewidth=0.3,
                            label=f"MemTracker {k}" if not has_label(ax2, f"MemTracker {k}") else None)
                    bottom += v / MB
        elif peak:                           # CUDA: absolute peak; the rest is activations etc.
            ax2.bar(i + width / 2, states + trans, width, color="0.45", alpha=0.5)
            ax2.bar(i + width / 2, max(0.0, peak - states - trans), width, bottom=states + trans,
                    color="0.5", alpha=0.6, label="activations, temporaries" if i == 0 else None)
        if peak:
            ax2.text(i + width / 2, peak, f"{peak:.2f}", ha="center", va="bottom", fontsize=FONT)
    src = (next(iter(runs.values()))[0]["memory"].get("allocator") or {}).get("source", "allocator")
    ax2.set_xticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in stages], fontsize=FONT)
    ax2.tick_params(axis="y", labelsize=FONT)
    ax2.margins(y=0.12)
    ax2.set_title(f"peak of the last step (busiest rank)\nleft bar: meter, right bar: {src}", fontsize=FONT + 1)
    ax2.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    legend_below(ax2, ncol=3, offset=-0.17)
    fig.suptitle(run_title(runs), fontsize=FONT + 2)
    fig.tight_layout()
    return fig


def has_label(ax, label):
    return label in ax.get_legend_handles_labels()[1]


# --- lab 2 ---------------------------------------------------------------------------------------
def traffic_by_stage(rows: list[dict]):
    """Left: bytes per rank per step by collective, measured | formula, per stage (rows from
    zerolab.course.checks.traffic_rows). Right: wall time per step in each collective: the median over
    every (rank, step) sample but the first step, with the range (min-max) as an error bar
    (machine-dependent: one run on a shared machine is noise, the range shows how much)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.2))
    width = 0.38
    for i, row in enumerate(rows):
        bm = bf = 0.0
        for op in COLLECTIVES:
            m, f = row["measured"][op] / MB, row["formula"][op] / MB
            if m:
                ax.bar(i - width / 2, m, width, bottom=bm, color=COLLECTIVE_COLORS[op],
                       label=op if not has_label(ax, op) else None)
            if f:
                ax.bar(i + width / 2, f, width, bottom=bf, color=COLLECTIVE_COLORS[op], alpha=0.35,
                       hatch="//", edgecolor="white")
            bm, bf = bm + m, bf + f
        two_psi = 2 * row["num_params_padded"]
        ax.text(i - width / 2, bm, f"{bm * MB / two_psi:.2f}·2Ψ", ha="center", va="bottom", fontsize=FONT)
    ax.set_xticks(range(len(rows)), [f"{_wrap(r['name'])}\nmeas | formula" for r in rows], fontsize=FONT)
    ax.tick_params(axis="y", labelsize=FONT)
    ax.margins(y=0.12)
    ax.set_title("bytes sent per rank per step (ring algorithm); hatched: formula", fontsize=FONT + 1)
    ax.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    legend_below(ax, ncol=3, offset=-0.24)
    ops = [op for op in COLLECTIVES if any(op in r["timing"] for r in rows)]
    bw = 0.8 / max(1, len(ops))
    samples = 0
    for i, row in enumerate(rows):
        for j, op in enumerate(ops):
            t = row["timing"].get(op)
            if not t:
                continue
            xs = sorted(1e3 * v for v in t.get("per_step_s", [t["seconds_per_step"]]))
            med = xs[len(xs) // 2]
            samples = max(samples, len(xs))
            x = i - 0.4 + bw * (j + 0.5)
            ax2.bar(x, med, bw, color=COLLECTIVE_COLORS[op], label=op if not has_label(ax2, op) else None)
            ax2.errorbar(x, med, yerr=[[med - xs[0]], [xs[-1] - med]], color="k", capsize=3, lw=1)
    backend = rows[0]["backend"] if rows else ""
    note = "\n(gloo: reduce_scatter runs as an all_reduce)" if backend == "gloo" else ""
    ax2.set_xticks(range(len(rows)), [_wrap(r["name"]) for r in rows], fontsize=FONT)
    ax2.tick_params(axis="y", labelsize=FONT)
    ax2.set_title(f"wall time per step in each collective ({backend}): median, and range (error bar)\n"
                  f"over {samples} (rank, step) samples; machine-dependent{note}", fontsize=FONT + 1)
    ax2.set_ylabel("ms per step", fontsize=FONT)
    legend_below(ax2, ncol=3, offset=-0.24)
    fig.tight_layout()
    return fig


# --- lab 4 ---------------------------------------------------------------------------------------
def scaling(rows: list[dict], preset_rows: list[dict], measured_by_preset: dict, world_size: int,
            extend_to: int = 64):
    """Left: per-rank model states vs N by stage (measured markers, formula lines to
    `extend_to`). Middle: ZeRO-2's states vs N (replicated params stay, the rest fall 1/N;
    states with identical curves are merged into one labelled line). Right: vs model size at
    `world_size` ranks (formula lines, measured markers)."""
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 5.6))
    psi = rows[0]["psi"]
    ns = [2 ** k for k in range(0, int(extend_to).bit_length())]
    stage_colors = {0: "0.35", 1: "#E69F00", 2: "#56B4E9", 3: "#009E73"}
    for s in theory.STAGES:
        c = stage_colors[s]
        a1.plot(ns, [theory.model_state_total(psi, n, s) / MB for n in ns], color=c, alpha=0.7,
                label=theory.STAGE_NAMES[s])
        pts = [(r["world_size"], sum(r["measured"].values()) / MB) for r in rows if r["stage"] == s]
        if pts:
            a1.plot(*zip(*pts), "o", color=c, ms=7)
    a1.set(xscale="log", yscale="log")
    a1.set_xlabel("world size N (ranks)", fontsize=FONT)
    a1.set_ylabel("MB per rank", fontsize=FONT)
    a1.set_title(f"model states per rank, Ψ = {psi:,}\n(lines: formula, dots: measured)", fontsize=FONT + 1)
    a1.set_xticks(ns, [str(n) for n in ns])
    a1.tick_params(labelsize=FONT)
    legend_below(a1, ncol=4, offset=-0.14)
    curves = {}                              # identical curves (master, exp_avg, exp_avg_sq): one line
    for state in theory.STATES:
        key = tuple(theory.model_state_bytes(psi, n, 2)[state] for n in ns)
        curves.setdefault(key, []).append(state)
    for key, states in curves.items():
        c = STATE_COLORS[states[0]]
        sharded = theory.is_sharded(states[0], 2)
        label = " = ".join(states) + (" (1/N)" if sharded else " (replicated)")
        a2.plot(ns, [v / MB for v in key], color=c, alpha=0.7, lw=2, label=label)
        pts = [(r["world_size"], r["measured"][states[0]] / MB) for r in rows if r["stage"] == 2
               if all(r["measured"][x] == r["measured"][states[0]] for x in states)]
        if pts:
            a2.plot(*zip(*pts), "o", color=c, ms=7)
    a2.set(xscale="log", yscale="log")
    a2.set_xlabel("world size N (ranks)", fontsize=FONT)
    a2.set_ylabel("MB per rank", fontsize=FONT)
    a2.set_title("ZeRO-2 by state: the sharded parts fall as 1/N\n(identical states share one line)",
                 fontsize=FONT + 1)
    a2.set_xticks(ns, [str(n) for n in ns])
    a2.tick_params(labelsize=FONT)
    legend_below(a2, ncol=1, offset=-0.14)
    psis = [r["psi"] for r in preset_rows]
    for s in theory.STAGES:
        name, c = theory.STAGE_NAMES[s], stage_colors[s]
        a3.plot(psis, [r[name] / 1e9 for r in preset_rows], "-", color=c, alpha=0.7, label=name)
        pts = [(m["psi"], m["totals"][s] / 1e9) for m in measured_by_preset.values() if s in m["totals"]]
        if pts:
            a3.plot(*zip(*pts), "o", color=c, ms=7)
    for r in preset_rows:
        a3.annotate(r["preset"], (r["psi"], r["DDP"] / 1e9), fontsize=FONT, rotation=30,
                    xytext=(2, 4), textcoords="offset points")
    a3.set(xscale="log", yscale="log")
    a3.set_xlabel("Ψ (parameters)", fontsize=FONT)
    a3.set_ylabel("GB per rank", fontsize=FONT)
    a3.set_title(f"vs model size at N = {world_size}\n(lines: formula, dots: measured)", fontsize=FONT + 1)
    a3.tick_params(labelsize=FONT)
    a3.margins(y=0.15)
    legend_below(a3, ncol=4, offset=-0.14)
    fig.tight_layout()
    return fig


# --- lab 5 ---------------------------------------------------------------------------------------
def same_training(runs_by_precision: dict[str, dict[int, list[dict]]]):
    """One panel per run set (e.g. fp32, bf16): every stage's loss per step (they should lie on
    top of each other: decreasing marker sizes keep all visible), the largest loss difference to
    the first stage in the legend; integer steps."""
    fig, axes = plt.subplots(1, len(runs_by_precision), figsize=(6.5 * len(runs_by_precision), 4.8),
                             squeeze=False)
    for ax, (prec, runs) in zip(axes[0], runs_by_precision.items()):
        base = runs[min(runs)][0]["losses"]
        styles = ["-", "--", "-.", ":"]
        for k, s in enumerate(sorted(runs)):
            losses = runs[s][0]["losses"]
            label = (f"{theory.STAGE_NAMES[s]} (reference)" if s == min(runs) else
                     f"{theory.STAGE_NAMES[s]} (max |Δ| to {theory.STAGE_NAMES[min(runs)]} "
                     f"{max(abs(a - b) for a, b in zip(losses, base)):.1e})")
            ax.plot(range(1, len(losses) + 1), losses, styles[k % 4], label=label, **identical_style(k))
        n = len(base)
        ax.set_xticks(range(1, n + 1) if n <= 12 else range(1, n + 1, max(1, n // 10)))
        ax.tick_params(labelsize=FONT)
        ax.set_title(f"{prec}: loss per step, same seed and data", fontsize=FONT + 1)
        ax.set_xlabel("step", fontsize=FONT)
        ax.set_ylabel("loss", fontsize=FONT)
        legend_below(ax, ncol=1, offset=-0.14)
    fig.tight_layout()
    return fig




# --- `zerolab compare` -----------------------------------------------------------------------------
def plot_compare(runs: dict[int, list[dict]], path) -> Path:
    """`zerolab compare`'s figure, saved as a PNG at `path` (returned): three panels, the loss
    curves, model-state bytes per rank by state and bytes per step by collective (measured
    solid, formula hatched)."""

    fig, (ax_loss, ax_mem, ax_net) = plt.subplots(1, 3, figsize=(16, 5.2))
    stages = sorted(runs)
    for i, s in enumerate(stages):   # decreasing marker sizes: identical curves stay visible
        losses = runs[s][0]["losses"]
        ax_loss.plot(range(1, len(losses) + 1), losses, label=theory.STAGE_NAMES[s], **identical_style(i))
    steps = len(runs[stages[0]][0]["losses"])
    ax_loss.set_xticks(range(1, steps + 1) if steps <= 12 else range(1, steps + 1, max(1, steps // 10)))
    ax_loss.set_title("loss per step (same data and seed;\nhollow markers: curves on top of each other stay visible)",
                      fontsize=FONT + 1)
    ax_loss.set_xlabel("step", fontsize=FONT)
    ax_loss.set_ylabel("loss", fontsize=FONT)
    width = 0.38
    for i, s in enumerate(stages):
        r0 = runs[s][0]
        bottom_m = bottom_t = 0.0
        for state in theory.STATES:
            m = r0["memory"]["model_states"][state] / 1e6
            t = r0["theory"]["model_states_padded"][state] / 1e6
            ax_mem.bar(i - width / 2, m, width, bottom=bottom_m, color=STATE_COLORS[state],
                       label=state if i == 0 else None)
            ax_mem.bar(i + width / 2, t, width, bottom=bottom_t, color=STATE_COLORS[state], alpha=0.45,
                       hatch="//", edgecolor="white")
            bottom_m, bottom_t = bottom_m + m, bottom_t + t
    ax_mem.set_xticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in stages])
    ax_mem.set_title("model states per rank (rank 0)\nsolid: measured, hatched: formula", fontsize=FONT + 1)
    ax_mem.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    for j, op in enumerate(ops):
        meas = [runs[s][0]["comm"]["bytes_per_step"][op] / 1e6 for s in stages]
        form = [runs[s][0]["theory"]["traffic_per_step_padded"][op] / 1e6 for s in stages]
        base_m = [sum(runs[s][0]["comm"]["bytes_per_step"][o] / 1e6 for o in ops[:j]) for s in stages]
        base_f = [sum(runs[s][0]["theory"]["traffic_per_step_padded"][o] / 1e6 for o in ops[:j])
                  for s in stages]
        xs = range(len(stages))
        ax_net.bar([x - width / 2 for x in xs], meas, width, bottom=base_m, color=COLLECTIVE_COLORS[op],
                   label=op)
        ax_net.bar([x + width / 2 for x in xs], form, width, bottom=base_f, color=COLLECTIVE_COLORS[op],
                   alpha=0.45, hatch="//", edgecolor="white")
    ax_net.set_xticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in stages])
    ax_net.set_title("bytes sent per rank per step (ring, rank 0)\nsolid: measured, hatched: formula",
                     fontsize=FONT + 1)
    ax_net.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    for ax in (ax_loss, ax_mem, ax_net):
        ax.tick_params(labelsize=FONT)
        ax.legend(fontsize=FONT, ncol=4 if ax is ax_loss else 3, loc="upper center",
                  bbox_to_anchor=(0.5, -0.15 if ax is ax_loss else -0.08), frameon=False)
    n = runs[stages[0]][0]["world_size"]
    fig.suptitle(f"{runs[stages[0]][0]['preset']} GPT, Ψ = {runs[stages[0]][0]['num_params']:,}, "
                 f"N = {n} ranks, {runs[stages[0]][0]['backend']} on {runs[stages[0]][0]['device']}",
                 fontsize=FONT + 2)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:            # the run id rides in the PNG's metadata
        fig.savefig(tmp, dpi=110, bbox_inches="tight",
                    metadata={"zerolab_run_id": str(runs[stages[0]][0].get("run_id"))})
    plt.close(fig)
    return path
