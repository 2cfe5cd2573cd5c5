"""The labs' helpers: check a lab's parameters, read its runs, assert measured == formula, and
`zerolab labs`, which executes every lab notebook with papermill and writes one report.

Idea: a lab notebook (labs/lab*.ipynb) keeps only prose, a `parameters` cell and short calls
into this module and `zerolab.plots`, so that each number it prints comes from one place and is
checked against `zerolab.theory` in one place. `check_parameters` stops a lab with one clear
line before any rank starts; the `check_*` functions raise AssertionError naming the rank, stage
and state (or collective) whose measured bytes differ from the formula.

    zerolab labs                                    # every lab, parameters that fit this machine
    zerolab labs --only memory,traffic -p steps=3   # some labs, with a papermill override
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from . import theory
from .memory import TRANSIENT

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
LAB_DIR = Path(__file__).resolve().parent.parent / "labs"


# --- parameters --------------------------------------------------------------------------------
class LabParameterError(ValueError):
    """A lab parameter no run could use. In a notebook it prints as one line, no traceback."""

    def _render_traceback_(self):          # IPython: show the message only
        return [f"LabParameterError: {self}"]


def _bad(message):
    raise LabParameterError(message)


def _int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _bad(f"{name} = {value!r} must be an integer >= {minimum}"
             + (f" (not the string {value!r})" if isinstance(value, str) else ""))
    return value


def batch_size_for(world_size: int, base: int = 8) -> int:
    """The smallest multiple of `world_size` that is >= `base` (rows of one global batch)."""
    return math.ceil(base / world_size) * world_size


def check_parameters(*, nproc="auto", backend="auto", device="auto", stages="0,1,2,3",
                     preset="nano", steps=2, out=None, world_sizes=None, gpus=None,
                     **extra) -> SimpleNamespace:
    """Check a lab's papermill parameters before any process starts; return them resolved.

    nproc: an int >= 1, or "auto" (one rank per GPU when >= 2 GPUs are usable, else 2 CPU ranks).
    backend / device: "auto", or as zerolab.launch.resolve accepts (NCCL needs one GPU per rank).
    stages: "0,1,2,3", a list of ints, or one int. preset: a zerolab.model preset. steps: int >= 1.
    world_sizes (scaling lab): "auto" or a list of ints >= 1. Raises LabParameterError (one line)
    naming the bad value and what is accepted. Returns nproc, backend, device, stages (text),
    stage_list, preset, steps, batch_size, out (Path or None), world_sizes, gpus.
    """
    from .launch import cuda_device_count, resolve
    from .model import get_config
    from .train import parse_stages

    gpus = cuda_device_count() if gpus is None else gpus
    if nproc == "auto":
        nproc = min(gpus, 8) if (gpus >= 2 and device in ("auto", "cuda")
                                 and backend in ("auto", "nccl")) else 2
    nproc = _int("nproc", nproc)
    steps = _int("steps", steps)
    if isinstance(stages, bool):
        _bad(f"stages = {stages!r} must be text like '0,1,2,3', a list of ints or one int")
    if isinstance(stages, int):
        stages = str(stages)
    elif isinstance(stages, (list, tuple)):
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in stages):
            _bad(f"stages = {stages!r} must hold integers 0-3")
        stages = ",".join(str(s) for s in stages)
    if not isinstance(stages, str):
        _bad(f"stages = {stages!r} must be text like '0,1,2,3', a list of ints or one int")
    try:
        stage_list = parse_stages(stages)
    except ValueError as err:
        _bad(str(err))
    if not isinstance(preset, str):
        _bad(f"preset = {preset!r} must be a preset name (text)")
    try:
        get_config(preset)
    except ValueError as err:
        _bad(str(err))
    if isinstance(world_sizes, str) and world_sizes != "auto":     # "1,2,4" from a command line
        try:
            world_sizes = [int(w) for w in world_sizes.split(",") if w.strip()]
        except ValueError:
            _bad(f"world_sizes = {world_sizes!r} must be 'auto' or a list of integers >= 1")
    if world_sizes in (None, "auto"):
        world_sizes = _auto_world_sizes(nproc, backend, device, gpus) if world_sizes else None
    else:
        if not isinstance(world_sizes, (list, tuple)) or not world_sizes:
            _bad(f"world_sizes = {world_sizes!r} must be 'auto' or a list of integers >= 1")
        world_sizes = [_int("world_sizes entry", w) for w in world_sizes]
    try:
        for n in sorted({nproc, *(world_sizes or [])}):
            backend_n, device_n = resolve(n, backend, device, gpus=gpus)
            if n == nproc:
                resolved = backend_n, device_n
    except ValueError as err:
        _bad(str(err))
    if out is not None and not isinstance(out, (str, Path)):
        _bad(f"out = {out!r} must be a folder path (text)")
    unknown = ", ".join(sorted(extra))
    if unknown:
        _bad(f"unknown lab parameter(s): {unknown}")
    return SimpleNamespace(nproc=nproc, backend=resolved[0], device=resolved[1], stages=stages,
                           stage_list=stage_list, preset=preset, steps=steps,
                           batch_size=batch_size_for(max([nproc, *(world_sizes or [])])),
                           out=Path(out) if out is not None else None, world_sizes=world_sizes,
                           gpus=gpus)


def _auto_world_sizes(nproc, backend, device, gpus):
    """CPU: 1, 2, 4 ranks (8 CPU ranks on 2 cores take too long for a lab); GPU: powers of two
    up to the GPU count (at most 8)."""
    if gpus >= 2 and device in ("auto", "cuda") and backend in ("auto", "nccl"):
        return [w for w in (1, 2, 4, 8) if w <= gpus]
    return [1, 2, 4]


def describe(p: SimpleNamespace) -> str:
    """One line: what will run."""
    where = f"{p.backend} on {p.device}"
    return (f"{p.nproc} rank(s), {where}, stages {p.stages}, preset {p.preset}, {p.steps} step(s), "
            f"global batch {p.batch_size} rows" + (f", out {p.out}" if p.out else ""))


# --- reading runs ------------------------------------------------------------------------------
def step_records(r: dict, step: int | None = None, what=("grads", "params")) -> list[dict]:
    """The ledger records of one rank json for `step` (default: the last), in issue order."""
    step = r["steps"] - 1 if step is None else step
    return sorted((x for x in r["comm"]["records"] if x["step"] == step and x["what"] in what),
                  key=lambda x: x["seq"])


def step_timeline(r: dict) -> list[dict]:
    """memory.timeline of one rank json (the last step), up to its "step done" sample.
    Raises ValueError when the run had no timeline."""
    rows = r["memory"].get("timeline") or []
    if not rows:
        raise ValueError("this run has no memory timeline: launch it with timeline=True")
    ends = [i for i, row in enumerate(rows) if row["tag"] == "step done"]
    return rows[: ends[0] + 1] if ends else rows


def element_size(precision: str) -> int:
    """Bytes of one bf16 / fp32 parameter element (what params and grads are held in)."""
    return theory.bytes_per_param(precision)["params"]


def unit_bytes(r: dict) -> dict[str, int]:
    """{unit name: bytes of its full (padded) bf16/fp32 flat buffer} from a rank json."""
    es = element_size(r["precision"])
    return {u["name"]: u["padded_numel"] * es for u in r["units"]}


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
    from .comm import TIME_SOURCES
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

    from .model import GPT, get_config, num_params
    with torch.device("meta"):
        return num_params(GPT(get_config(preset)))


def padded_psi(preset: str, world_size: int) -> int:
    """Ψ after zerolab pads every unit (root, then one per block) to a multiple of world_size:
    what the measured bytes match. Counted on the meta device."""
    import torch

    from .model import GPT, get_config
    from .sharding import build_units
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
    from .model import PRESETS
    rows = []
    for name in presets or PRESETS:
        psi = preset_psi(name)
        rows.append({"preset": name, "psi": psi, **{
            theory.STAGE_NAMES[s]: theory.model_state_total(psi, world_size, s, precision)
            for s in theory.STAGES}})
    return rows


# --- same training -----------------------------------------------------------------------------
def load_params(out, stage: int) -> dict:
    """{name: fp32 tensor} saved by `zerolab.train --save-params` for `stage` under `out`.

    Loaded with weights_only=True (tensors and plain containers only: never code). When OUT has a
    run manifest, the file must be the one that run wrote: its sha256 must equal the one in that
    run's stage{S}/rank0.json; ValueError otherwise."""
    import hashlib

    import torch

    from .runs import read_manifest
    path = Path(out) / f"stage{stage}" / "params.pt"
    manifest = read_manifest(out)
    if manifest:
        try:
            r0 = json.loads((path.parent / "rank0.json").read_text())
        except (OSError, ValueError):
            r0 = {}
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if r0.get("run_id") != manifest["run_id"] or r0.get("params_sha256") != digest:
            raise ValueError(f"{str(path)!r} is not the file run {manifest['run_id']} wrote there "
                             "(its sha256 is not in that run's rank0.json)")
    return torch.load(path, map_location="cpu", weights_only=True)


def max_param_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over every element of every parameter (same names in both)."""
    assert a.keys() == b.keys(), "the two runs hold different parameters"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


PARAM_DIFFS = "param_diffs.json"


def param_diffs(out, stages) -> dict[int, dict[str, float]]:
    """{stage: {parameter name: largest |Δ| of its fp32 elements against stages[0]}} for every
    stage after the first, of the run in OUT (`zerolab.train --save-params`).

    Computed from OUT/stage{S}/params.pt (`load_params`) and written to OUT/param_diffs.json, a
    few KB, which is what the committed reference run keeps of lab 5 (zerolab.reference): in
    reference mode it is read back from there instead (FileNotFoundError / ValueError, one line,
    when it is missing or compares other stages)."""
    from . import reference
    from .runs import atomic_json
    out, stages = Path(out), [int(s) for s in stages]
    path = out / PARAM_DIFFS
    if reference.active():                # restored by nb.launch; any params.pt here is stale
        if not path.exists():
            raise FileNotFoundError(f"reference mode: no {PARAM_DIFFS} in {str(out)!r}")
        data = json.loads(path.read_text())
        have = [data["reference_stage"], *map(int, data["diffs"])]
        if have[0] != stages[0] or not set(stages) <= set(have):
            raise ValueError(f"the reference run compares stages {have} (the first is the "
                             f"reference), not {stages}")
        return {s: data["diffs"][str(s)] for s in stages[1:]}
    params = {s: load_params(out, s) for s in stages}
    base = params[stages[0]]
    diffs = {}
    for s in stages[1:]:
        assert params[s].keys() == base.keys(), "the two runs hold different parameters"
        diffs[s] = {k: float((params[s][k] - base[k]).abs().max()) for k in base}
    atomic_json(path, {"reference_stage": stages[0], "unit": "max |delta| of fp32 elements",
                       "diffs": {str(s): d for s, d in diffs.items()}})
    return diffs


# --- summaries and the `zerolab labs` report -----------------------------------------------------
def save_summary(out, lab: str, numbers: dict, notes: list[str] | None = None) -> Path:
    """Write OUT/summary.json: the lab's key measured-vs-formula numbers for `zerolab labs`."""
    from .runs import atomic_json, read_manifest
    out = Path(out)
    run_id = (read_manifest(out) or {}).get("run_id")
    return atomic_json(out / "summary.json", {"lab": lab, "run_id": run_id, "numbers": numbers,
                                              "notes": notes or []}, default=float)


def lab_notebooks(labs_dir: Path | None = None, only: str | None = None) -> list[Path]:
    """labs/lab*.ipynb (LAB_DIR, read at call time) in order, filtered by `only` (comma list of
    name fragments)."""
    labs_dir = LAB_DIR if labs_dir is None else labs_dir
    if not labs_dir.is_dir():
        raise FileNotFoundError(f"no labs folder at {str(labs_dir)!r}: run from a zerolab checkout "
                                "(pip install -e .)")
    books = sorted(labs_dir.glob("lab*.ipynb"))
    if only:
        frags = [f.strip() for f in only.split(",") if f.strip()]
        books = [b for b in books if any(f in b.stem for f in frags)]
        if not books:
            raise ValueError(f"--only {only!r} matches no lab in {labs_dir} "
                             f"({', '.join(b.stem for b in sorted(labs_dir.glob('lab*.ipynb')))})")
    return books


def _parse_overrides(items) -> list[tuple[str, str]]:
    """[(name, value text)] from "NAME=VALUE" items. papermill writes names and values into the
    parameters cell as code, so a name must be a Python identifier (ASCII), a value one line of
    valid YAML; ValueError (one line) otherwise."""
    import yaml
    out = []
    for item in items or []:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"--parameter {item!r} must look like NAME=VALUE with NAME a Python "
                             "identifier (e.g. steps=3)")
        if any(c in value for c in "\r\n\x0b\x0c\x85\u2028\u2029") or not value.isprintable():
            raise ValueError(f"--parameter {name}: the value {value!r} must be one line of "
                             "printable text")
        try:
            yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"--parameter {name}={value!r} is not valid YAML ({problem}); "
                             "quote text, e.g. stages='0,1'") from None
        out.append((name, value))
    return out


COMMON = ("nproc", "backend", "device", "stages", "preset", "steps")


def _check_overrides(overrides):
    """Check the overrides every lab shares (read as papermill reads them, YAML) with
    `check_parameters`, so that a bad value stops `zerolab labs` before any lab starts."""
    import yaml
    common = {name: yaml.safe_load(value) for name, value in overrides if name in COMMON}
    if common:
        check_parameters(**common)


def _error_text(err: Exception) -> str:
    text = str(err)
    hit = [h for h in re.findall(r"(?m)^\s*\w*(?:Error|Exception)\w*:? .*$", text)
           if "ChildFailedError" not in h]
    return hit[-1].strip() if hit else text.strip().splitlines()[-1][:300] if text.strip() else repr(err)


def run_labs(args) -> int:
    """`zerolab labs`: execute each lab with papermill into OUT/, then write OUT/report.md.

    args.out: output folder; args.only: comma list of name fragments; args.parameter: list of
    "NAME=VALUE" papermill overrides for every lab; args.timeout: seconds per lab. Every lab
    runs even when one fails; returns 1 when any failed, else 0.
    """
    from .runs import start_run
    out = Path(args.out).resolve()
    books = lab_notebooks(only=args.only)
    overrides = _parse_overrides(args.parameter)
    _check_overrides(overrides)
    with start_run(out, command="labs", args=vars(args), world_size=0,
                   overwrite=getattr(args, "overwrite", False)) as run:
        code = _run_books(books, out, overrides, args.timeout, run.run_id)
    return code


def _run_books(books, out, overrides, timeout, run_id) -> int:
    from .launch import LaunchError, LaunchInterrupted, run
    from .nb import own_kernel
    kernel, env = own_kernel(out / ".jupyter")      # this interpreter, whatever kernelspecs exist
    results = []
    t_all = time.perf_counter()
    interrupted = None
    for book in books:
        lab_out = out / book.stem
        cmd = [sys.executable, "-m", "papermill", str(book), str(out / book.name),
               "--cwd", str(book.parent), "-p", "out", str(lab_out), "--log-output",
               "--no-progress-bar", "-k", kernel]
        for name, value in overrides:           # YAML: 4 -> int, [1, 2] -> list, tiny -> text
            cmd += ["-y", f"{name}: {value}"]
        print(f"zerolab labs: {book.stem} ...", flush=True)
        t0 = time.perf_counter()
        status, error = "ok", ""
        try:
            run(cmd, timeout=timeout, echo=_lab_echo, env=env)
        except LaunchInterrupted as err:    # Ctrl-C / SIGTERM: stop the whole `zerolab labs`
            interrupted = str(err).splitlines()[0]
            status, error = "interrupted", interrupted
        except LaunchError as err:
            status, error = "FAILED", _error_text(err)
        _tag_notebook(out / book.name, run_id)
        seconds = time.perf_counter() - t0
        summary = {}
        if (lab_out / "summary.json").exists():
            summary = json.loads((lab_out / "summary.json").read_text())
        results.append({"lab": book.stem, "status": status, "error": error, "seconds": seconds,
                        "summary": summary, "pngs": sorted(p.name for p in lab_out.glob("*.png"))
                        if lab_out.exists() else [], "notebook": book.name})
        print(f"zerolab labs: {book.stem} {status} in {seconds:.0f} s" + (f": {error}" if error else ""),
              flush=True)
        if interrupted:
            break
    report = write_report(out, results, time.perf_counter() - t_all, overrides, run_id,
                          interrupted=interrupted, planned=len(books))
    print(f"zerolab labs: report at {report}")
    if interrupted:
        raise LaunchInterrupted(f"{interrupted}; report at {report}")
    return 1 if any(r["status"] != "ok" for r in results) else 0


_NOISE = re.compile(r"Executing Cell|Ending Cell|Kernel is running over TCP without encryption"
                    r"|^\s*(\S+ \S+ \[\w+\]\s*)?<Figure size [^>]*>\s*$")


def _tag_notebook(path: Path, run_id: str):
    """Record the run id in an executed notebook's metadata (metadata.zerolab.run_id)."""
    from .runs import atomic_json
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    nb.setdefault("metadata", {})["zerolab"] = {"run_id": run_id}
    atomic_json(path, nb)


def _lab_echo(line: str):
    """papermill's log: keep the ranks' progress and the lab's own prints, drop kernel chatter
    (cell markers, the kernel's TCP-encryption warning, `<Figure ...>` reprs of plotted cells)."""
    if not line.strip() or _NOISE.search(line):
        return
    print("   ", re.sub(r"^\S+ \S+ \[\w+\]\s*", "", line), flush=True)


def write_report(out: Path, results: list[dict], seconds: float, overrides=(), run_id=None,
                 interrupted: str | None = None, planned: int | None = None) -> Path:
    """OUT/report.md: status, runtime, key numbers and figures of every lab; says "interrupted"
    first when the run was stopped before its last lab."""
    from .runs import atomic_write
    ok = sum(r["status"] == "ok" for r in results)
    head = ([f"**Run interrupted** ({interrupted}) after {len(results)} of {planned or len(results)} "
             "labs; the labs after it did not run.", ""] if interrupted else [])
    lines = ["# ZeroLab labs report", "", *head,
             f"{ok} of {len(results)} labs passed in {seconds:.0f} s"
             + (f"; overrides: {', '.join(f'{k}={v}' for k, v in overrides)}" if overrides else "")
             + "." + (f" Run {run_id}." if run_id else ""), "",
             "| lab | status | seconds | executed notebook |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['lab']} | {r['status']} | {r['seconds']:.0f} | [{r['notebook']}]({r['notebook']}) |")
    for r in results:
        lines += ["", f"## {r['lab']}: {r['status']}", ""]
        if r["error"]:
            lines += [f"Error: `{r['error'].replace('`', chr(39))}`", ""]
        numbers = (r["summary"] or {}).get("numbers", {})
        if numbers:
            lines += ["| quantity | value |", "|---|---|"]
            lines += [f"| {k.replace('|', chr(92) + '|')} | {_fmt(v)} |"      # escape | in cells
                      for k, v in numbers.items()]
            lines.append("")
        for note in (r["summary"] or {}).get("notes", []):
            lines.append(f"- {note}")
        if (r["summary"] or {}).get("notes"):
            lines.append("")
        for png in r["pngs"]:
            lines += [f"![{r['lab']}: {png}]({r['lab']}/{png})", ""]
    return atomic_write(out / "report.md", "\n".join(lines) + "\n")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:,.6g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
