"""The GPU path's CPU twins: what labs/gpu_check.py checks on a GPU machine runs here on gloo CPU
ranks, so a broken GPU path fails CI even where no GPU is lent.

- `python labs/gpu_check.py --device cpu` passes: placement, memory == formula, traffic ==
  formula, every stage agrees with the fp32 reference, per-op collective durations > 0 and below
  the step time, ZeRO-3 prefetch and gradient accumulation ran.
- The allocator-snapshot plot's running total is absolute (anchored at the blocks alive at the
  dump): it never goes negative when blocks allocated before recording are freed, and the plot
  says when the ring buffer dropped events. Checked on a hand-made snapshot whose true totals
  are known.
- `zerolab.run.train --device cuda` without a GPU ends with one line, not a traceback.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerolab.run.launch import cuda_device_count

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_gpu_check_cpu_twin_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "labs" / "gpu_check.py"), "--device", "cpu",
                           "--preset", "nano", "--steps", "2", "--runs", str(tmp_path / "runs"),
                           "--out", str(out)], capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    checks = {c["check"]: c for c in summary["checks"]}
    assert {"placement", "memory", "traffic", "numerics", "leak", "durations",
            "prefetch+accumulation"} <= set(checks)
    assert all(c["ok"] is not False for c in checks.values()), checks
    for name in ("placement", "numerics", "durations", "prefetch+accumulation"):
        assert checks[name]["ok"] is True, checks[name]
    assert (summary["backend"], summary["device"]) == ("gloo", "cpu")
    assert "gloo" in summary["time_sources"]
    assert "numerics" in proc.stdout and "durations" in proc.stdout     # the printed table


def _snapshot(tmp_path, trace, live_blocks, max_entries=None):
    snap = {"device_traces": [trace],
            "segments": [{"device": 0, "blocks": [{"size": s, "state": "active_allocated"}
                                                  for s in live_blocks]
                          + [{"size": 999, "state": "inactive"}]}]}
    if max_entries is not None:             # what memory.cuda_memory_history adds
        snap["zerolab"] = {"allocated_at_start": 300, "max_entries": max_entries}
    path = tmp_path / "rank0_snapshot.json"         # as memory.cuda_memory_history writes it
    path.write_text(json.dumps({"run_id": "test", "snapshot": snap}))
    return path, snap


def test_snapshot_series_is_absolute_and_never_negative(tmp_path):
    from zerolab.course.timeplots import snapshot_series
    # before recording: blocks of 100 and 200 B are live (300 B). Recorded: free the 200,
    # alloc 50, alloc 70, free the 100. At the dump 50 + 70 = 120 B are live.
    trace = [{"action": "free_requested", "size": 200}, {"action": "free_completed", "size": 200},
             {"action": "alloc", "size": 50}, {"action": "alloc", "size": 70},
             {"action": "free_completed", "size": 100}]
    _, snap = _snapshot(tmp_path, trace, [50, 70])
    truth = [300, 100, 150, 220, 120]           # bytes live after each event
    (row,) = snapshot_series(snap)
    assert row["bytes"] == truth and min(row["bytes"]) >= 0 and not row["dropped"]
    naive, live = [], 0                         # what a sum from zero would have drawn
    for ev in trace:
        live += ev["size"] if ev["action"] == "alloc" else -ev["size"] if ev["action"] == "free_completed" else 0
        naive.append(live)
    assert min(naive) < 0


def test_snapshot_plot_says_when_events_were_dropped(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from zerolab.course.timeplots import cuda_snapshot
    trace = [{"action": "alloc", "size": 10}, {"action": "free_completed", "size": 10}] * 3
    path, _ = _snapshot(tmp_path, trace, [40], max_entries=len(trace))
    fig = cuda_snapshot(path)
    assert "dropped" in fig.axes[0].get_title()
    path, _ = _snapshot(tmp_path, trace, [40], max_entries=10 * len(trace))
    fig = cuda_snapshot(path)
    assert "dropped" not in fig.axes[0].get_title()


@pytest.mark.skipif(cuda_device_count() > 0, reason="a CUDA device is visible")
@pytest.mark.timeout(60)
def test_train_device_cuda_without_gpu_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "zerolab.run.train", "--device", "cuda", "--steps", "1"],
                          capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "zerolab.run.train: error: --device cuda but torch sees no CUDA device (use --device cpu)"]


def test_backend_auto_says_when_it_leaves_a_gpu_unused():
    from zerolab.run.launch import auto_note, resolve
    chosen = resolve(2, "auto", "auto", gpus=1)           # 2 ranks, 1 GPU: NCCL cannot
    assert chosen == ("gloo", "cpu")
    note = auto_note(2, "auto", "auto", *chosen, gpus=1)
    assert "gloo on CPU" in note and "--backend gloo --device cuda" in note
    assert auto_note(2, "auto", "auto", *resolve(2, "auto", "auto", gpus=0), gpus=0) == ""
    assert auto_note(2, "auto", "auto", *resolve(2, "auto", "auto", gpus=2), gpus=2) == ""
    assert auto_note(2, "gloo", "cpu", "gloo", "cpu", gpus=1) == ""     # asked for: no note


def _gpu_check():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "labs" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_rank(stage, rank, allocated, source="nccl", time_s=0.01, step_time=0.5):
    return {"stage": stage, "name": f"S{stage}", "rank": rank, "backend": "nccl",
            "device": f"cuda:{rank}", "step_times_s": [step_time, step_time],
            "before_stage": {"strategies_alive": 0, "cuda": {"allocated": allocated}},
            "comm": {"records": [{"step": 1, "what": "grads", "op": "all_reduce", "unit": "b",
                                  "time_s": time_s, "time_source": source}]}}


def test_gpu_check_judges_cuda_runs_it_cannot_make_here(monkeypatch):
    """The CUDA branches of the checks, on hand-made rank JSONs (no GPU is lent to CI)."""
    gc = _gpu_check()
    runs = {s: [_fake_rank(s, r, 1000) for r in range(2)] for s in range(4)}
    assert gc.check_placement([runs], "nccl", "cuda")[0] is True
    assert gc.check_placement([runs], "gloo", "cuda")[0] is False
    import zerolab
    monkeypatch.setattr(zerolab, "STRATEGIES", {k: type("S", (), {"close": None})
                                                for k in range(4)})
    assert gc.check_leak(runs, "cuda")[0] is True
    runs[2][1]["before_stage"]["cuda"]["allocated"] += 8 << 20      # 8 MiB left behind
    ok, detail = gc.check_leak(runs, "cuda")
    assert ok is False and "CUDA allocated" in detail
    assert gc.check_durations([runs])[0] is True
    runs[3][0]["comm"]["records"][0]["time_source"] = "none"        # timing was off
    assert gc.check_durations([runs])[0] is False
    runs[3][0]["comm"]["records"][0].update(time_source="nccl", time_s=0.9)   # > step time
    assert gc.check_durations([runs])[0] is False
