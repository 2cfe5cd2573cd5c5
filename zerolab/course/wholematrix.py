"""Optimizers that see the whole matrix, for notebook 08b and lab 9: split-vs-whole in one
process, distributed Muon's three layouts measured on gloo ranks, tables and a figure.

    from zerolab.course import wholematrix as wm
    print(wm.format_split(wm.split_vs_whole()))       # AdamW on row pieces == whole; Muon != whole
    ranks = wm.launch("runs/nb08b", nproc=4, launch_demo=nb.launch_demo, adafactor=True)
    rows = wm.layout_rows(ranks); print(wm.format_layouts(rows))
    fig = wm.figure({4: rows})

`split_vs_whole` steps each optimizer class on the user's MLP (`demos.wholematrix.issue_mlp`)
once whole and once as `pieces` dim-0 row pieces, each piece its own tensor with its own
optimizer - what torch's class does on fully_shard's shards - from the same weights on the same
global batches, and reports the largest difference of the weights (and how far the whole run
moved them). `launch` runs `zerolab.course.demos.wholematrix` (Muon's layouts, and Adafactor on
fully_shard's rows) through `nb.launch_demo`, which restores the committed CPU run instead in
reference mode. `layout_rows` keeps the busiest rank's numbers per layout.
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from ..wholematrix import muon_theory as mt
from .demos import wholematrix as demo
from .plots import COLLECTIVE_COLORS, FONT

ORDER = ("reduce_scatter", "all_to_all", "all_gather")     # a step's collectives, in order
SPLIT_CLASSES = {   # name -> (class, keywords, which parameters it steps)
    "AdamW": (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1}, "all"),
    "Adafactor": (torch.optim.Adafactor, demo.ADAFACTOR_KW, "all"),
    "Muon": (torch.optim.Muon, {"lr": 0.02}, "2-D"),
}


def _pieces(t: torch.Tensor, n: int):
    """t's dim-0 row pieces as fully_shard cuts them: ceil(R/n) rows each, the last ones short
    (or empty: dropped)."""
    k = math.ceil(t.shape[0] / n)
    return [t[r * k:(r + 1) * k] for r in range(n) if t[r * k:(r + 1) * k].shape[0]]


def split_vs_whole(names=tuple(SPLIT_CLASSES), steps: int = demo.ADAFACTOR_STEPS,
                   pieces: int = 2) -> list[dict]:
    """Per optimizer: {"name", "kind" (optim.update_kind), "diff" (largest |split - whole| of a
    weight after `steps` steps), "moved" (largest |whole - start|)}. Single process, fp32."""
    from ..optim import update_kind
    out = []
    for name in names:
        cls, kw, which = SPLIT_CLASSES[name]
        whole, split = demo.issue_mlp(), demo.issue_mlp()
        stepped = [i for i, p in enumerate(whole.parameters()) if which == "all" or p.dim() == 2]
        whole_opt = cls([p for i, p in enumerate(whole.parameters()) if i in stepped], **kw)
        rows = {i: [t.detach().clone().requires_grad_(True) for t in _pieces(p.detach(), pieces)]
                for i, p in enumerate(split.parameters()) if i in stepped}
        split_opts = [cls([t], **kw) for ts in rows.values() for t in ts]
        start = [p.detach().clone() for p in whole.parameters()]
        for step in range(steps):
            x, y = demo.issue_batch(step)
            F.mse_loss(whole(x), y).backward()
            whole_opt.step()
            whole_opt.zero_grad()
            F.mse_loss(split(x), y).backward()
            with torch.no_grad():
                for i, p in enumerate(split.parameters()):
                    if i in rows:               # each piece's gradient: its rows of the whole's
                        for t, g in zip(rows[i], _pieces(p.grad, pieces)):
                            t.grad = g.clone()
            for o in split_opts:
                o.step()
            with torch.no_grad():
                for i, p in enumerate(split.parameters()):
                    if i in rows:
                        p.copy_(torch.cat(rows[i]))
                    p.grad = None
        out.append({"name": name, "kind": update_kind(cls)[0],
                    "diff": max(float((a - b).detach().abs().max()) for a, b in
                                zip(whole.parameters(), split.parameters())),
                    "moved": max(float((a.detach() - s).abs().max()) for a, s in
                                 zip(whole.parameters(), start))})
    return out


def format_split(rows, pieces: int = 2) -> str:
    lines = [f"the user's MLP, {demo.ADAFACTOR_STEPS} steps, fp32: torch's class on {pieces} "
             f"dim-0 row pieces (fully_shard's) against the same class on the whole weights",
             f"{'optimizer':<11}{'kind (optim.OPTIMIZERS)':<25}{'max |split - whole|':>20}"
             f"{'max |whole - start|':>21}"]
    for r in rows:
        lines.append(f"{r['name']:<11}{r['kind']:<25}{r['diff']:>20.2e}{r['moved']:>21.2e}")
    return "\n".join(lines)


# --- lab 9's parameters ------------------------------------------------------------------------
def lab_parameters(*, muon_world_sizes, layouts, preset, steps, muon_link_gbps, link_latency_us,
                   out):
    """Lab 9's parameters checked before any rank starts: (labs.check_parameters' namespace,
    world sizes as a list, layouts as a list). muon_world_sizes: an int or a list of ints 2-8;
    layouts: a list (or comma text) of muon_theory.LAYOUTS; steps >= 3; muon_link_gbps > 0,
    link_latency_us >= 0. Raises labs.LabParameterError (one line) naming the bad value."""
    from .labs import LabParameterError, _within, check_parameters
    sizes = [muon_world_sizes] if isinstance(muon_world_sizes, int) else muon_world_sizes
    if isinstance(layouts, str):                        # "owner,a2a" from zerolab labs -p
        layouts = [x.strip() for x in layouts.split(",") if x.strip()]
    if not isinstance(sizes, list) or not sizes or any(
            isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 8 for n in sizes):
        raise LabParameterError(f"muon_world_sizes = {muon_world_sizes!r} must be a list of "
                                "integers 2-8 (gloo ranks)")
    if not isinstance(layouts, list) or not layouts or any(x not in mt.LAYOUTS for x in layouts):
        raise LabParameterError(f"layouts = {layouts!r} must be a list of {', '.join(mt.LAYOUTS)}")
    for name, value, low in (("muon_link_gbps", muon_link_gbps, "> 0"),
                             ("link_latency_us", link_latency_us, ">= 0")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                low == "> 0" and value == 0):
            raise LabParameterError(f"{name} = {value!r} must be a number {low}")
        _within(name, value)                # NaN, inf, huge: zerolab.run.bounds' range
    p = check_parameters(nproc=max(sizes), backend="gloo", device="cpu", stages="0",
                         preset=preset, steps=steps, out=out)
    if p.steps < 3:
        raise LabParameterError(f"steps = {p.steps} must be >= 3 (warm-up, timed, memory peak)")
    return p, sizes, layouts


# --- the layouts on gloo ranks -----------------------------------------------------------------
def launch(out, *, nproc: int, launch_demo, preset: str = "tiny", layouts=mt.LAYOUTS,
           steps: int = 4, link_gbps: float = 1.0, link_latency_us: float = 100.0,
           adafactor: bool = False, timeout: float = 300) -> list[dict]:
    """The ranks' JSONs of `zerolab.course.demos.wholematrix` on `nproc` gloo ranks (by rank);
    launch_demo: `zerolab.nb.launch_demo` (its reference mode restores the committed run)."""
    args = ["--preset", preset, "--layouts", ",".join(layouts), "--steps", str(steps),
            "--link-gbps", str(link_gbps), "--link-latency-us", str(link_latency_us)]
    return launch_demo(demo.PROGRAM, args + (["--adafactor"] if adafactor else []), out=out,
                       nproc=nproc, timeout=timeout)


def layout_rows(ranks: list[dict]) -> list[dict]:
    """One row per layout, the busiest rank's numbers: bytes by op (ledger) and formula, exact
    (every rank's ledger == its formula), Newton-Schulz FLOPs (max, and all ranks' sum), held
    bytes and formula, transient peak, opt.step median (s) and the link's modelled floor (s),
    the largest weight difference to the first layout's."""
    n, out = len(ranks), []
    for layout in ranks[0]["muon"]:
        per = [r["muon"][layout] for r in ranks]
        total = {op: 0 for op in per[0]["formula"]}
        busiest = max(per, key=lambda p: sum(p["bytes"].values()))
        ns = [p["ns_flops"] for p in per]
        for p in per:
            for op in total:
                total[op] = max(total[op], p["bytes"].get(op, 0))
        out.append({"layout": layout, "n": n, "bytes": dict(busiest["bytes"]),
                    "formula": dict(busiest["formula"]),
                    "exact": all(p["bytes"] == p["formula"] for p in per),
                    "ns_flops": max(ns), "ns_total": sum(ns),
                    "ns_imbalance": mt.imbalance(ns),
                    "held": max(p["held"] for p in per),
                    "held_formula": max(p["held_formula"] for p in per),
                    "held_exact": all(p["held"] == p["held_formula"] for p in per),
                    "peak": max(p["peak"] for p in per),
                    "step_s": max(statistics.median(p["step_s"]) for p in per),
                    "floor_s": max(p["link_floor_s"] for p in per),
                    "diff_vs_first": max(p["diff_vs_first"] for p in per)})
    return out


def format_layouts(rows) -> str:
    r0 = rows[0]
    lines = [f"N = {r0['n']} gloo ranks, per rank per step, the busiest rank's (ledger = formula "
             "is checked on every rank)",
             f"{'layout':<10}{'bytes sent':>11}{'formula':>10}{'NS FLOPs':>10}{'NS all ranks':>13}"
             f"{'held B':>11}{'step peak':>10}{'opt.step':>9}{'link floor':>11}{'|Δ| vs ' + r0['layout']:>14}"]
    for r in rows:
        lines.append(f"{r['layout']:<10}{sum(r['bytes'].values()):>11,.0f}"
                     f"{sum(r['formula'].values()):>10,.0f}{r['ns_flops']:>10.3g}"
                     f"{r['ns_total']:>13.3g}{r['held']:>11,}{r['peak']:>10,}"
                     f"{r['step_s'] * 1e3:>7.0f}ms{r['floor_s'] * 1e3:>9.1f}ms"
                     f"{r['diff_vs_first']:>14.1e}")
    return "\n".join(lines)


def collectives_table(rows) -> str:
    """Which collectives each layout issues a step, and the bytes of each (busiest rank)."""
    ops = [op for op in ORDER if any(op in r["formula"] for r in rows)]
    lines = [f"{'layout':<10}" + "".join(f"{op:>16}" for op in ops) + f"{'Newton-Schulz on':>22}"]
    who = {"owner": "its own matrices", "a2a": "its own matrices", "replicate": "every matrix"}
    for r in rows:
        lines.append(f"{r['layout']:<10}" + "".join(
            f"{r['bytes'].get(op, 0):>16,.0f}" if op in r["formula"] else f"{'-':>16}"
            for op in ops) + f"{who.get(r['layout'], '?'):>22}")
    return "\n".join(lines)


def figure(sweep: dict):
    """Bytes per rank by collective (stacked; the formula's total as a black tick) and the
    optimizer step's time (median, the emulated link's modelled floor hatched) per layout, for
    each N of `sweep` {N: layout_rows}."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    ns = sorted(sweep)
    layouts = [r["layout"] for r in sweep[ns[0]]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs, labels, drawn = [], [], set()
    for k, n in enumerate(ns):
        for j, r in enumerate(sweep[n]):
            x = k * (len(layouts) + 1) + j
            xs.append(x)
            labels.append(f"{r['layout']}\nN = {n}")
            bottom = 0.0
            for op in ORDER:
                b = r["bytes"].get(op, 0) / 1e6
                if b:
                    a1.bar(x, b, 0.7, bottom=bottom, color=COLLECTIVE_COLORS[op])
                    drawn.add(op)
                    bottom += b
            a1.plot([x - 0.35, x + 0.35], [sum(r["formula"].values()) / 1e6] * 2, color="k", lw=2)
            a1.text(x, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=FONT)
            a2.bar(x, r["step_s"] * 1e3, 0.7, color="0.75")
            a2.bar(x, r["floor_s"] * 1e3, 0.7, color="white", edgecolor="0.2", hatch="////",
                   alpha=0.6)
            a2.text(x, r["step_s"] * 1e3, f"{r['step_s'] * 1e3:.0f}", ha="center", va="bottom",
                    fontsize=FONT)
    for ax, title, unit in ((a1, "bytes sent per rank per step (busiest rank)", "MB (1e6 bytes)"),
                            (a2, "optimizer step (median over steps, slowest rank)", "ms")):
        ax.set_xticks(xs, labels, fontsize=FONT)
        ax.tick_params(axis="y", labelsize=FONT)
        ax.set_title(title, fontsize=FONT + 1)
        ax.set_ylabel(unit, fontsize=FONT)
        ax.margins(y=0.15)
    h1 = [Patch(color=COLLECTIVE_COLORS[op], label=op) for op in ORDER if op in drawn]
    h1.append(plt.Line2D([], [], color="k", lw=2, label="formula (muon_theory)"))
    a1.legend(handles=h1, fontsize=FONT, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              frameon=False)
    a2.legend(handles=[Patch(color="0.75", label="measured opt.step()"),
                       Patch(facecolor="white", edgecolor="0.2", hatch="////",
                             label="link model's time (what the emulator sleeps)")],
              fontsize=FONT, ncol=1, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    return fig


def scale_costs(cfg=None, n: int = 64, elem_bytes: int = 4) -> list[dict]:
    """The three layouts' formulas for a GPT of `cfg` (default: muontable.BIG, 7.5B) on `n`
    ranks (zerolab.wholematrix.muon_theory.layout_costs, what `zerolab time --muon` prints), per layout:
    {"layout", "bytes" {collective: bytes a step, the busiest rank's}, "ns_flops" (the busiest
    rank's Newton-Schulz FLOPs a step), "state_bytes", "buffer_bytes" (of the rank holding the
    most; fp32 for elem_bytes = 4)}. No model is built (meta shapes)."""
    from .muontable import BIG, gpt_shapes
    shapes, whole, groups = gpt_shapes(BIG if cfg is None else cfg)
    out = []
    for layout in mt.LAYOUTS:
        per = mt.layout_costs(layout, shapes, whole, n, elem_bytes, groups=groups)
        busy = max(per, key=lambda p: sum(p["bytes"].values()))
        held = max(per, key=lambda p: p["state_bytes"] + p["buffer_bytes"])
        out.append({"layout": layout, "n": n,
                    "bytes": {op: b for op, b in busy["bytes"].items() if b},
                    "ns_flops": max(p["ns_flops"] for p in per),
                    "state_bytes": held["state_bytes"], "buffer_bytes": held["buffer_bytes"]})
    return out


def scale_figure(rows, title: str = "7.5B GPT (36 x 4096), N = 64 ranks, fp32 (formulas)"):
    """Three panels, one per quantity, a bar per layout (`scale_costs` rows): bytes sent per
    rank a step (stacked by collective, the course's colours), the busiest rank's Newton-Schulz
    FLOPs a step, and the bytes a rank holds (optimizer state + the layout's buffers). Values
    are written on the bars; legends sit under the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 4.2))
    xs = range(len(rows))
    names = [r["layout"] for r in rows]
    drawn = []
    for x, r in zip(xs, rows):
        bottom = 0.0
        for op in ORDER:
            b = r["bytes"].get(op, 0) / 1e9
            if b:
                a1.bar(x, b, 0.6, bottom=bottom, color=COLLECTIVE_COLORS[op])
                drawn += [op] if op not in drawn else []
                bottom += b
        a1.text(x, bottom, f"{bottom:.3g} GB", ha="center", va="bottom", fontsize=FONT)
        tf = r["ns_flops"] / 1e12
        a2.bar(x, tf, 0.6, color="0.45")
        a2.text(x, tf, f"{tf:.3g}", ha="center", va="bottom", fontsize=FONT)
        s, b = r["state_bytes"] / 1e9, r["buffer_bytes"] / 1e9
        a3.bar(x, s, 0.6, color="0.35")
        a3.bar(x, b, 0.6, bottom=s, color="0.8")
        a3.text(x, s + b, f"{s + b:.3g} GB", ha="center", va="bottom", fontsize=FONT)
    for ax, sub, unit in ((a1, "bytes sent per rank per step", "GB (1e9 bytes)"),
                          (a2, "Newton-Schulz per step (busiest rank)", "TFLOP"),
                          (a3, "held per rank: optimizer state + buffers", "GB (1e9 bytes)")):
        ax.set_xticks(list(xs), names, fontsize=FONT + 1)
        ax.tick_params(axis="y", labelsize=FONT)
        ax.set_title(sub, fontsize=FONT + 1)
        ax.set_ylabel(unit, fontsize=FONT)
        ax.margins(y=0.15)
    a1.legend(handles=[Patch(color=COLLECTIVE_COLORS[op], label=op) for op in ORDER if op in drawn],
              fontsize=FONT, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    a3.legend(handles=[Patch(color="0.35", label="optimizer state"),
                       Patch(color="0.8", label="buffers")],
              fontsize=FONT, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.suptitle(title, fontsize=FONT + 2)
    fig.tight_layout()
    return fig
