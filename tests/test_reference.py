"""The committed reference results (zerolab.course.reference) that labs plot when a launch fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LABS = ("lab1_memory_by_stage", "lab2_traffic_by_stage", "lab3_step_timeline", "lab4_scaling",
        "lab5_same_training", "lab6_time_by_stage", "lab8_tiers")


def _keys():
    from zerolab.course import reference
    return sorted({str(p.parent.parent.relative_to(reference.FOLDER))
                   for p in reference.FOLDER.glob("**/stage*/rank0.json")})


def test_reference_runs_restore_and_equal_the_formulas(tmp_path):
    """The committed CPU reference run of every lab restores into any out folder and its bytes
    held and sent equal the formulas (the labs' own checks), so plots drawn from it are right."""
    from zerolab import nb
    from zerolab.course import checks, reference
    from zerolab.course.results import load_run
    keys = _keys()
    assert {k.split("/")[0] for k in keys} == set(LABS)
    for k in keys:
        runs = load_run(reference.restore(tmp_path / "runs" / "labs" / k))
        assert checks.check_memory(runs) > 0
        assert checks.check_traffic(checks.traffic_rows(runs)) > 0
    nb.use_reference()
    try:
        printed = []
        runs = nb.launch(stages="0,1,2,3", nproc=4, out=tmp_path / "x" / "lab1_memory_by_stage",
                         echo=printed.append)
        assert sorted(runs) == [0, 1, 2, 3] and "no ranks launched" in printed[0]
        # the class's case: a launch failed in this folder (its manifest names that run), then
        # reference mode and the cell rerun: the reference run is read, the failed manifest kept
        failed = tmp_path / "y" / "lab2_traffic_by_stage" / "notes"
        failed.mkdir(parents=True)
        (failed / "run.json").write_text('{"run_id": "F", "command": "train", "status": "failed"}')
        assert sorted(nb.launch(out=failed, echo=printed.append)) == [0, 1, 2, 3]
        assert (failed / "run.F.json").exists()
        with pytest.raises(FileNotFoundError, match="no reference run for 'lab5_same_training/fp16'"):
            nb.launch(out=tmp_path / "lab5_same_training" / "fp16")
    finally:
        nb.use_reference(False)


def test_lab5_reference_is_the_same_training(tmp_path):
    """Lab 5's reference keeps, per precision, every stage's losses (rank JSONs) and each
    parameter's largest |Δ| to DDP (param_diffs.json, not the binary params.pt): the names are
    exactly the nano GPT's parameters, and the lab's fp32 checks hold (|Δparam| <= 1e-6,
    |Δloss| <= 1e-5) while the stored grad norms and losses are finite and the losses fall."""
    import torch

    from zerolab import nb
    from zerolab.course import results
    from zerolab.model import GPT, get_config
    nb.use_reference()
    try:
        for prec in ("fp32", "bf16"):
            out = tmp_path / "runs" / "lab5_same_training" / prec
            runs = nb.launch(stages="0,1,2,3", out=out, echo=lambda line: None)
            assert sorted(runs) == [0, 1, 2, 3]
            cfg = get_config(runs[0][0]["preset"])
            names = set(GPT(cfg).state_dict())
            diffs = results.param_diffs(out, [0, 1, 2, 3])
            assert sorted(diffs) == [1, 2, 3]
            base = runs[0][0]
            for s, d in diffs.items():
                assert set(d) == names and all(v >= 0 for v in d.values())
                r0 = runs[s][0]
                assert r0["precision"] == prec and len(r0["losses"]) == len(base["losses"])
                dloss = max(abs(a - b) for a, b in zip(r0["losses"], base["losses"]))
                if prec == "fp32":
                    assert max(d.values()) <= 1e-6 and dloss <= 1e-5, (s, max(d.values()), dloss)
            assert base["losses"][-1] < base["losses"][0] and all(
                torch.isfinite(torch.tensor(base["grad_norms"])))
        with pytest.raises(ValueError, match="compares stages"):
            results.param_diffs(out, [1, 2])
    finally:
        nb.use_reference(False)


def test_lab3_reference_traces_hold_their_ledgers(tmp_path):
    """Lab 3's reference keeps every rank's trace of every stage, cut to the ranges
    `trace.spans` reads: each still holds every collective of its rank's ledger for the traced
    step exactly once (issue + wait, same op / unit / phase), each block's forward and backward
    compute, and the lab's Gantt chart draws from it."""
    from zerolab import nb
    from zerolab.course import timeplots
    from zerolab.timing import trace
    nb.use_reference()
    try:
        out = tmp_path / "runs" / "labs" / "lab3_step_timeline"
        runs = nb.launch(stages="0,1,2,3", out=out, echo=lambda line: None)
    finally:
        nb.use_reference(False)
    assert sorted(runs) == [0, 1, 2, 3]
    for s, ranks in runs.items():
        for r in ranks:
            path = out / f"stage{s}" / f"trace_rank{r['rank']}.json"
            counts = trace.check_labels(path, r)
            assert sum(c["ledger"] for c in counts.values()) >= 5
            blocks = [u["name"] for u in r["units"] if u["name"] != "root"]
            got = [(x.phase, x.unit) for x in trace.spans(path) if x.kind == "block"]
            assert got == [("forward", b) for b in blocks] + [("backward", b) for b in blocks[::-1]]
    assert len(timeplots.step_trace(out, stages=(2, 3)).axes) == 2


def test_lab6_reference_keeps_step_times_and_the_link_floor(tmp_path):
    """Lab 6's reference holds, per emulated link, the measured step times of every rank and
    stage (and ZeRO-3 + prefetch), rank 0's trace, and every forward all_gather of ZeRO-3 took
    at least the α-β model's time for its bytes on that link (the lab's own check)."""
    import json

    from zerolab import nb
    from zerolab.timing import costmodel, hardware
    nb.use_reference()
    try:
        links = sorted({k.split("/")[1] for k in _keys() if k.startswith("lab6_")})
        assert any(k.endswith("_prefetch") for k in links) and len(links) >= 2
        for name in links:
            out = tmp_path / "lab6_time_by_stage" / name
            runs = nb.launch(out=out, echo=lambda line: None)
            prefetch = name.endswith("_prefetch")
            assert sorted(runs) == ([3] if prefetch else [0, 1, 2, 3])
            first = runs[min(runs)][0]
            gbps = float(name[4:].removesuffix("_prefetch"))
            assert first["link"]["gbps"] == gbps and runs[3][0]["zero3_prefetch"] is prefetch
            link = hardware.get_link(gbps=gbps, latency_us=first["link"]["latency_us"])
            for ranks in runs.values():
                assert all(len(r["step_times_s"]) == first["steps"] and min(r["step_times_s"]) > 0
                           for r in ranks)
            if prefetch:
                events = json.loads((out / "stage3" / "trace_rank0.json").read_text())["traceEvents"]
                assert {e["name"].split(" ")[0] for e in events} >= {"issue", "wait", "forward"}
            else:
                recs = [x for r in runs[3] for x in r["comm"]["records"]
                        if x["op"] == "all_gather" and x["phase"] == "forward" and x["step"] >= 0]
                assert recs and all(x["time_s"] >= costmodel.collective_time(
                    "all_gather", x["size_bytes"], first["world_size"], link) for x in recs)
    finally:
        nb.use_reference(False)


def test_lab7_reference_is_its_demo_run_and_equals_the_formulas(tmp_path):
    """Lab 7 launches a demo (zerolab.course.demos.byom), not zerolab.run.train: its reference
    keeps the demo's rank JSONs, `nb.launch_demo` copies them into any out folder (replacing rank
    files an earlier run left there) and every byte held and sent equals formula + padding +
    frozen (the lab's own checks)."""
    from zerolab import nb
    from zerolab.course import wrappers
    out = tmp_path / "runs" / "labs" / "lab7_bring_your_own_model" / "transformer"
    out.mkdir(parents=True)
    (out / "rank5.json").write_text("{}")            # left by an earlier run with more ranks
    printed = []
    nb.use_reference()
    try:
        ranks = nb.launch_demo("zerolab.course.demos.byom", [], out=out, nproc=2,
                               echo=printed.append)
        with pytest.raises(FileNotFoundError,
                           match="no reference run for 'lab7_bring_your_own_model/cnn'"):
            nb.launch_demo("zerolab.course.demos.byom", [], nproc=2, echo=None,
                           out=tmp_path / "lab7_bring_your_own_model" / "cnn")
    finally:
        nb.use_reference(False)
    assert [r["rank"] for r in ranks] == [0, 1] and "no ranks launched" in printed[0]
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]
    assert set(ranks[0]["wrappers"]) == set(wrappers.NAMES)
    assert wrappers.check_held(wrappers.held_rows(ranks)) == 2 * 4 * 3
    assert wrappers.check_traffic(wrappers.traffic_rows(ranks)) > 0
    assert wrappers.check_layouts(wrappers.layout_rows(ranks), 2) == 6


def test_save_stores_a_demo_run_next_to_training_runs(tmp_path, monkeypatch):
    """`python -m zerolab.course.reference OUT` stores a lab's demo run (rank JSONs with a "demo"
    key, outside stage folders) as it stores training runs, and only the labs asked for."""
    import json

    from zerolab.course import reference
    monkeypatch.setattr(reference, "FOLDER", tmp_path / "store")
    labs_out = tmp_path / "labs"
    for r in (0, 1):
        demo = labs_out / "lab7_bring_your_own_model" / "cnn" / f"rank{r}.json"
        demo.parent.mkdir(parents=True, exist_ok=True)
        demo.write_text(json.dumps({"demo": "zerolab.course.demos.byom", "rank": r}))
        run = labs_out / "lab1_memory_by_stage" / "stage0" / f"rank{r}.json"
        run.parent.mkdir(parents=True, exist_ok=True)
        run.write_text(json.dumps({"rank": r}))
    (labs_out / "lab7_bring_your_own_model" / "summary.json").write_text("{}")
    assert reference.save(labs_out, ["lab7_bring_your_own_model"]) == 2
    stored = sorted(p.relative_to(tmp_path / "store").as_posix()
                    for p in (tmp_path / "store").rglob("*.json"))
    assert stored == ["lab7_bring_your_own_model/cnn/rank0.json",
                      "lab7_bring_your_own_model/cnn/rank1.json"]
    assert reference.save(labs_out) == 4


def test_zerolab_labs_reference_runs_labs_5_6_and_7(tmp_path):
    """`zerolab labs --reference` executes the labs that read more than rank JSONs (lab 5:
    parameter differences, lab 6: timings and a trace, lab 7: a demo's JSONs) without
    launching, and all pass."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "MPLBACKEND": "Agg"}
    env.pop("ZEROLAB_REFERENCE", None)
    done = subprocess.run([sys.executable, "-m", "zerolab", "labs", "--reference", "--only",
                           "lab5,lab6,lab7", "--out", str(tmp_path / "labs")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "labs" / "report.md").read_text()
    assert "3 of 3 labs passed" in report and "no ranks launched" in done.stdout
    assert (tmp_path / "labs" / "lab5_same_training" / "loss_curves.png").exists()
    assert (tmp_path / "labs" / "lab6_time_by_stage" / "time_by_stage.png").exists()
    assert (tmp_path / "labs" / "lab7_bring_your_own_model" / "held_by_wrapper.png").exists()


def test_lab9_reference_is_its_demo_run_and_equals_muon_theory(tmp_path):
    """Lab 9 launches zerolab.course.demos.wholematrix once per world size: its reference keeps
    the demo's rank JSONs, `nb.launch_demo` restores them, and every rank's stored ledger bytes
    by collective and held bytes equal muon_theory's formulas recomputed here from the GPT's
    shapes (not the formula the ranks stored); at N = 2 the layouts trained the same weights."""
    from zerolab.wholematrix import muon_theory as mt
    from zerolab import nb
    from zerolab.course import muontable, wholematrix
    from zerolab.model import get_config
    nb.use_reference()
    try:
        for n in (2, 4):
            ranks = wholematrix.launch(tmp_path / "runs" / "labs" / "lab9_whole_matrix" / f"n{n}",
                                       nproc=n, launch_demo=nb.launch_demo)
            assert [r["rank"] for r in ranks] == list(range(n))
            shapes, whole, groups = muontable.gpt_shapes(get_config(ranks[0]["preset"]))
            for layout in mt.LAYOUTS:
                want = mt.layout_costs(layout, shapes, whole, n, 4, groups=groups)
                for r in ranks:
                    got = r["muon"][layout]
                    w = want[r["rank"]]
                    assert got["bytes"] == {op: b for op, b in w["bytes"].items() if b}, layout
                    assert got["held"] == w["state_bytes"] + w["buffer_bytes"], layout
                    assert got["ns_flops"] == w["ns_flops"]
                    assert n != 2 or got["diff_vs_first"] == 0.0, layout
    finally:
        nb.use_reference(False)
