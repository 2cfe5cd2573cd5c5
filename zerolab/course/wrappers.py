"""Lab 7: torch's wrapper names over zerolab's stages, on a model of your own, measured against
the formulas - bytes held by state, bytes and collectives per step, the padding of each layout.

Idea: `zerolab.course.demos.byom` writes, per rank, what `held_bytes` and the ledger saw for
DistributedDataParallel (DDP), DDP + ZeroRedundancyOptimizer (ZeRO-1) and fully_shard with
layout "dim0" and "flat" (ZeRO-3). Here every measured number is put next to an expected one
built from three terms, each shown: `theory`'s formula at Ψ (fp32, and torch's AdamW, which
steps the fp32 parameters themselves: no separate master copy, so 4Ψ params + 4Ψ grads + 8Ψ
exp_avg / exp_avg_sq at DDP, 8Ψ/N of state at ZeRO-1, all of it /N at ZeRO-3), the padding
each layout adds (elements held as zeros; padding keeps no optimizer state), and the frozen
parameters, which every wrapper keeps whole on every rank. A failed check raises AssertionError
naming the wrapper, rank and state (or collective).

    ranks = nb.launch_demo("zerolab.course.demos.byom", [], out="runs/byom", nproc=2)
    rows = held_rows(ranks); print(format_held_table(rows)); check_held(rows)
"""
from __future__ import annotations

import math
import re

from .. import theory

NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "dim0": "ZeRO-3 dim0", "flat": "ZeRO-3 flat"}
STATES = ("params", "grads", "optimizer")
FP32 = 4                                    # bytes per element: every run is fp32


def check_model(model) -> str:
    """`model` if it names one of the demo's models, else LabParameterError (one line)."""
    from .demos.byom import MODELS
    from .labs import LabParameterError
    if not isinstance(model, str) or model not in MODELS:
        raise LabParameterError(f"model = {model!r} is not one of {', '.join(sorted(MODELS))}")
    return model


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _padded(units) -> int:
    return sum(u["padded_numel"] for u in units)


def _shards(units) -> tuple[int, int]:
    """(elements of this rank's shards, padding elements among them)."""
    return sum(u["shard_numel"] for u in units), sum(u["padding_in_shard"] for u in units)


# --- bytes held ------------------------------------------------------------------------------------
def expected_held(r: dict, key: str) -> dict[str, dict[str, float]]:
    """{state: {"formula", "padding", "frozen", "expected"}} for wrapper `key` on rank JSON `r`."""
    psi, n, w = r["psi"], r["world_size"], r["wrappers"][key]
    th = theory.model_state_bytes(psi, n, w["stage"], "fp32")
    formula = {"params": th["params"], "grads": th["grads"],
               "optimizer": th["exp_avg"] + th["exp_avg_sq"]}   # the params are the master
    if key in ("ddp", "zero1"):
        params = FP32 * (psi if key == "ddp" else _padded(w["groups"]))
        grads = FP32 * _padded(w["buckets"])                    # DDP's padded buckets
        if key == "ddp":
            optimizer = 2 * FP32 * psi
        else:
            held, pad = _shards(w["groups"])
            optimizer = 2 * FP32 * (held - pad)
    else:
        held, pad = _shards(w["units"])
        params = grads = FP32 * held                            # shards, padding included
        optimizer = 2 * FP32 * (held - pad)                     # no state for padding
    frozen = {"params": FP32 * r["psi_frozen"], "grads": 0, "optimizer": 0}
    out = {}
    for state, value in zip(STATES, (params, grads, optimizer)):
        out[state] = {"formula": formula[state], "padding": value - formula[state],
                      "frozen": frozen[state], "expected": value + frozen[state]}
    return out


def held_rows(ranks: list[dict]) -> list[dict]:
    """One row per (wrapper, rank, state): measured bytes next to formula + padding + frozen."""
    rows = []
    for r in ranks:
        for key, w in r["wrappers"].items():
            exp = expected_held(r, key)
            for state in STATES:
                rows.append({"key": key, "name": NAMES[key], "rank": r["rank"], "state": state,
                             "measured": w["held"][state], **exp[state]})
    return rows


def check_held(rows: list[dict]) -> int:
    """Assert measured == expected for every row; return how many were checked."""
    for row in rows:
        assert row["measured"] == row["expected"], (
            f"{row['name']} rank {row['rank']} {row['state']}: measured {row['measured']:,} B, "
            f"expected {row['expected']:,} B = formula {row['formula']:,} + padding "
            f"{row['padding']:,} + frozen {row['frozen']:,}")
    return len(rows)


def format_held_table(rows: list[dict], rank: int = 0) -> str:
    """Rank `rank`'s rows as text: measured, then formula + padding + frozen = expected."""
    head = (f"{'wrapper':<13}{'state':<11}{'measured':>10}{'formula':>11}{'padding':>9}"
            f"{'frozen':>8}{'expected':>10}")
    lines = [f"rank {rank}, bytes held between steps (fp32)", head]
    for row in (x for x in rows if x["rank"] == rank):
        lines.append(f"{row['name']:<13}{row['state']:<11}{row['measured']:>10,}"
                     f"{_fmt(row['formula']):>11}{_fmt(row['padding']):>9}{row['frozen']:>8,}"
                     f"{_fmt(row['expected']):>10}" + ("" if row["measured"] == row["expected"]
                                                      else "  DIFFERS"))
    return "\n".join(lines)


# --- bytes sent ----------------------------------------------------------------------------------------
def expected_traffic(r: dict, key: str) -> dict[str, dict[str, float]]:
    """{op: {"formula", "padding", "root_kept", "expected", "count"}} per step for wrapper `key`:
    `theory.traffic_bytes` at Ψ, then at the padded Ψ of what each collective moves (DDP's
    buckets, ZeRO-1's groups, fully_shard's units), less the root unit's backward all_gather
    (fully_shard keeps the root gathered from forward into backward, FSDP2's default)."""
    psi, n, w = r["psi"], r["world_size"], r["wrappers"][key]

    def at(p, stage):
        return theory.traffic_bytes(p, n, stage, "fp32")
    base = at(psi, w["stage"])
    out = {}
    if key in ("ddp", "zero1"):
        out["all_reduce"] = {"formula": base["all_reduce"],
                             "expected": at(_padded(w["buckets"]), 0)["all_reduce"],
                             "root_kept": 0.0, "count": len(w["buckets"])}
    if key == "zero1":
        out["all_gather"] = {"formula": base["all_gather"],
                             "expected": at(_padded(w["groups"]), 1)["all_gather"],
                             "root_kept": 0.0, "count": len(w["groups"])}
    if key in ("dim0", "flat"):
        units = w["units"]
        padded = at(_padded(units), 3)
        roots = [u for u in units if u["name"] == "root"]
        kept = -sum(theory.RING_FACTOR["all_gather"](n) * FP32 * u["padded_numel"] for u in roots)
        out["all_gather"] = {"formula": base["all_gather"], "root_kept": kept,
                             "expected": padded["all_gather"] + kept,
                             "count": 2 * len(units) - len(roots)}
        out["reduce_scatter"] = {"formula": base["reduce_scatter"], "root_kept": 0.0,
                                 "expected": padded["reduce_scatter"], "count": len(units)}
    for v in out.values():
        v["padding"] = v["expected"] - v["root_kept"] - v["formula"]
    return out


def traffic_rows(ranks: list[dict]) -> list[dict]:
    """One row per (wrapper, rank, step, op): measured bytes and collectives against expected."""
    rows = []
    for r in ranks:
        for key, w in r["wrappers"].items():
            exp = expected_traffic(r, key)
            for step, s in enumerate(w["steps"]):
                for op in sorted(set(exp) | set(s["bytes"])):
                    e = exp.get(op, {"formula": 0.0, "padding": 0.0, "root_kept": 0.0,
                                     "expected": 0.0, "count": 0})
                    rows.append({"key": key, "name": NAMES[key], "rank": r["rank"], "step": step,
                                 "op": op, "measured": s["bytes"].get(op, 0.0),
                                 "measured_count": s["count"].get(op, 0),
                                 "other_count": s["other_count"], **e})
    return rows


def check_traffic(rows: list[dict]) -> int:
    """Assert measured bytes == expected (to 1e-6 relative: ring factors are fractions) and the
    count of collectives, for every row; return the number of values checked."""
    for row in rows:
        where = f"{row['name']} rank {row['rank']} step {row['step']} {row['op']}"
        assert abs(row["measured"] - row["expected"]) <= 1e-6 * max(row["expected"], 1), (
            f"{where}: measured {row['measured']:,.1f} B, expected {row['expected']:,.1f} B")
        assert row["measured_count"] == row["count"], (
            f"{where}: {row['measured_count']} collectives, expected {row['count']}")
    return 2 * len(rows)


def format_traffic_table(rows: list[dict], rank: int = 0) -> str:
    """Rank `rank`'s last step as text: bytes by op, formula + padding + root kept = expected."""
    last = max(x["step"] for x in rows)
    head = (f"{'wrapper':<13}{'collective':<16}{'count':>6}{'measured':>10}{'formula':>10}"
            f"{'padding':>9}{'root kept':>11}{'expected':>10}")
    lines = [f"rank {rank}, step {last}: bytes sent per rank (ring), fp32", head]
    for row in (x for x in rows if x["rank"] == rank and x["step"] == last):
        lines.append(f"{row['name']:<13}{row['op']:<16}{row['measured_count']:>6}"
                     f"{_fmt(row['measured']):>10}{_fmt(row['formula']):>10}{_fmt(row['padding']):>9}"
                     f"{_fmt(row['root_kept']):>11}{_fmt(row['expected']):>10}")
    return "\n".join(lines)


# --- dim0 against flat -----------------------------------------------------------------------------
def layout_rows(ranks: list[dict]) -> list[dict]:
    """Per fully_shard unit and layout: Ψ_u, padded elements, each rank's padding elements."""
    rows = []
    for key in ("dim0", "flat"):
        if key not in ranks[0]["wrappers"]:
            continue
        for i, u in enumerate(ranks[0]["wrappers"][key]["units"]):
            rows.append({"layout": key, "unit": u["name"], "numel": u["numel"],
                         "padded_numel": u["padded_numel"], "shard_numel": u["shard_numel"],
                         "shapes": u["shapes"],
                         "padding": [r["wrappers"][key]["units"][i]["padding_in_shard"]
                                     for r in ranks]})
    return rows


def check_layouts(rows: list[dict], n: int) -> int:
    """Padding is what it must be: a unit's padded size is its ranks' shards; "flat" pads fewer
    than N elements per unit (ceil(Ψ_u/N)·N); "dim0" pads each parameter's rows to a multiple of N."""
    for row in rows:
        assert sum(row["padding"]) == row["padded_numel"] - row["numel"], row
        assert row["padded_numel"] == n * row["shard_numel"], row
        if row["layout"] == "flat":
            assert row["padded_numel"] - row["numel"] < n, row
        else:                   # rows rounded up to a multiple of N, times the rest (0-d: 1 row)
            rows_of = [(s[0] if s else 1, math.prod(s[1:])) for s in row["shapes"]]
            assert row["padded_numel"] == sum(-(-d0 // n) * n * rest for d0, rest in rows_of), row
    return len(rows)


def format_layout_table(rows: list[dict]) -> str:
    lines = [f"{'layout':<7}{'unit':<20}{'Ψ_u':>7}{'padded':>8}{'padding':>9}  padding on each rank"]
    for row in rows:
        pad = row["padded_numel"] - row["numel"]
        lines.append(f"{row['layout']:<7}{row['unit']:<20}{row['numel']:>7,}{row['padded_numel']:>8,}"
                     f"{pad:>9,}  {row['padding']}")
    for key in dict.fromkeys(r["layout"] for r in rows):
        sel = [r for r in rows if r["layout"] == key]
        numel, padded = sum(r["numel"] for r in sel), sum(r["padded_numel"] for r in sel)
        lines.append(f"{key:<7}{'all units':<20}{numel:>7,}{padded:>8,}{padded - numel:>9,}  "
                     f"{padded / numel - 1:.2%} more elements than Ψ")
    return "\n".join(lines)


def pieces(ranks: list[dict], unit: str) -> list[dict]:
    """Per parameter of fully_shard unit `unit`: its shape, and each rank's piece in layout
    "dim0" (rows x the rest) and "flat" (a range [lo, hi) of the parameter's flattened elements)."""
    n = len(ranks)
    dim0 = [next(u for u in r["wrappers"]["dim0"]["units"] if u["name"] == unit) for r in ranks]
    flat = next(u for u in ranks[0]["wrappers"]["flat"]["units"] if u["name"] == unit)
    out = []
    for i, name in enumerate(flat["params"]):
        numel, off, s = math.prod(flat["shapes"][i]), flat["offsets"][i], flat["shard_numel"]
        ranges = [(max(off, r * s) - off, min(off + numel, (r + 1) * s) - off) for r in range(n)]
        out.append({"param": name, "shape": flat["shapes"][i],
                    "dim0": [u["shard_shapes"][i] for u in dim0],
                    "flat": [(lo, hi) if hi > lo else None for lo, hi in ranges]})
    return out


def format_pieces(rows: list[dict], prefix: str = "") -> str:
    lines = [f"{'parameter':<34}{'shape':<14}{'dim0: rank r holds':<30}flat: rank r holds elements"]
    for row in rows:
        name = re.sub(rf"^{re.escape(prefix)}", "", row["param"])
        dim0 = " | ".join("x".join(map(str, s)) if s and s[0] else "-" for s in row["dim0"])
        whole = (0, math.prod(row["shape"]))
        flat = " | ".join("-" if p is None else "all" if p == whole else f"[{p[0]}, {p[1]})"
                          for p in row["flat"])
        lines.append(f"{name:<34}{'x'.join(map(str, row['shape'])):<14}{dim0:<30}{flat}")
    return "\n".join(lines)


# --- the figure ------------------------------------------------------------------------------------
def plot_held(rows: list[dict], rank: int = 0):
    """Stacked bars of rank `rank`'s measured bytes by state per wrapper, with the expected
    totals as black ticks; returns the figure."""
    import matplotlib.pyplot as plt

    from .plots import FONT, STATE_COLORS
    sel = [x for x in rows if x["rank"] == rank]
    names = list(dict.fromkeys(x["name"] for x in sel))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = [0.0] * len(names)
    colors = {"params": STATE_COLORS["params"], "grads": STATE_COLORS["grads"],
              "optimizer": STATE_COLORS["exp_avg"]}
    for state in STATES:
        vals = [next(x["measured"] for x in sel if x["name"] == nm and x["state"] == state)
                for nm in names]
        ax.bar(names, vals, bottom=bottom, label=state, color=colors[state])
        bottom = [b + v for b, v in zip(bottom, vals)]
    expected = [sum(x["expected"] for x in sel if x["name"] == nm) for nm in names]
    ax.scatter(names, expected, marker="_", s=900, color="black", label="formula + padding + frozen")
    ax.set_ylabel(f"bytes held on rank {rank}", fontsize=FONT)
    ax.set_title("bytes held between steps, by state (fp32, AdamW)")
    ax.tick_params(labelsize=FONT)
    handles, labels = ax.get_legend_handles_labels()
    order = [*STATES, "formula + padding + frozen"]          # the stack's order, then the ticks
    pairs = sorted(zip(handles, labels), key=lambda hl: order.index(hl[1]))
    # under the axes, clear of the wrapper names: never over the bars
    ax.legend(*zip(*pairs), fontsize=FONT, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              frameon=False, markerscale=0.5)         # the tick's marker fits its handle
    fig.tight_layout()
    return fig
