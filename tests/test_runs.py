"""Results of different runs are never mixed, and nothing runs that the user did not ask for.

Mixing: a folder in use is refused (a lock held by another process); a folder holding another
run keeps it in a numbered sibling (OUT.1, ...), or has it cleanly replaced with --overwrite;
readers keep one run's files and say so.
Security (the loopback-only listeners of a single-node run are checked in test_faults.py, on a
launch that is running there anyway): no file is unpickled unless it holds only tensors (torch.load weights_only=True); CUDA snapshots
are JSON, and a planted pickle runs nothing.
"""
from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerolab import cli
from zerolab.course import results, timeplots
from zerolab.run import folders

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr("zerolab.run.launch.run", refuse)


def fake_rank(out: Path, run_id: str, stage: int, rank: int, world_size: int):
    folders.atomic_json(out / f"stage{stage}" / f"rank{rank}.json",
                     {"run_id": run_id, "stage": stage, "rank": rank, "world_size": world_size})


def finished_run(out: Path, world_size: int, stages=(0, 1, 2, 3)) -> str:
    run = folders.begin_run(out, command="compare", args={}, world_size=world_size, overwrite=True)
    for s in stages:
        for r in range(world_size):
            fake_rank(out, run.run_id, s, r, world_size)
    run.finish("ok")
    return run.run_id


# --- a folder in use -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("overwrite", [False, True])
def test_second_run_into_a_folder_in_use_is_refused(tmp_path, capsys, no_launch, overwrite):
    out = tmp_path / "o"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from zerolab.run.folders import begin_run
        run = begin_run({str(out)!r}, command="compare", args={{}}, world_size=2)
        print("locked", run.run_id, flush=True)
        time.sleep(50)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        first = holder.stdout.readline().split()
        assert first[0] == "locked"
        code = cli.main(["compare", "--nproc", "2", "--preset", "nano", "--steps", "2",
                         "--out", str(out)] + (["--overwrite"] if overwrite else []))
    finally:
        holder.kill()
        holder.wait()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "in use by a run that is still going" in line and first[1] in line
    assert folders.read_manifest(out)["run_id"] == first[1]          # the first run's manifest stays
    # once its process is gone the kernel has dropped the lock: the folder is usable again
    assert not folders.in_use(out)


# --- a folder holding another run ----------------------------------------------------------------
def test_a_folder_holding_another_run_keeps_it_beside_the_new_one(tmp_path, capsys, monkeypatch):
    """The same command typed again: the earlier run (its manifest and results) moves to the
    first free OUT.N - OUT.1 is taken here by a file of the user's, so OUT.2 - and one line says
    where; the user's files in OUT stay, and OUT.2 reads back as the earlier run."""
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: "")    # ranks that write nothing
    out = tmp_path / "o"
    old = finished_run(out, 4)
    (out / "notes.txt").write_text("mine")
    (tmp_path / "o.1").write_text("the user's own o.1")
    code = cli.main(["train", "--nproc", "2", "--preset", "nano", "--steps", "2", "--out", str(out)])
    said = [ln for ln in capsys.readouterr().out.splitlines() if "held run" in ln]
    assert code == 0 and len(said) == 1, said
    assert f"{out} held run {old} (compare, ok); it is now in {tmp_path / 'o.2'}" in said[0]
    assert (tmp_path / "o.1").read_text() == "the user's own o.1"
    assert folders.read_manifest(tmp_path / "o.2")["run_id"] == old
    kept = results.load_run(tmp_path / "o.2")
    assert sorted(kept) == [0, 1, 2, 3] and all(len(kept[s]) == 4 for s in kept)
    assert (out / "notes.txt").read_text() == "mine" and not list(out.glob("stage*"))
    assert folders.read_manifest(out)["run_id"] != old


def test_overwrite_still_replaces_and_refuse_still_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: "")
    out = tmp_path / "o"
    old = finished_run(out, 4)
    assert cli.main(["train", "--nproc", "2", "--preset", "nano", "--steps", "2", "--out",
                     str(out), "--overwrite"]) == 0
    assert "held run" not in capsys.readouterr().out
    assert not list(tmp_path.glob("o.*")) and not list(out.glob("stage*"))
    new = folders.read_manifest(out)["run_id"]
    assert new != old
    with pytest.raises(folders.RunFolderError, match=f"holds run {new} .*--overwrite"):
        folders.begin_run(out, command="train", args={}, world_size=2, previous="refuse")
    with pytest.raises(ValueError, match="'keeep' is not one of keep, replace, refuse"):
        folders.begin_run(out, command="train", args={}, world_size=2, previous="keeep")


def test_bench_twice_keeps_the_first_bench_json(tmp_path, capsys, monkeypatch):
    """`zerolab bench` owns its folder too: a second bench keeps the first one's bench.json."""
    def ranks(argv, nproc, **kw):            # rank 0's write, without the ranks
        out = Path(argv[argv.index("--out") + 1])
        (out / "bench.json").write_text(json.dumps({"pid": os.getpid(), "n": len(calls)}))
        calls.append(out)
    calls = []
    monkeypatch.setattr("zerolab.cli.commands.run_torchrun", ranks)
    out = tmp_path / "b"
    for _ in range(2):
        assert cli.main(["bench", "--preset", "nano", "--out", str(out)]) == 0
    assert json.loads((tmp_path / "b.1" / "bench.json").read_text())["n"] == 0
    assert json.loads((out / "bench.json").read_text())["n"] == 1
    assert f"it is now in {tmp_path / 'b.1'}" in capsys.readouterr().out


def test_overwrite_replaces_the_old_run_before_the_new_one_writes(tmp_path):
    """A 4-rank run, then a 2-rank run with --overwrite killed after its stage 0: the folder holds
    only the new run's files (no stale rank2/rank3, no old stage 3); the reader says it did not
    finish. Files outside the old run's outputs are kept."""
    out = tmp_path / "o"
    finished_run(out, 4)
    (out / "notes.txt").write_text("mine")
    new = folders.begin_run(out, command="compare", args={}, world_size=2, overwrite=True)
    for r in range(2):
        fake_rank(out, new.run_id, 0, r, 2)
    os.close(new._lock_fd)                  # the run dies here: no finish(), the lock is dropped
    notes = []
    loaded = results.load_run(out, echo=notes.append)
    assert sorted(loaded) == [0] and [r["rank"] for r in loaded[0]] == [0, 1]
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("stage*/*")) == \
        ["stage0/rank0.json", "stage0/rank1.json"]
    assert (out / "notes.txt").read_text() == "mine"
    assert notes and "did not finish" in notes[0] and new.run_id in notes[0]


def test_reader_keeps_the_manifests_run_and_says_others_were_ignored(tmp_path):
    """Stale files of another run next to the current one (as a 4-rank run followed by a 2-rank
    run into the same folder left them before runs were tagged): only the current run is read."""
    out = tmp_path / "o"
    current = finished_run(out, 2)
    for s in (0, 1, 2, 3):
        for r in (2, 3):
            fake_rank(out, "an-older-run", s, r, 4)
    notes = []
    loaded = results.load_run(out, echo=notes.append)
    assert all([r["rank"] for r in ranks] == [0, 1] for ranks in loaded.values())
    assert all(r["run_id"] == current for ranks in loaded.values() for r in ranks)
    assert notes == [f"note: {str(out)!r}: read run {current} only; 8 file(s) of other runs ignored"]


def test_reader_refuses_mixed_runs_without_a_manifest(tmp_path):
    out = tmp_path / "o"
    fake_rank(out, "run-a", 0, 0, 1)
    fake_rank(out, "run-b", 3, 0, 1)
    with pytest.raises(folders.RunFolderError, match="mixes files of 2 runs"):
        results.load_run(out)


def test_reader_refuses_a_stage_missing_a_rank(tmp_path):
    out = tmp_path / "o"
    run = folders.begin_run(out, command="train", args={}, world_size=2)
    fake_rank(out, run.run_id, 0, 0, 2)
    run.finish("ok")
    with pytest.raises(ValueError, match=r"rank files \[0\], not 0..1"):
        results.load_run(out, echo=lambda s: None)


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "rank0.json"
    folders.atomic_json(path, {"run_id": "old"})

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(folders.os, "replace", broken_replace)
    with pytest.raises(OSError):
        folders.atomic_json(path, {"run_id": "new"})
    assert json.loads(path.read_text()) == {"run_id": "old"}
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]      # no temporary left


def test_manifest_records_the_run(tmp_path):
    out = tmp_path / "o"
    with folders.start_run(out, command="train", args={"steps": 2}, world_size=2) as run:
        fake_rank(out, run.run_id, 0, 0, 2)
        m = folders.read_manifest(out)
        assert m["status"] == "running" and folders.in_use(out)
    m = folders.read_manifest(out)
    assert m["run_id"] == run.run_id and m["world_size"] == 2 and m["args"] == {"steps": 2}
    assert m["status"] == "ok" and m["files"] == ["stage0/rank0.json"]
    assert {"python", "torch", "zerolab"} <= set(m["versions"]) and m["started"] <= m["finished"]


# --- nothing is unpickled ---------------------------------------------------------------------------
class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "payload ran"))


def test_load_params_never_runs_a_planted_pickle(tmp_path):
    import torch
    out = tmp_path / "o"
    (out / "stage0").mkdir(parents=True)
    marker = tmp_path / "marker"
    torch.save({"params": {"w": Payload(str(marker))}}, out / "stage0" / "params.pt")
    with pytest.raises(pickle.UnpicklingError):
        results.load_params(out, 0)
    assert not marker.exists()


def test_load_params_reads_only_the_file_its_run_wrote(tmp_path):
    """params.pt stays a plain state dict; the run's rank0.json holds its sha256. A file put there
    by anything else (another run, a person) is refused before torch.load sees it."""
    import hashlib

    import torch
    out = tmp_path / "o"
    run_id = finished_run(out, 1, stages=(0,))
    path = out / "stage0" / "params.pt"
    torch.save({"w": torch.ones(2)}, path)
    r0 = json.loads((out / "stage0" / "rank0.json").read_text())
    folders.atomic_json(out / "stage0" / "rank0.json",
                     {**r0, "params_sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    assert torch.equal(results.load_params(out, 0)["w"], torch.ones(2))
    torch.save({"w": torch.zeros(2)}, path)          # replaced behind the run's back
    with pytest.raises(ValueError, match=f"not the file run {run_id} wrote there"):
        results.load_params(out, 0)


def test_every_torch_load_in_the_package_passes_weights_only_true():
    calls = []
    for path in sorted((ROOT / "zerolab").rglob("*.py")) + [ROOT / "labs" / "gpu_check.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load" \
                    and getattr(node.func.value, "id", "") == "torch":
                kw = {k.arg: k.value for k in node.keywords}
                calls.append((path.name, node.lineno))
                assert isinstance(kw.get("weights_only"), ast.Constant) and \
                    kw["weights_only"].value is True, f"{path.name}:{node.lineno}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not {"pickle", "cPickle", "dill"} & set(names), f"{path.name} imports pickle"
    assert calls                                # results.load_params at least


def test_cuda_snapshot_plot_reads_json_and_never_unpickles(tmp_path):
    marker = tmp_path / "marker"
    planted = tmp_path / "stage0" / "rank0_snapshot.json"
    planted.parent.mkdir()
    planted.write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(ValueError):                # not JSON: refused, nothing ran
        timeplots.cuda_snapshot(planted)
    assert not marker.exists()
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"run_id": "r", "snapshot": {"device_traces": [[
        {"action": "alloc", "size": 1 << 20}, {"action": "free_completed", "size": 1 << 20}]]}}))
    fig = timeplots.cuda_snapshot(good)
    ys = fig.axes[0].lines[0].get_ydata()
    assert list(ys) == [pytest.approx((1 << 20) / 1e6), 0.0]
    lab3 = json.loads((ROOT / "labs" / "lab3_step_timeline.ipynb").read_text())
    code = "".join("".join(c["source"]) for c in lab3["cells"] if c["cell_type"] == "code")
    assert "pickle" not in code and "_snapshot.json" in code


def test_launcher_echo_drops_torchrun_banner_keeps_its_warnings():
    """torchrun's OMP_NUM_THREADS banner (a bare log header, a row of stars, the text) is dropped
    from what a launch echoes; a torchrun warning that says something is kept whole."""
    from zerolab.run.launch import _noise
    banner = ["W1201 04:48:59.123000 4242 torch/distributed/run.py:874] ",
              "W1201 04:48:59.123000 4242 torch/distributed/run.py:874] *****************************",
              "W1201 04:48:59.123000 4242 torch/distributed/run.py:874] Setting OMP_NUM_THREADS "
              "environment variable for each process to be 1 in default, to avoid your system being "
              "overloaded, please further tune the variable for optimal performance in your "
              "application as needed."]
    assert all(_noise(line) for line in banner)
    real = ("W1201 04:49:01.000000 4242 torch/distributed/elastic/multiprocessing/api.py:900] "
            "Sending process 4250 closing signal SIGTERM")
    assert not _noise(real) and not _noise("[stage 0] step 1/2  loss 5.4819")


# --- keeping a run moves only what a run wrote -----------------------------------------------------
@pytest.mark.parametrize("how", ["plain", "stage-link", "out-link", "no-manifest"])
def test_a_result_path_holding_a_users_file_is_refused_touching_nothing(tmp_path, capsys,
                                                                          monkeypatch, how):
    """OUT holds an earlier run and, in its stage0/, a file of the user's (plain; stage0 a link
    to the user's folder; OUT itself reached through a link; no manifest at all): the new run is
    refused in one line naming the file, and nothing moves (no OUT.1, every file where it was)."""
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("launched"))
    real = tmp_path / "o"
    old = finished_run(real, 2) if how != "no-manifest" else None
    mine = tmp_path / "mine"
    if how == "stage-link":
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
        for f in (real / "stage0").iterdir():
            f.unlink()
        (real / "stage0").rmdir()
        (real / "stage0").symlink_to(mine)
        named = "stage0"
    else:
        (real / "stage0").mkdir(parents=True, exist_ok=True)
        (real / "stage0" / "notes.txt").write_text("mine")
        named = "stage0/notes.txt"
    out = real
    if how == "out-link":
        out = tmp_path / "link"
        out.symlink_to(real)
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    code = cli.main(["train", "--nproc", "2", "--preset", "nano", "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0] and "nothing was moved" in err[0], err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob("link.*"))
    assert (folders.read_manifest(real) or {}).get("run_id") == old
    assert (mine / "notes.txt" if how == "stage-link" else real / "stage0" / "notes.txt"
            ).read_text() == "mine"


def test_a_run_killed_before_it_listed_its_files_is_still_kept(tmp_path, capsys, monkeypatch):
    """A run that never finished has no file list: the files made after it started count as its
    own, so it is kept aside as a finished one is."""
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: "")
    out = tmp_path / "o"
    run = folders.begin_run(out, command="compare", args={}, world_size=2)
    fake_rank(out, run.run_id, 0, 0, 2)
    os.close(run._lock_fd)                  # killed: no finish(), no file list
    assert cli.main(["train", "--nproc", "2", "--preset", "nano", "--steps", "2", "--out",
                     str(out)]) == 0
    assert (tmp_path / "o.1" / "stage0" / "rank0.json").exists()
