"""Regenerate every figure in images/ from zerolab's formulas (no training run, no GPU).

    python scripts/make_images.py            # writes images/*.png
    python scripts/make_images.py --out /tmp/img

Figures:
  memory_7p5b_n64.png     per-rank model-state memory by state and ZeRO stage, Ψ = 7.5B, N = 64
                          (the ZeRO paper's Figure 1 numbers: 120 / 31.4 / 16.6 / 1.9 GB)
  memory_7p5b_n8.png      the same at N = 8 (the notes' 16Ψ / 5.5Ψ / 3.75Ψ / 2Ψ)
  zero_stages.png         what each of N = 4 ranks keeps resident at each stage: the notes' missing
                          figure ("memory composition for full fine-tuning of a 7.5B model, and
                          the ZeRO stages"), redrawn from theory.SHARDED_FROM_STAGE
  ring_allreduce.png      a ring all-reduce on 4 ranks: 3 reduce-scatter steps then 3 all-gather
                          steps, each rank sending one chunk (S/n) per step
  nics_busbw.png          bus bandwidth of flat collectives across nodes, published NCCL
                          measurements next to the two-tier model with its NICs per node (one
                          ring per NIC: zerolab.timing.collectives.flat_leg); tests/test_nics.py
                          holds the model to the same figures
  two_tiers.png           two nodes of 4 GPUs with a NIC each: a flat ring as NCCL runs it (one
                          ring per NIC) next to a hierarchical collective's rings inside and across

Notebook 02 calls `memory_by_stage` and `zero_stages` to draw the same figures inline; notebook 03
shows ring_allreduce.png, notebook 13 nics_busbw.png and two_tiers.png. Every function returns a matplotlib Figure and saves nothing itself.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from zerolab import theory
from zerolab.course.plots import COLLECTIVE_COLORS, STATE_COLORS

ROOT = Path(__file__).resolve().parent.parent
DPI = 100
COLORS = STATE_COLORS                     # one colour per state and per collective, course-wide
LABELS = {"params": "bf16 weights (2Ψ)", "grads": "bf16 grads (2Ψ)",
          "master_weights": "fp32 master (4Ψ)", "exp_avg": "fp32 exp_avg m_t (4Ψ)",
          "exp_avg_sq": "fp32 exp_avg_sq v_t (4Ψ)"}


def memory_by_stage(psi: float = 7.5e9, world_size: int = 64, optimizer_bytes=None):
    """Stacked bars: per-rank GB of each model state at each stage (activations excluded). A bar
    under 5 % of DDP's would be a sliver, so the last stages are drawn again, enlarged, in an
    inset with its own scale."""
    fig, ax = plt.subplots(figsize=(10, 4.6))
    rows = theory.memory_table(psi, world_size, optimizer_bytes=optimizer_bytes)

    def bars(axis, picked, labels=True):
        for i in picked:
            bottom = 0.0
            for state in theory.STATES:
                gb = rows[i][state] / 1e9
                axis.bar(i, gb, 0.6, bottom=bottom, color=COLORS[state],
                         label=LABELS[state] if labels and i == picked[0] else None)
                bottom += gb
            axis.text(i, bottom, f"{bottom:.3g} GB\n{rows[i]['bytes_per_param']:.4g}Ψ", ha="center",
                      va="bottom", fontsize=9)

    bars(ax, list(range(len(rows))))
    ax.set_xticks(range(len(rows)), [f"{r['name']}" for r in rows], fontsize=10)
    ax.tick_params(axis="y", labelsize=9)
    top = rows[0]["total"] / 1e9
    ax.set_ylim(0, top * 1.22)
    ax.set_ylabel("GB per rank (1 GB = 1e9 bytes)", fontsize=9)
    ax.set_title(f"Model states per rank: Ψ = {psi / 1e9:g}B parameters, N = {world_size} ranks, "
                 "AdamW + bf16", fontsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    small = [i for i, r in enumerate(rows) if r["total"] / 1e9 < 0.05 * top]
    if small:                                 # enlarge the slivers, on their own scale
        ins = ax.inset_axes([0.56, 0.46, 0.42, 0.42])
        bars(ins, small, labels=False)
        ins.set_xticks(small, [rows[i]["name"] for i in small], fontsize=9)
        ins.set_xlim(small[0] - 0.6, small[-1] + 0.6)
        ins.set_ylim(0, max(rows[i]["total"] for i in small) / 1e9 * 1.45)
        ins.tick_params(axis="y", labelsize=8)
        ins.set_title("enlarged (own GB scale)", fontsize=9)
    fig.tight_layout()
    return fig


def zero_stages(psi: float = 7.5e9, world_size: int = 4):
    """What each rank keeps resident at each stage, drawn as the ZeRO paper draws it.

    Each rank's row is the 16 bytes of one parameter laid out as 2 + 2 + 12 (weights, grads,
    optimizer state); a sharded state keeps only the rank's own 1/N slice (solid), the rest is
    held by the other ranks (outline only). Every one of the `world_size` ranks is drawn, so the
    slices are the 1/N the GB figures on the right are computed with (at `psi`, `world_size`).
    """
    n = world_size
    groups = (("params", 2), ("grads", 2), ("optimizer", 12))
    fig, axes = plt.subplots(4, 1, figsize=(8.5, 6.4), sharex=True)
    for stage, ax in zip(theory.STAGES, axes):
        for r in range(n):
            x = 0.0
            for name, width in groups:
                state = "master_weights" if name == "optimizer" else name
                color = COLORS[state]
                if theory.is_sharded(state, stage):
                    ax.add_patch(Rectangle((x, r), width, 0.8, fill=False, edgecolor=color, lw=1))
                    ax.add_patch(Rectangle((x + width * r / n, r), width / n, 0.8, color=color))
                else:
                    ax.add_patch(Rectangle((x, r), width, 0.8, color=color))
                x += width + 0.3
        total = theory.model_state_total(psi, world_size, stage) / 1e9
        formula = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[stage]
        ax.text(17.0, n / 2, f"{formula}\n= {total:.3g} GB at\nΨ = {psi / 1e9:g}B, N = {world_size}",
                va="center", fontsize=9)
        ax.set_xlim(-0.2, 21)
        ax.set_ylim(-0.2, n)
        ax.set_yticks([r + 0.4 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{theory.STAGE_NAMES[stage]}: " + {
            0: "every rank holds every state",
            1: "optimizer state (master, m_t, v_t) sharded",
            2: "+ gradients sharded",
            3: "+ bf16 weights sharded (each block gathered just before it runs)"}[stage],
            fontsize=9, loc="left")
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xticks([1, 3.3, 10.6], ["bf16 weights\n2 B/param", "bf16 grads\n2 B/param",
                                          "fp32 master + m_t + v_t\n12 B/param"], fontsize=8)
    fig.suptitle(f"Resident model states per rank, N = {n} ranks (solid = held by this rank)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def ring_steps(n: int = 4) -> list[tuple[str, list[list[frozenset]], set]]:
    """Simulate a ring all-reduce of n chunks on n ranks.

    Returns [(title, cells, sent)] for the start and each of the 2(n-1) steps; cells[rank][chunk]
    is the set of ranks whose contribution that copy holds; sent is {(rank, chunk)} sent this step.
    Reduce-scatter step k: rank i sends chunk (i-k-1) mod n to rank i+1, which adds it; after n-1
    steps rank i holds the full sum of chunk i. All-gather step k: rank i sends chunk (i-k) mod n
    (complete) to rank i+1, which overwrites its copy.
    """
    cells = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    out = [("start: rank r holds its own\nS split in n chunks", [row[:] for row in cells], set())]
    for k in range(n - 1):
        sent = {(i, (i - k - 1) % n) for i in range(n)}
        new = [row[:] for row in cells]
        for i, c in sent:
            new[(i + 1) % n][c] = cells[(i + 1) % n][c] | cells[i][c]
        cells = new
        out.append((f"reduce-scatter {k + 1}/{n - 1}", [row[:] for row in cells], sent))
    for k in range(n - 1):
        sent = {(i, (i - k) % n) for i in range(n)}
        new = [row[:] for row in cells]
        for i, c in sent:
            new[(i + 1) % n][c] = cells[i][c]
        cells = new
        out.append((f"all-gather {k + 1}/{n - 1}", [row[:] for row in cells], sent))
    return out


def ring_allreduce(n: int = 4):
    """The ring all-reduce, one panel per step (rows: ranks, columns: chunks of S/n)."""
    steps = ring_steps(n)
    fig, axes = plt.subplots(1, len(steps), figsize=(2.35 * len(steps), 3.4))
    cmap = plt.get_cmap("Greys")
    for ax, (title, cells, sent) in zip(axes, steps):
        phase = "all_gather" if title.startswith("all-gather") else "reduce_scatter"
        for r in range(n):
            for c in range(n):
                contrib = cells[r][c]
                full = len(contrib) == n
                ax.add_patch(Rectangle((c, r), 0.95, 0.9, color=cmap(0.08 + 0.5 * len(contrib) / n)))
                label = "Σ" if full else "+".join(str(i) for i in sorted(contrib))
                ax.text(c + 0.47, r + 0.45, label, ha="center", va="center", fontsize=8,
                        color="black")
                if ((r - 1) % n, c) in sent:
                    ax.add_patch(Rectangle((c, r), 0.95, 0.9, fill=False, lw=2.5,
                                           edgecolor=COLLECTIVE_COLORS[phase]))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_xticks([c + 0.47 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=8)
        ax.set_yticks([r + 0.45 for r in range(n)], [f"r{r}" for r in range(n)], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"Ring all-reduce on n = {n} ranks: 2(n-1) = {2 * (n - 1)} steps, each rank sends "
                 f"one chunk of S/n per step -> 2(n-1)/n·S per rank\n(frame: chunk just received, "
                 f"green in the reduce-scatter steps, blue in the all-gather steps: the collectives' colours)",
                 fontsize=9)
    fig.tight_layout()
    return fig


#: published NCCL measurements across nodes: (source, label, op, ranks per node, nodes, NICs per
#: node, intra Link, inter Link, bytes, measured bus bandwidth in bytes/s). Bus bandwidth as
#: nccl-tests defines it: S/t times 2(n-1)/n (all_reduce) or (n-1)/n (reduce_scatter).
def _published():
    from zerolab.timing.hardware import LINKS, Link, get_link
    nvlink2 = Link("nvlink2", 150e9, 2e-6)          # V100: NVLink 300 GB/s bidirectional
    edr = get_link(gbps=100, latency_us=5)          # InfiniBand EDR, 100 Gb/s a port
    ar, rs = "all_reduce", "reduce_scatter"
    rows = [("nccl#569", f"{8 // k} x {k} V100\n{k} EDR NIC{'s' if k > 1 else ''}", ar, k, 8 // k, 8, nvlink2,
             edr, 1.6e9, 1.6e9 / t * 2 * 7 / 8) for k, t in ((1, 0.363), (2, 0.173), (4, 0.132))]
    rows.append(("nccl-tests#119", "3 x 8 A100\n4 HDR NICs", ar, 8, 3, 4, LINKS["nvlink3"],
                 LINKS["ib-hdr"], 133_169_160, 95.74e9))
    rows += [("nccl#1229", f"{m} x 8 H100\n8 NDR NICs", rs, 8, m, 8, LINKS["nvlink4"], LINKS["ib-ndr"],
              8 * 2 ** 30, bw * 1e9)
             for m, bw in ((4, 360), (8, 345), (16, 320), (32, 300), (64, 280), (128, 260))]
    return rows


def nics_busbw():
    """Measured bus bandwidth of flat collectives across nodes (bars, in the collective's colour)
    against the two-tier model at line rate with the nodes' NICs (black ticks): nccl#569 (the
    same 8 V100 ranks on 1, 2, 4 GPUs and NICs a node), nccl-tests#119 (4 HDR NICs for 8 A100s),
    nccl#1229 (reduce_scatter on 4-128 H100 nodes with 8 NDR NICs). nccl#1229 gives no message
    size; the model's is 8 GiB, the bandwidth-bound end."""
    from zerolab.timing import collectives
    from zerolab.timing.hardware import Topology
    rows = _published()
    fig, ax = plt.subplots(figsize=(11, 4.6))
    for x, (src, label, op, k, m, c, intra, inter, size, measured) in enumerate(rows):
        n = k * m
        t = collectives.flat_leg(op, size, range(n), Topology(k, intra, inter, c)).seconds
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        model = size / t * factor
        ax.bar(x, measured / 1e9, 0.6, color=COLLECTIVE_COLORS[op],
               label=f"measured {op}" if op not in [r[2] for r in rows[:x]] else None)
        ax.plot([x - 0.38, x + 0.38], [model / 1e9] * 2, color="k", lw=2,
                label="model at line rate" if x == 0 else None)
        ax.text(x, measured / 1e9 / 1.2, f"{measured / 1e9:.3g}", ha="center", va="top", fontsize=8,
                color="white")
    ax.set_yscale("log")
    ax.set_ylim(4, 900)
    ax.set_xticks(range(len(rows)), [r[1] for r in rows], fontsize=8)
    groups = {}
    for x, r in enumerate(rows):
        groups.setdefault(r[0], []).append(x)
    for src, xs in groups.items():
        ax.annotate(src, (sum(xs) / len(xs), 0), xycoords=("data", "axes fraction"),
                    xytext=(0, -34), textcoords="offset points", ha="center", va="top", fontsize=9)
        if xs[0]:
            ax.axvline(xs[0] - 0.5, color="0.75", lw=0.8)
    ax.set_ylabel("bus bandwidth, GB/s (log)", fontsize=9)
    ax.tick_params(axis="y", labelsize=9)
    ax.set_title("Flat collectives across nodes: one ring per NIC, so a node's NICs add up "
                 "(measured vs the two-tier model)", fontsize=10)
    ax.legend(fontsize=9, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    return fig


def two_tiers(k: int = 4, m: int = 2):
    """Two tiers as NCCL runs them: m nodes of k GPUs, NVLink inside a node, a NIC per GPU, and
    a switch between the nodes. Left, a flat collective through all N = k·m ranks (ZeRO-3's
    all_gather): NCCL runs one ring per NIC, ring c entering a node through GPU c's NIC, crossing
    NVLink through the node and leaving through GPU c-1's (two of the k rings drawn), so a GPU
    sends 1/k of its ring bytes over a NIC. Right, a hierarchical collective (HSDP's gradient):
    a ring of k inside each node (reduce_scatter), then rings of m across, one per local index,
    each through its own NIC (all_reduce); ZeRO++'s two-hop qgZ uses the same two groups."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    gap = k + 1.2                                   # node a's GPU l sits at x = a·gap + l

    def hardware(ax):
        for a in range(m):
            x0 = a * gap
            ax.add_patch(Rectangle((x0 - 0.5, 1.55), k, 1.75, fill=False, ec="0.3", lw=1.2))
            ax.text(x0 - 0.45, 3.2, f"node {a}: NVLink inside", fontsize=9, va="top")
            for l in range(k):
                ax.add_patch(Rectangle((x0 + l - 0.3, 1.8), 0.6, 0.45, fc="0.92", ec="0.3"))
                ax.text(x0 + l, 2.02, f"GPU\n{a * k + l}", ha="center", va="center", fontsize=8)
                ax.add_patch(Rectangle((x0 + l - 0.22, 0.75), 0.44, 0.3, fc="white", ec="0.5",
                                       zorder=3))             # the rings pass through it
                ax.text(x0 + l, 0.9, "NIC", ha="center", va="center", fontsize=8, zorder=4)
                ax.plot([x0 + l, x0 + l], [0.75, 0.35], color="0.75", lw=1, zorder=0)
        ax.add_patch(Rectangle((-0.5, 0.05), (m - 1) * gap + k, 0.3, fc="0.85", ec="0.5"))
        ax.text(((m - 1) * gap + k - 1) / 2, 0.2, "switch (InfiniBand)", ha="center",
                va="center", fontsize=8)
        ax.set_xlim(-0.7, (m - 1) * gap + k - 0.3)
        ax.set_ylim(-0.05, 3.9)
        ax.axis("off")

    def nvlink(ax, x1, x2, color, ls, rad):
        ax.annotate("", (x2, 2.25), (x1, 2.25), arrowprops=dict(
            arrowstyle="-|>", color=color, ls=ls, lw=1.6, shrinkA=2, shrinkB=2,
            connectionstyle=f"arc3,rad={rad}"))

    def across(ax, x1, x2, color, ls, dy, both=False):   # GPU -> NIC -> switch -> NIC -> GPU
        y = 0.5 + dy
        ax.plot([x1, x1, x2, x2], [1.8, y, y, 1.8], color=color, ls=ls, lw=1.6)
        for x in (x2, x1) if both else (x2,):
            ax.annotate("", (x, 1.8), (x, 1.6), arrowprops=dict(arrowstyle="-|>", color=color,
                                                                lw=1.6))

    blue, green, red = (COLLECTIVE_COLORS[op] for op in ("all_gather", "reduce_scatter",
                                                          "all_reduce"))
    ax = axes[0]
    hardware(ax)
    for c, ls, rad, dx, dy in ((0, "-", -0.5, -0.07, 0.05), (2, "--", -0.35, 0.07, -0.08)):
        for a in range(m):
            x0 = a * gap
            order = [(c + i) % k for i in range(k)]
            for l1, l2 in zip(order, order[1:]):
                nvlink(ax, x0 + l1, x0 + l2, blue, ls, rad if l2 > l1 else -rad / 3)
            nxt = ((a + 1) % m) * gap
            across(ax, x0 + order[-1] + dx, nxt + c + dx, blue, ls, dy + 0.08 * a)
    ax.set_title(f"flat all_gather through all {k * m} GPUs: one ring per NIC\n(ring 0 solid, "
                 f"ring 2 dashed; {k} rings in all)", fontsize=10)
    ax.text(-0.5, 3.75, "a GPU sends 1/k of its ring bytes over its NIC, (k-1)/k over NVLink",
            fontsize=9, va="top")
    ax = axes[1]
    hardware(ax)
    for a in range(m):
        x0 = a * gap
        for l in range(k):
            nvlink(ax, x0 + l, x0 + (l + 1) % k, green, "-", -0.5 if l < k - 1 else 0.25)
    for l in range(k):
        across(ax, l, gap + l, red, "-", 0.06 * (l - (k - 1) / 2) - 0.02, both=True)
    ax.set_title(f"two tiers: reduce_scatter inside each node (rings of k = {k}),\nthen "
                 f"all_reduce across (rings of m = {m}, one per NIC)", fontsize=10)
    ax.text(-0.5, 3.75, "HSDP's gradient; ZeRO++'s two-hop qgZ uses the same two groups",
            fontsize=9, va="top")
    fig.tight_layout()
    return fig


FIGURES = {
    "memory_7p5b_n64.png": lambda: memory_by_stage(7.5e9, 64),
    "memory_7p5b_n8.png": lambda: memory_by_stage(7.5e9, 8),
    "zero_stages.png": lambda: zero_stages(7.5e9, 4),
    "ring_allreduce.png": lambda: ring_allreduce(4),
    "nics_busbw.png": nics_busbw,
    "two_tiers.png": two_tiers,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "images"))
    args = p.parse_args(argv)
    plt.switch_backend("Agg")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in FIGURES.items():
        fig = make()
        fig.savefig(out / name, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
