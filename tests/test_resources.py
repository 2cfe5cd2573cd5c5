"""Running out of something (zerolab/run/resources.py): disk, memory, open files - each is one
line naming the resource, what was kept and what to do, and the run's manifest records how it
ended.

- disk: a 2 MiB tmpfs as --out (where this test may mount one; else every fsync of one
  checkpoint's files raises ENOSPC, as a full disk does) fills during a checkpoint save;
- memory: `ulimit -v` 700 MB (the issue's example) refused before anything starts, and a rank
  that runs out of address space while building its model;
- open files: `ulimit -n` 24 refused before anything starts (below it torchrun's agent dies of
  EMFILE or hangs in its rendezvous), and a process that dies of EMFILE is one line too.
Runs are forked ranks of `zerolab.run.train.main` (no torchrun start-up) or `zerolab train`
stopped by its checks (no rank starts).
"""
from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_checkpoint import _rank_main, train_ranks
from zerolab.run import resources
from zerolab.run.checkpoint import open_checkpoint
from zerolab.run.launch import LaunchError, run

NANO = ["--preset", "nano", "--stage", "1", "--batch-size", "8", "--no-allocator", "--timeout",
        "60"]


def error_lines(logs: str) -> list[str]:
    return [ln for ln in logs.splitlines() if "zerolab.run.train: error:" in ln]


def _full_disk_rank(rank, n, port, argv, folder):
    """A forked rank on a disk that fills at checkpoint step_000003: the fsync of every file
    of it raises ENOSPC (what a full disk raises), where no tmpfs could be mounted."""
    real = os.fsync

    def fsync(fd):
        if ".tmp_step_000003" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    os.fsync = fsync
    _rank_main(rank, n, port, argv, folder)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A folder on a 2 MiB tmpfs; where mounting is not allowed, ranks whose checkpoint
    step_000003 fails with ENOSPC (`_full_disk_rank`)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                 capture_output=True).returncode == 0
    except OSError:                             # no mount command
        mounted = False
    if not mounted:
        monkeypatch.setattr("test_checkpoint._rank_main", _full_disk_rank)
    yield disk
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.timeout(150)
def test_a_full_disk_during_a_save_is_one_line_and_the_manifest_says_so(small_disk, tmp_path):
    out = small_disk / "run"
    codes, logs = train_ranks([*NANO, "--steps", "12", "--save-every", "1", "--out", str(out)],
                              2, tmp_path)
    lines = error_lines(logs)
    assert codes == [2, 2] and len(lines) == 1, logs          # the same line on every rank,
    line = lines[0]                                           # said once (rank 0)
    assert "disk full (No space left on device)" in line and "stays latest" in line, line
    root = out / "stage1" / "checkpoints"
    kept = line.split("checkpoint step_")[-1][:6]
    assert (root / "latest").read_text().split()[0] == f"step_{kept}"
    assert open_checkpoint(root).step == int(kept)            # complete, every hash checks
    assert not list(root.glob(".tmp_*")), "the partial checkpoint was left behind"
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "failed" and manifest["reason"] == line.split("error: ", 1)[1]
    assert "Traceback" not in logs


def test_ulimit_v_700mb_is_one_line_before_anything_starts(tmp_path):
    """The issue's example (it was a 94-line traceback whose cause was on its last line)."""
    limit = 700 * 1000 * 1024                   # `ulimit -v 700000`: KiB
    res = subprocess.run([sys.executable, "-m", "zerolab", "train", "--preset", "nano", "--steps",
                          "2", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=120, preexec_fn=lambda: resource.setrlimit(
                             resource.RLIMIT_AS, (limit, limit)))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "out of memory before starting" in lines[0] and "ulimit -v" in lines[0], lines[0]
    assert "nothing was started" in lines[0] and not (tmp_path / "o").exists()


def _limited_rank(rank, n, port, argv, folder):
    """A forked rank whose address space may grow by 256 MiB more (preset gpt2 needs ~1.4 GB)."""
    with open("/proc/self/status") as f:
        now = int(next(ln for ln in f if ln.startswith("VmSize:")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (now + (256 << 20), resource.RLIM_INFINITY))
    _rank_main(rank, n, port, argv, folder)


@pytest.mark.timeout(120)
def test_a_rank_out_of_address_space_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("test_checkpoint._rank_main", _limited_rank)
    out = tmp_path / "o"
    codes, logs = train_ranks(["--preset", "gpt2", "--steps", "2", "--batch-size", "2",
                               "--no-allocator", "--timeout", "60", "--out", str(out)],
                              2, tmp_path)
    lines = error_lines(logs)
    assert all(c == 4 for c in codes) and len(lines) == 2, logs   # each rank says it, once
    for r, line in enumerate(lines):
        assert "out of memory" in line and "ulimit -v" in line, line
        assert "no checkpoint was saved" in line and "give the run more memory" in line, line
    assert "Traceback" not in logs
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "failed" and "out of memory" in manifest["reason"]


def test_ulimit_n_too_low_is_one_line_before_anything_starts(tmp_path):
    res = subprocess.run([sys.executable, "-m", "zerolab", "train", "--preset", "nano", "--steps",
                          "2", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=120, preexec_fn=lambda: resource.setrlimit(
                             resource.RLIMIT_NOFILE, (24, 24)))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "out of open files before starting" in lines[0] and "ulimit -n" in lines[0]
    assert not (tmp_path / "o").exists()


def test_a_process_that_dies_of_emfile_is_one_line():
    """What torchrun's agent does under a low `ulimit -n`: its traceback is held back, the
    launch error is one line naming the resource."""
    code = textwrap.dedent("""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
        print("started", flush=True)
        files = [os.open("/dev/null", os.O_RDONLY) for _ in range(100)]
    """)
    echoed = []
    with pytest.raises(LaunchError) as err:
        run([sys.executable, "-c", code], timeout=60, echo=echoed.append)
    assert str(err.value).splitlines() == [str(err.value)], err.value
    assert str(err.value).startswith("out of open files (Too many open files)")
    assert err.value.ran_out and "Errno 24" in err.value.output
    assert echoed == ["started"]                # not the traceback


def test_resources_are_named_from_errors_and_output():
    assert resources.describe(OSError(errno.ENOSPC, "No space left on device"))[0].startswith(
        "disk full")
    assert resources.describe(OSError(errno.EDQUOT, "Disk quota exceeded"))[0].startswith(
        "disk quota")
    assert resources.describe(MemoryError())[0].startswith("out of memory")
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    wrapped.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert resources.describe(wrapped)[0].startswith("disk full")      # torch.save's
    assert resources.describe(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert resources.describe(OSError(errno.EMFILE, "Too many open files"))[0].startswith(
        "out of open files")
    assert resources.describe(BlockingIOError(errno.EAGAIN, "fork"))[0].startswith(
        "out of processes")
    assert resources.describe(OSError(errno.EADDRINUSE, "Address in use"))[0].startswith(
        "the port")
    assert resources.describe(ValueError("--steps 0")) is None
    assert resources.in_output("...\nOSError: [Errno 28] No space left on device\n")[0] == \
        "disk full (No space left on device)"
    assert resources.in_output("import torch\n  ...\nMemoryError\n")[1].startswith("give the run")
    assert resources.in_output("all fine") is None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_an_unset_address_space_limit_is_never_near():
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        assert not resources.near_memory_limit()
    resources.check_address_space()             # this process: no limit, nothing raised
