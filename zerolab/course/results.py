"""Reading runs back: a run folder's rank JSONs, one step's collectives and memory timeline, and
the saved parameters of `--save-params`.

Idea: every rank wrote OUT/stage{S}/rank{r}.json (`zerolab.run.result`); `load_run` turns a run
folder into {stage: [rank0, rank1, ...]} of that run only, and the functions below pick the parts
the checks, tables and plots need. `zerolab compare`, the labs and the notebooks all read runs
through here.

    runs = load_run("runs/compare")
    step_records(runs[3][0])          # rank 0's ZeRO-3 collectives of the last step, in order
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import theory

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")   # what the strategies issue


def load_run(out_dir, echo=None) -> dict[int, list[dict]]:
    """{stage: [rank0 json, rank1 json, ...]} from OUT/stage*/rank*.json, of one run only.

    The run is the one OUT/run.json names (`zerolab.run.folders`); files of other runs (a stale rank3
    after a 2-rank rerun, a stage left from an earlier run) are left out, and `echo` (default:
    stderr) says so. Raises FileNotFoundError naming `out_dir` when it holds no results of that
    run, and ValueError when a stage lacks some rank of the run's world size."""
    from ..run.folders import one_run
    out = Path(out_dir)
    items = [(p, json.loads(p.read_text())) for folder in sorted(out.glob("stage[0-3]"))
             for p in folder.glob("rank*.json") if p.stem[4:].isdigit()]
    run_id, items = one_run(out, items, echo)
    runs: dict[int, list[dict]] = {}
    for _, r in sorted(items, key=lambda x: (x[1]["stage"], x[1]["rank"])):
        runs.setdefault(r["stage"], []).append(r)
    if not runs:
        raise FileNotFoundError(f"no stage*/rank*.json of run {run_id} under {str(out)!r}: run "
                                "zerolab train first")
    for stage, ranks in runs.items():
        n = ranks[0]["world_size"]
        if [r["rank"] for r in ranks] != list(range(n)):
            raise ValueError(f"{str(out)!r}: stage {stage} of run {run_id} has rank files "
                             f"{[r['rank'] for r in ranks]}, not 0..{n - 1} (the run did not finish)")
    return runs


# --- one rank's step ----------------------------------------------------------------------------
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


# --- same training -----------------------------------------------------------------------------
def load_params(out, stage: int) -> dict:
    """{name: fp32 tensor} saved by `zerolab.run.train --save-params` for `stage` under `out`.

    Loaded with weights_only=True (tensors and plain containers only: never code). When OUT has a
    run manifest, the file must be the one that run wrote: its sha256 must equal the one in that
    run's stage{S}/rank0.json; ValueError otherwise."""
    import hashlib

    import torch

    from ..run.folders import read_manifest
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
    stage after the first, of the run in OUT (`zerolab.run.train --save-params`).

    Computed from OUT/stage{S}/params.pt (`load_params`) and written to OUT/param_diffs.json, a
    few KB, which is what the committed reference run keeps of lab 5 (zerolab.course.reference): in
    reference mode it is read back from there instead (FileNotFoundError / ValueError, one line,
    when it is missing or compares other stages)."""
    from . import reference
    from ..run.folders import atomic_json
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


