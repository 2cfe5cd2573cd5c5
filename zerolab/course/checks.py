"""Measured against the formula: rows, assertions and text tables for memory, traffic, the order
of one step's collectives, and scaling.

Idea: a lab (labs/lab*.ipynb) turns its runs into rows here (`memory_rows`, `traffic_rows`,
`scaling_rows`), prints them as tables, and asserts that the measured bytes equal
`zerolab.theory`'s formula at the padded Ψ (`check_memory`, `check_traffic`) and that one step
issues its collectives in the order the notes describe (`check_timeline`). A failed check raises
AssertionError naming the rank, stage and state (or collective) that differs.

    rows = traffic_rows(load_run("runs/lab2"))
    print(format_traffic_table(rows))
    check_traffic(rows)                       # the number of values checked
"""
from __future__ import annotations

import math

from .. import theory
from ..memory import TRANSIENT
from .results import COLLECTIVES, step_records, step_timeline, unit_bytes


# --- memory ------------------------------------------------------------------------------------
def memory_rows(runs: dict[int, list[dict]]) -> list[dict]:
    """One row per (stage, rank): measured bytes per state, the formula at the padded Ψ, the
    transient peaks, the meter's peak total and the allocator's figure."""
    rows = []
    for stage, ranks in sorted(runs.items()):
        for r in ranks:
            mem = r["memory"]
            alloc = mem.get("allocator") or {}
            rows.append({
                "stage": stage, "name": r["name"], "rank": r["rank"], "world_size": r["world_size"],
                "measured": {s: mem["model_states"][s] for s in theory.STATES},
                "formula": {s: r["theory"]["model_states_padded"][s] for s in theory.STATES},
                "formula_unpadded": {s: r["theory"]["model_states"][s] for s in theory.STATES},
                "transient_peak": {s: mem["peak"].get(s, 0) for s in TRANSIENT},
                "peak_total": mem["peak_total"],
                "allocator_source": alloc.get("source"),
                "allocator_peak": alloc.get("peak_absolute"),
                "allocator_by_type": alloc.get("by_type"),
            })
    return rows


def check_memory(runs: dict[int, list[dict]]) -> int:
    """Assert that every rank's measured bytes of every model state equal the formula at the
    padded Ψ. Returns the number of (stage, rank, state) values checked."""
    checked = 0
    for row in memory_rows(runs):
        for s in theory.STATES:
            m, f = row["measured"][s], row["formula"][s]
            assert m == f, (f"{row['name']} rank {row['rank']}: {s} measured {m:,} B but the "
                            f"formula gives {f:,.1f} B")
            checked += 1
    return checked


def format_memory_table(runs: dict[int, list[dict]], unit: float = 1.0) -> str:
    """Per stage (rank 0; every rank holds the same sizes): each state measured / formula."""
    head = f"{'stage':<8}" + "".join(f"{s:>16}" for s in (*theory.STATES, "total"))
    lines = [head]
    for row in memory_rows(runs):
        if row["rank"]:
            continue
        cells = [f"{row['measured'][s] / unit:,.0f}" for s in theory.STATES]
        cells.append(f"{sum(row['measured'].values()) / unit:,.0f}")
        lines.append(f"{row['name']:<8}" + "".join(f"{c:>16}" for c in cells))
        match = all(row["measured"][s] == row["formula"][s] for s in theory.STATES)
        lines.append(f"{'  formula':<8}" + "".join(
            f"{row['formula'][s] / unit:>16,.0f}" for s in theory.STATES)
            + f"{sum(row['formula'].values()) / unit:>16,.0f}" + ("   (equal)" if match else "  DIFFERS"))
    return "\n".join(lines)


def formula_lines(psi: float, psi_padded: float, n: int, precision: str = "bf16") -> str:
    """The per-rank totals by stage as the formulas read: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N."""
    b = theory.bytes_per_param(precision)
    k = b["master_weights"] + b["exp_avg"] + b["exp_avg_sq"]
    text = {0: f"{b['params'] + b['grads'] + k}Ψ", 1: f"{b['params'] + b['grads']}Ψ + {k}Ψ/N",
            2: f"{b['params']}Ψ + {b['grads'] + k}Ψ/N", 3: f"{b['params'] + b['grads'] + k}Ψ/N"}
    lines = [f"Ψ = {psi:,} parameters ({psi_padded:,} after padding every unit to a multiple of "
             f"N = {n}), {precision}"]
    for stage in theory.STAGES:
        total = theory.model_state_total(psi_padded, n, stage, precision)
        lines.append(f"  {theory.STAGE_NAMES[stage]:<7} {text[stage]:<14} = {total:>13,.0f} B per rank"
                     f"   ({total / psi_padded:.3g} bytes per parameter)")
    return "\n".join(lines)


# --- traffic -----------------------------------------------------------------------------------
def traffic_rows(runs: dict[int, list[dict]], label: str | None = None) -> list[dict]:
    """One row per stage: per-rank bytes of the last step by collective (the ledger's
    bytes_per_step, equal on every rank; max taken), the formula at the padded Ψ, the records'
    own sum, and wall time / busbw per collective over every step but the first (warm-up)."""
    rows = []
    for stage, ranks in sorted(runs.items()):
        r0 = ranks[0]
        measured = {op: max(r["comm"]["bytes_per_step"][op] for r in ranks) for op in COLLECTIVES}
        summed = {op: sum(x["bytes"] for x in step_records(r0) if x["op"] == op) for op in COLLECTIVES}
        timing = {}
        for op in COLLECTIVES:
            recs = [x for r in ranks for x in r["comm"]["records"]
                    if x["op"] == op and x["what"] in ("grads", "params")
                    and (x["step"] >= 1 or r0["steps"] == 1)]
            if recs:
                per_step = max(1, r0["steps"] - 1) * len(ranks)
                busbws = sorted(x["busbw"] for x in recs if x["busbw"] == x["busbw"])
                by_step: dict = {}           # (rank, step) -> seconds in this op: the spread
                for r in ranks:
                    for x in r["comm"]["records"]:
                        if x["op"] == op and x["what"] in ("grads", "params") and (
                                x["step"] >= 1 or r0["steps"] == 1):
                            by_step[r["rank"], x["step"]] = by_step.get((r["rank"], x["step"]), 0.0) + x["time_s"]
                timing[op] = {"seconds_per_step": sum(x["time_s"] for x in recs) / per_step,
                              "per_step_s": sorted(by_step.values()),
                              "time_sources": sorted({x.get("time_source") or "issue_to_wait"
                                                      for x in recs}),
                              "calls_per_step": len(recs) / per_step,
                              "median_busbw": busbws[len(busbws) // 2] if busbws else float("nan"),
                              "median_size_bytes": sorted(x["size_bytes"] for x in recs)[len(recs) // 2]}
        name = r0["name"] + (f" ({r0['zero1_grad_op']})" if stage == 1 else "")
        rows.append({"stage": stage, "name": label or name, "world_size": r0["world_size"],
                     "num_params_padded": r0["num_params_padded"], "backend": r0["backend"],
                     "measured": measured, "records_sum": summed,
                     "formula": {op: r0["theory"]["traffic_per_step_padded"][op] for op in COLLECTIVES},
                     "timing": timing})
    return rows


def check_traffic(rows: list[dict]) -> int:
    """Assert measured == formula per collective (and the records' sum == bytes_per_step)."""
    checked = 0
    for row in rows:
        for op in COLLECTIVES:
            m, f, s = row["measured"][op], row["formula"][op], row["records_sum"][op]
            assert m == s, f"{row['name']}: {op} bytes_per_step {m:,} != sum of its records {s:,}"
            assert math.isclose(m, f, rel_tol=1e-12, abs_tol=1e-6), (
                f"{row['name']}: {op} measured {m:,.1f} B per step but the formula gives {f:,.1f} B")
            checked += 1
    return checked


def format_traffic_table(rows: list[dict]) -> str:
    """Bytes per rank per step by collective, measured and formula, with the factor of 2Ψ."""
    lines = [f"{'stage':<26}" + "".join(f"{op:>16}" for op in COLLECTIVES)
             + f"{'total':>12}{'formula':>12}{'x 2Ψ':>7}"]
    for row in rows:
        total, form = sum(row["measured"].values()), sum(row["formula"].values())
        two_psi = 2 * row["num_params_padded"]
        lines.append(f"{row['name']:<26}" + "".join(f"{row['measured'][op]:>16,.0f}" for op in COLLECTIVES)
                     + f"{total:>12,.0f}{form:>12,.0f}{total / two_psi:>7.3f}")
    n = rows[0]["world_size"] if rows else 0
    if n:
        lines.append(f"(N = {n}: 2(N-1)/N = {2 * (n - 1) / n:.3f}, 3(N-1)/N = {3 * (n - 1) / n:.3f})")
    return "\n".join(lines)


def format_timing_table(rows: list[dict]) -> str:
    """Each collective's own time per step and busbw (machine-dependent: never compare these in
    nbval), then one line per way the times were measured (zerolab.comm.TIME_SOURCES)."""
    from ..comm import TIME_SOURCES
    how = {**TIME_SOURCES, "issue_to_wait": "issue to wait() returning (a run recorded before "
           "per-op timing: includes compute and queued collectives)"}
    lines = [f"{'stage':<26}{'collective':<16}{'calls/step':>11}{'ms/step':>10}{'median S (B)':>14}"
             f"{'median busbw':>16}"]
    for row in rows:
        for op, t in row["timing"].items():
            lines.append(f"{row['name']:<26}{op:<16}{t['calls_per_step']:>11.0f}"
                         f"{1e3 * t['seconds_per_step']:>10.2f}{t['median_size_bytes']:>14,}"
                         f"{t['median_busbw'] / 1e6:>12.1f} MB/s")
    sources = sorted({src for row in rows for t in row["timing"].values()
                      for src in t.get("time_sources", [])})
    lines += [f"times ({src}): {how.get(src, src)}" for src in sources]
    return "\n".join(lines)


# --- timeline ----------------------------------------------------------------------------------
def format_collectives(r: dict) -> str:
    """The collectives of the last step in issue order: seq, phase, op, unit, bytes."""
    lines = [f"{'seq':>4}  {'phase':<9}{'op':<16}{'unit':<10}{'S (B)':>10}{'ring bytes':>12}"]
    recs = step_records(r)
    first = recs[0]["seq"] if recs else 0
    for x in recs:
        lines.append(f"{x['seq'] - first:>4}  {x['phase']:<9}{x['op']:<16}{x['unit']:<10}"
                     f"{x['size_bytes']:>10,}{x['bytes']:>12,.0f}")
    return "\n".join(lines)


def check_timeline(r: dict) -> list[str]:
    """Assert the order and the transient memory the notes describe for one rank's last step;
    return the facts checked, as lines to print."""
    stage, recs = r["stage"], step_records(r)
    blocks = [u["name"] for u in r["units"] if u["name"] != "root"]
    units = unit_bytes(r)
    order = [(x["phase"], x["op"], x["unit"]) for x in recs]
    facts = []
    if stage == 2:
        back = [u for ph, op, u in order if ph == "backward"]
        assert all(op == "reduce_scatter" for ph, op, _ in order if ph == "backward"), order
        assert back[:len(blocks)] == blocks[::-1], f"ZeRO-2 reduce_scatter order {back}"
        facts.append(f"ZeRO-2: backward reduce_scatters one bucket per block, last block first: "
                     f"{' -> '.join(back)}")
        step = [(op, u) for ph, op, u in order if ph == "step"]
        assert all(op == "all_gather" for op, _ in step) and len(step) == len(units), step
        facts.append(f"ZeRO-2: the step all_gathers every unit once ({len(step)} all_gathers)")
    if stage == 3:
        fwd = [u for ph, op, u in order if ph == "forward"]
        assert all(op == "all_gather" for ph, op, _ in order if ph == "forward"), order
        assert fwd == ["root", *blocks], f"ZeRO-3 forward gathers {fwd}"
        facts.append(f"ZeRO-3: forward all_gathers root, then each block just before it runs: "
                     f"{' -> '.join(fwd)}")
        bag = [u for ph, op, u in order if ph == "backward" and op == "all_gather"]
        brs = [u for ph, op, u in order if ph == "backward" and op == "reduce_scatter"]
        assert bag == ["root", *blocks[::-1]], f"ZeRO-3 backward gathers {bag}"
        assert brs == [*blocks[::-1], "root"], f"ZeRO-3 backward reduce_scatters {brs}"
        facts.append(f"ZeRO-3: backward gathers each block again (reverse order) and reduce_scatters "
                     f"its gradients: {len(bag)} all_gathers, {len(brs)} reduce_scatters")
        assert not [1 for ph, op, u in order if ph == "step" and op == "all_gather"]
        facts.append("ZeRO-3: no all_gather after the step (nobody keeps full weights)")
    if stage in (2, 3) and "timeline" in r["memory"] and r["memory"]["timeline"]:
        tl = step_timeline(r)
        buckets = max(row.get("grad_buckets", 0) for row in tl)
        full = sum(units.values())
        assert 0 < buckets < full or len(blocks) < 4, (buckets, full)
        facts.append(f"{r['name']}: the gradient buckets peak at {buckets:,} B, below the full "
                     f"gradient's {full:,} B: buckets are freed once reduce-scattered")
        assert tl[-1].get("grad_buckets", 0) == 0
    if stage == 3 and r["memory"].get("timeline"):
        tl = step_timeline(r)
        gathered = max(row.get("gathered_params", 0) for row in tl)
        expect = units["root"] + max(units[b] for b in blocks)
        assert gathered == expect, f"gathered peak {gathered} != root + largest block {expect}"
        facts.append(f"ZeRO-3: at most root + one block are gathered at a time: peak {gathered:,} B "
                     f"= {units['root']:,} + {max(units[b] for b in blocks):,}")
        frees = [row for row in tl if row["tag"].startswith("free block")]
        assert all(row["gathered_params"] == units["root"] for row in frees), "a block stayed gathered"
        facts.append(f"ZeRO-3: after each of the {len(frees)} 'free block' samples only root "
                     f"({units['root']:,} B) stays gathered")
        assert tl[-1]["gathered_params"] == 0
    return facts


# --- scaling -----------------------------------------------------------------------------------
def preset_psi(preset: str) -> int:
    """Ψ of a preset, counted on the meta device (no memory is allocated, even for "1b")."""
    import torch

    from ..model import GPT, get_config, num_params
    with torch.device("meta"):
        return num_params(GPT(get_config(preset)))


def padded_psi(preset: str, world_size: int) -> int:
    """Ψ after zerolab pads every unit (root, then one per block) to a multiple of world_size:
    what the measured bytes match. Counted on the meta device."""
    import torch

    from ..model import GPT, get_config
    from ..sharding import build_units
    with torch.device("meta"):
        model = GPT(get_config(preset))
    return sum(u.padded_numel for u in build_units(model, world_size, 0))


def scaling_rows(runs_by_n: dict[int, dict[int, list[dict]]]) -> list[dict]:
    """One row per (world size, stage): measured per-rank bytes per state (rank 0; the check
    covers every rank), formula at padded and unpadded Ψ."""
    rows = []
    for n, runs in sorted(runs_by_n.items()):
        for stage, ranks in sorted(runs.items()):
            r0 = ranks[0]
            rows.append({"world_size": n, "stage": stage, "name": r0["name"],
                         "psi": r0["num_params"], "psi_padded": r0["num_params_padded"],
                         "measured": dict(r0["memory"]["model_states"]),
                         "formula": dict(r0["theory"]["model_states_padded"]),
                         "formula_unpadded": dict(r0["theory"]["model_states"])})
    return rows


def format_scaling_table(rows: list[dict]) -> str:
    """Per-rank model-state bytes by stage (columns) and world size (rows), measured."""
    sizes = sorted({r["world_size"] for r in rows})
    stages = sorted({r["stage"] for r in rows})
    lines = [f"{'N':>3}" + "".join(f"{theory.STAGE_NAMES[s]:>12}" for s in stages)
             + f"{'DDP / ZeRO-3':>14}"]
    for n in sizes:
        by = {r["stage"]: sum(r["measured"].values()) for r in rows if r["world_size"] == n}
        ratio = by[0] / by[3] if 0 in by and 3 in by else float("nan")
        lines.append(f"{n:>3}" + "".join(f"{by[s]:>12,}" for s in stages) + f"{ratio:>14.2f}")
    return "\n".join(lines)


def preset_table(presets=None, world_size: int = 8, precision: str = "bf16") -> list[dict]:
    """Formula per-rank model-state totals of every preset at `world_size` ranks."""
    from ..model import PRESETS
    rows = []
    for name in presets or PRESETS:
        psi = preset_psi(name)
        rows.append({"preset": name, "psi": psi, **{
            theory.STAGE_NAMES[s]: theory.model_state_total(psi, world_size, s, precision)
            for s in theory.STAGES}})
    return rows
