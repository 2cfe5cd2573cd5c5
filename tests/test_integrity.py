"""Integrity of what a run reads back (zerolab/run/integrity.py): one byte flipped in the middle
of any file a run reads back - each file of a checkpoint (rank files, meta.json, latest), a
consolidated export, saved parameters, a committed reference run - is one line naming that
file, and nothing trains or is restored from it; `zerolab checkpoint consolidate` refuses an OUT
it cannot write in one line.

One small run (2 forked ranks, preset nano, fp32, 2 steps, a checkpoint after each, --save-params)
is shared; the resumes that must be refused run through `zerolab train` with the launch replaced
by a failure (the refusal comes before any rank starts) or on forked ranks (a bare torchrun's
ranks check too). That an untouched checkpoint still resumes exactly: tests/test_checkpoint.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from test_checkpoint import rank_json, train_ranks
from zerolab import cli
from zerolab.course import reference, results
from zerolab.run import integrity
from zerolab.run.checkpoint import open_checkpoint

ARGS = ["--preset", "nano", "--stage", "1", "--precision", "fp32", "--batch-size", "8",
        "--no-allocator", "--timeout", "60"]


def flip(path: Path) -> Path:
    """One byte flipped (xor 1) in the middle of the file at `path`."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    out = tmp / "run"
    codes, logs = train_ranks([*ARGS, "--steps", "2", "--save-every", "1", "--save-params",
                               "--out", str(out)], 2, tmp)
    assert codes == [0, 0], logs
    return out


def copy_checkpoints(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy" / "stage1" / "checkpoints"
    shutil.copytree(run / "stage1" / "checkpoints", dst)
    return dst


def resume_refused(ckpt: Path, tmp_path: Path, capsys, monkeypatch) -> str:
    """`zerolab train --resume ckpt`: its one error line (exit 2, no launch, nothing written)."""
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("a launch started"))
    code = cli.main(["train", "--nproc", "2", "--resume", str(ckpt), "--steps", "4", "--out",
                     str(tmp_path / "resumed")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "resumed").exists()
    return err[0]


@pytest.mark.timeout(120)
def test_a_flipped_byte_in_a_rank_files_data_is_refused_in_one_line(run, tmp_path, capsys,
                                                                     monkeypatch):
    """The issue's example: the middle of rank1.pt (tensor data: torch.load takes it, the
    losses would differ by ~6e-5). Refused by the launcher, and by bare ranks too."""
    root = copy_checkpoints(run, tmp_path)
    flip(root / "step_000002" / "rank1.pt")
    torch.load(root / "step_000002" / "rank1.pt", weights_only=True)      # loads without a word
    line = resume_refused(root, tmp_path, capsys, monkeypatch)
    assert "rank1.pt differs from the sha256 recorded" in line and "step_000002" in line, line
    assert "earlier checkpoint" in line
    codes, logs = train_ranks([*ARGS, "--steps", "4", "--resume", str(root), "--out",
                               str(tmp_path / "bare")], 2, tmp_path)
    errors = [ln for ln in logs.splitlines() if "error:" in ln]
    assert codes == [2, 2] and len(errors) == 1 and "rank1.pt differs" in errors[0], logs
    assert "step 3/" not in logs and not (tmp_path / "bare" / "stage1").exists()
    shutil.copy(run / "stage1" / "checkpoints" / "step_000002" / "rank1.pt",
                root / "step_000002")                                   # put back: it resumes
    assert open_checkpoint(root).step == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["step_000002/rank0.pt", "step_000002/meta.json", "latest",
                                  "step_000001/meta.json"])
def test_a_flipped_byte_in_each_checkpoint_file_names_that_file(run, tmp_path, name, capsys,
                                                                monkeypatch):
    root = copy_checkpoints(run, tmp_path)
    flip(root / name)
    target = root / "step_000001" if name.startswith("step_000001") else root
    line = resume_refused(target, tmp_path, capsys, monkeypatch)
    assert f"{Path(name).name} " in line, line
    assert any(w in line for w in ("sha256", "unreadable", "does not match")), line


def test_meta_json_of_another_checkpoint_behind_latest_is_refused(run, tmp_path):
    """`latest` records meta.json's sha256: a step folder swapped in under the same name (or a
    pointer edited to name another folder) is not taken silently."""
    root = copy_checkpoints(run, tmp_path)
    shutil.rmtree(root / "step_000002")
    shutil.copytree(root / "step_000001", root / "step_000002")
    with pytest.raises(integrity.IntegrityError, match="latest does not match"):
        open_checkpoint(root)
    (root / "latest").write_text("step_000001\n" + (root / "latest").read_text().split("\n")[1]
                                 + "\n")
    with pytest.raises(integrity.IntegrityError, match="latest does not match"):
        open_checkpoint(root)


@pytest.mark.timeout(60)
def test_consolidated_exports_and_saved_parameters_are_checked(run, tmp_path, capsys):
    model, optim = tmp_path / "x" / "model.pt", tmp_path / "x" / "adamw.pt"
    assert cli.main(["checkpoint", "consolidate", str(run / "stage1"), str(model),
                     "--optimizer", str(optim)]) == 0
    for path in (model, optim):
        assert integrity.check_sidecar(path)
        if shutil.which("sha256sum"):           # the standard tool reads the same record
            subprocess.run(["sha256sum", "--quiet", "-c", integrity.sidecar(path).name],
                           cwd=path.parent, check=True)
    flip(model)
    with pytest.raises(integrity.IntegrityError, match=r"model\.pt differs from the sha256"):
        integrity.check_sidecar(model)
    assert len(str(pytest.raises(ValueError, integrity.check_sidecar, model).value)
               .splitlines()) == 1
    out = tmp_path / "params"                   # --save-params: rank0.json holds its sha256
    shutil.copytree(run, out)
    assert results.load_params(out, 1).keys() == torch.load(out / "stage1" / "params.pt").keys()
    flip(out / "stage1" / "params.pt")
    with pytest.raises(ValueError, match="params.pt' is not the file run"):
        results.load_params(out, 1)
    capsys.readouterr()


def test_a_flipped_byte_in_a_reference_run_is_refused(tmp_path, monkeypatch):
    """Committed reference runs are checked against reference_runs/SHA256SUMS before a restore
    copies anything; the committed ones match it."""
    lab = "lab1_memory_by_stage"
    store = tmp_path / "store"
    shutil.copytree(reference.FOLDER / lab, store / lab)
    shutil.copy(reference.FOLDER / reference.SUMS, store / reference.SUMS)
    monkeypatch.setattr(reference, "FOLDER", store)
    out = tmp_path / "labs" / lab
    reference.restore(out)                      # untouched: restored
    assert json.loads((out / "stage0" / "rank0.json").read_text())["stage"] == 0
    flip(store / lab / "stage1" / "rank1.json")
    with pytest.raises(integrity.IntegrityError, match=f"{lab}/stage1/rank1.json differs") as err:
        reference.restore(tmp_path / "again" / lab)
    assert len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "again").exists()    # checked before anything is copied


def test_the_committed_reference_runs_match_their_sums():
    sums = reference._sums()
    stored = {p.relative_to(reference.FOLDER).as_posix() for p in reference.FOLDER.rglob("*")
              if p.is_file() and p.name != reference.SUMS}
    assert set(sums) == stored
    assert all(integrity.sha256_file(reference.FOLDER / n) == d for n, d in sums.items())


# --- zerolab checkpoint consolidate: an OUT it cannot write -----------------------------------
def test_consolidate_into_a_folder_or_an_unwritable_place_is_one_line(run, tmp_path, capsys):
    ckpt = run / "stage1" / "checkpoints"
    (tmp_path / "afile").write_text("x")
    cases = {tmp_path: "is a folder",                                    # an existing folder
             tmp_path / "afile" / "model.pt": "is a file"}               # parent is a file
    readonly = tmp_path / "ro"
    readonly.mkdir()
    try:                                        # root ignores permissions: a read-only mount
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(readonly)],
                       check=True, capture_output=True)
        cases[readonly / "model.pt"] = "not writable"
    except (OSError, subprocess.CalledProcessError):
        readonly = None
    try:
        for target, words in cases.items():
            code = cli.main(["checkpoint", "consolidate", str(ckpt), str(target)])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and words in err[0], (target, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ro"]
    finally:
        if readonly is not None:
            subprocess.run(["umount", str(readonly)], check=False)


def test_an_untouched_checkpoint_opens_and_resumes(run, tmp_path):
    """Every file checked, nothing flipped: the resume trains on from step 2."""
    codes, logs = train_ranks([*ARGS, "--steps", "3", "--resume", str(run / "stage1"),
                               "--out", str(tmp_path / "r")], 2, tmp_path)
    assert codes == [0, 0], logs
    assert rank_json(tmp_path / "r", 1)["start_step"] == 2
