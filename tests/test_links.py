"""Nothing outside what the user named is touched: --overwrite, checkpoint rotation and a
reference-run restore act only on what a run writes, never through a symbolic link planted in
the folder (the link itself is removed or replaced, what it points to stays as it was), and a
lock file that is a link is refused in one line instead of being truncated through.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_checkpoint import train_ranks
from zerolab import cli
from zerolab.course import reference
from zerolab.run import folders

THESIS = "\\documentclass{article} my thesis\n"


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A folder outside every --out: thesis.tex and a notes/ folder."""
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "thesis.tex").write_text(THESIS)
    (home / "notes" / "ideas.txt").write_text("ideas\n")
    return home


def intact(home: Path):
    assert (home / "thesis.tex").read_text() == THESIS
    assert (home / "notes" / "ideas.txt").read_text() == "ideas\n"


def no_launch(monkeypatch):
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: "")


def test_overwrite_never_deletes_through_a_link(tmp_path, elsewhere, monkeypatch, capsys):
    """The issue's example: links planted in an old --out under names a run writes (a folder
    stage1 -> ~/notes, compare.json -> ~/thesis.tex) and inside its folders."""
    out = tmp_path / "old"
    folders.begin_run(out, command="train", args={}, world_size=1).finish("ok")
    (out / "stage0").mkdir()
    (out / "stage0" / "rank0.json").write_text("{}")
    (out / "stage0" / "thesis.tex").symlink_to(elsewhere / "thesis.tex")
    (out / "stage1").symlink_to(elsewhere / "notes", target_is_directory=True)
    (out / "compare.json").symlink_to(elsewhere / "thesis.tex")
    (out / "mine.txt").symlink_to(elsewhere / "thesis.tex")   # not a name a run writes
    no_launch(monkeypatch)
    assert cli.main(["train", "--overwrite", "--preset", "nano", "--steps", "1", "--out",
                     str(out)]) == 0
    intact(elsewhere)
    assert not any(p.is_symlink() for p in (out / "stage1", out / "compare.json"))
    assert not (out / "stage0").exists() and (out / "mine.txt").is_symlink()
    assert json.loads((out / "run.json").read_text())["status"] == "ok"
    capsys.readouterr()


def test_a_lock_file_that_is_a_link_is_refused_not_truncated(tmp_path, elsewhere, monkeypatch,
                                                             capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / folders.LOCK).symlink_to(elsewhere / "thesis.tex")
    no_launch(monkeypatch)
    code = cli.main(["train", "--preset", "nano", "--steps", "1", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lock file .zerolab.lock is a symbolic link" in err[0]
    intact(elsewhere)
    assert not (out / "run.json").exists()


@pytest.mark.timeout(150)
def test_checkpoint_rotation_removes_links_never_their_targets(tmp_path, elsewhere):
    """A resumed run that continues its --out saves step 2 again: the step_000002 and
    .tmp_step_000002 it finds there are links to folders elsewhere."""
    out = tmp_path / "o"
    args = ["--preset", "nano", "--stage", "1", "--batch-size", "8", "--no-allocator",
            "--timeout", "60", "--save-every", "1", "--out", str(out)]
    codes, logs = train_ranks([*args, "--steps", "1"], 2, tmp_path)
    assert codes == [0, 0], logs
    root = out / "stage1" / "checkpoints"
    (root / "step_000002").symlink_to(elsewhere / "notes", target_is_directory=True)
    (root / ".tmp_step_000002").symlink_to(elsewhere, target_is_directory=True)
    codes, logs = train_ranks([*args, "--steps", "2", "--resume", str(root)], 2, tmp_path)
    assert codes == [0, 0], logs
    intact(elsewhere)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes", "thesis.tex"]
    assert not (root / "step_000002").is_symlink() and (root / "step_000002" / "meta.json").exists()
    assert (root / "latest").read_text().split()[0] == "step_000002"
    assert not list(root.glob(".*_step_*"))


def test_a_reference_restore_replaces_links_never_writes_through_them(tmp_path, elsewhere):
    lab = "lab1_memory_by_stage"
    out = tmp_path / "labs" / lab
    out.mkdir(parents=True)
    (out / "stage0").symlink_to(elsewhere / "notes", target_is_directory=True)
    (out / "stage1").mkdir()
    (out / "stage1" / "rank0.json").symlink_to(elsewhere / "thesis.tex")
    reference.restore(out)
    intact(elsewhere)
    assert sorted(p.name for p in (elsewhere / "notes").iterdir()) == ["ideas.txt"]
    for stage in ("stage0", "stage1"):
        assert not (out / stage).is_symlink() and not (out / stage / "rank0.json").is_symlink()
        assert json.loads((out / stage / "rank0.json").read_text())["rank"] == 0


def test_remove_tree_removes_a_link_itself(tmp_path, elsewhere):
    link = tmp_path / "link"
    link.symlink_to(elsewhere, target_is_directory=True)
    folders.remove_tree(link)
    folders.remove_tree(tmp_path / "not-there")
    assert not link.exists() and not link.is_symlink()
    intact(elsewhere)
    shutil.copytree(elsewhere, tmp_path / "copy", symlinks=True)
    (tmp_path / "copy" / "up").symlink_to(elsewhere, target_is_directory=True)
    folders.remove_tree(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    intact(elsewhere)
