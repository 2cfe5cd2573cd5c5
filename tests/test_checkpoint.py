"""Sharded checkpoints (zerolab.run.checkpoint): resume bit-identical at the same world size and
within 1e-6 (fp32) at another world size / stage, offline consolidation checked against a plain
torch AdamW run, the FSDP2 export, bad checkpoints, a kill during a save, and one run across two
launchers.

One reference run (`zerolab train`, 4 ranks, ZeRO-2, fp32, global batch 12, 4 steps, a checkpoint
every 2 steps) is shared by most tests. Other runs call `zerolab.run.train.main` in forked rank
processes (`train_ranks`, no torchrun start-up: ~1 s instead of ~8 s); every run has a timeout.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import _context, free_port, run_ranks
from conftest import run_zerolab as run_cli
from zerolab import cli
from zerolab.run.checkpoint import open_checkpoint

REF = ["--preset", "nano", "--stage", "2", "--precision", "fp32", "--batch-size", "12",
       "--steps", "4", "--timeout", "120"]


def _rank_main(rank, n, port, argv, folder):
    """One rank of `train_ranks`: torchrun's environment, then zerolab.run.train.main(argv)."""
    log = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from zerolab.run import train
    code = train.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def train_ranks(argv: list[str], n: int, tmp: Path, timeout: float = 90) -> tuple[list, str]:
    """`zerolab.run.train argv` on `n` forked ranks; (exit codes, every rank's output). A rank that
    fails stops the others 3 s later; after `timeout` seconds all are killed."""
    ctx, port = _context(), free_port()
    folder = tmp / f"logs-{port}"
    folder.mkdir(parents=True)
    procs = [ctx.Process(target=_rank_main, args=(r, n, port, argv, str(folder)), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    deadline, failed = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed is None and any(p.exitcode not in (None, 0) for p in procs):
            failed = time.monotonic()
        if failed is not None and time.monotonic() > failed + 3:
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    logs = "".join(f"--- rank {r} ---\n{(folder / f'rank{r}.log').read_text()}" for r in range(n))
    return [p.exitcode for p in procs], logs


def rank_json(out: Path, stage: int, rank: int = 0) -> dict:
    return json.loads((out / f"stage{stage}" / f"rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted reference: (out folder, rank-0 losses)."""
    out = tmp_path_factory.mktemp("ref")
    res = run_cli(["train", "--nproc", "4", *REF, "--save-every", "2", "--save-params",
                   "--out", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    losses = rank_json(out, 2)["losses"]
    assert len(losses) == 4 and len(set(losses)) == 4
    return out, losses


def ckpt_dir(out: Path, step: int, stage: int = 2) -> Path:
    return out / f"stage{stage}" / "checkpoints" / f"step_{step:06d}"


def assert_same_files(a: Path, b: Path):
    """Two checkpoints hold bit-identical tensors (every rank, unit and state)."""
    for f in sorted(a.glob("rank*.pt")):
        x, y = (torch.load(d / f.name, weights_only=True) for d in (a, b))
        for unit, states in x["units"].items():
            for key, t in states.items():
                assert torch.equal(t, y["units"][unit][key]), (f.name, unit, key)


# --- resume ------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_resume_at_the_same_world_size_is_bit_identical_fp32(ref, tmp_path):
    out, losses = ref
    codes, logs = train_ranks(["--resume", str(ckpt_dir(out, 2)), "--out", str(tmp_path / "r"),
                               "--no-allocator", "--save-every", "2"], 4, tmp_path)
    assert codes == [0] * 4, logs
    got = rank_json(tmp_path / "r", 2)
    assert got["start_step"] == 2 and got["world_size"] == 4
    assert got["losses"] == losses[2:]                      # bit-identical floats
    assert_same_files(ckpt_dir(out, 4), ckpt_dir(tmp_path / "r", 4))


@pytest.mark.timeout(150)
def test_resume_at_the_same_world_size_is_bit_identical_bf16(tmp_path):
    base = ["--preset", "nano", "--stage", "3", "--steps", "4", "--no-allocator", "--timeout", "60"]
    codes, logs = train_ranks([*base, "--save-every", "2", "--out", str(tmp_path / "a")], 2, tmp_path)
    assert codes == [0, 0], logs
    resumed = tmp_path / "b"
    codes, logs = train_ranks([*base, "--save-every", "2", "--out", str(resumed), "--resume",
                               str(tmp_path / "a" / "stage3" / "checkpoints" / "step_000002")],
                              2, tmp_path)
    assert codes == [0, 0], logs
    first, second = rank_json(tmp_path / "a", 3)["losses"], rank_json(resumed, 3)["losses"]
    assert second == first[2:]
    assert_same_files(ckpt_dir(tmp_path / "a", 4, 3), ckpt_dir(resumed, 4, 3))
    meta = json.loads((ckpt_dir(resumed, 4, 3) / "meta.json").read_text())
    assert meta["losses"] == first                          # the history travels on


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size,stage", [(2, 3), (3, 1)])
def test_resume_at_another_world_size_and_stage(ref, tmp_path, world_size, stage):
    out, losses = ref
    codes, logs = train_ranks(["--resume", str(ckpt_dir(out, 2)), "--stage",
                               str(stage), "--out", str(tmp_path / "r"), "--no-allocator"],
                              world_size, tmp_path)
    assert codes == [0] * world_size, logs
    got = rank_json(tmp_path / "r", stage)
    assert got["world_size"] == world_size and got["start_step"] == 2
    # the saved shards do not fit this N (other shard sizes; at N = 3 other padding too): the
    # state went through the logical tensors
    saved = rank_json(out, 2)["units"]
    assert all(a["shard_numel"] != b["shard_numel"] for a, b in zip(got["units"], saved))
    if world_size == 3:
        assert all(a["padded_numel"] != b["padded_numel"] for a, b in zip(got["units"], saved))
    assert got["losses"] == pytest.approx(losses[2:], abs=1e-6, rel=0)


@pytest.mark.timeout(150)
def test_resume_with_another_bucket_size_and_world_size(ref, tmp_path):
    """The reference saved one unit per block at N = 4 (ZeRO-2); resume at N = 3 (ZeRO-1) with
    both blocks in one 1 MiB bucket and save that layout at step 3; resume it again at N = 2
    (ZeRO-2) with one unit per block. Both follow the uninterrupted run (fp32, 1e-6)."""
    out, losses = ref
    merged = tmp_path / "merged"
    codes, logs = train_ranks(["--resume", str(ckpt_dir(out, 2)), "--stage", "1", "--bucket-mb",
                               "1", "--save-every", "1", "--out", str(merged), "--no-allocator"],
                              3, tmp_path)
    assert codes == [0] * 3, logs
    got = rank_json(merged, 1)
    assert [u["name"] for u in got["units"]] == ["root", "block.0-1"]
    assert got["losses"] == pytest.approx(losses[2:], abs=1e-6, rel=0)
    meta = json.loads((ckpt_dir(merged, 3, 1) / "meta.json").read_text())
    assert [u["name"] for u in meta["units"]] == ["root", "block.0-1"]
    codes, logs = train_ranks(["--resume", str(ckpt_dir(merged, 3, 1)), "--stage", "2", "--out",
                               str(tmp_path / "split"), "--no-allocator"], 2, tmp_path)
    assert codes == [0] * 2, logs
    got = rank_json(tmp_path / "split", 2)
    assert [u["name"] for u in got["units"]] == ["root", "block.0", "block.1"]
    assert got["start_step"] == 3
    assert got["losses"] == pytest.approx(losses[3:], abs=1e-6, rel=0)


# --- kill during a save ------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(ref, tmp_path):
    out = tmp_path / "k"
    argv = [*REF, "--stage", "1", "--save-every", "2", "--no-allocator", "--out", str(out)]
    codes, logs = train_ranks([*argv, "--crash-in-save", "1"], 2, tmp_path)
    assert codes[1] == -signal.SIGKILL and codes != [0, 0], logs
    root = out / "stage1" / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"
    assert not (root / "step_000004").exists() and (root / ".tmp_step_000004").exists()
    ckpt = open_checkpoint(root)                             # complete and loadable
    assert ckpt.step == 2 and ckpt.world_size == 2
    codes, logs = train_ranks([*argv, "--resume", str(root)], 2, tmp_path)
    assert codes == [0, 0], logs
    assert rank_json(out, 1)["losses"] == pytest.approx(ref[1][2:], abs=1e-6, rel=0)
    assert (root / "latest").read_text() == "step_000004"
    open_checkpoint(root / "step_000004")


# --- bad checkpoints: one line, exit 2, nothing written ----------------------------------------
def _snapshot(folder: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _break(ckpt: Path, how: str):
    meta = json.loads((ckpt / "meta.json").read_text())
    if how == "missing rank file":
        (ckpt / "rank3.pt").unlink()
    elif how == "truncated file":
        f = ckpt / "rank1.pt"
        f.write_bytes(f.read_bytes()[:1000])
    elif how == "corrupt file":           # same size as recorded, unreadable contents
        f = ckpt / "rank1.pt"
        f.write_bytes(b"\0" * f.stat().st_size)
    elif how == "future version":
        meta["format_version"] = 99
        (ckpt / "meta.json").write_text(json.dumps(meta))


BAD = {   # how -> (extra argv, substrings of the one error line)
    "missing rank file": ([], ["rank3.pt", "missing"]),
    "truncated file": ([], ["rank1.pt", "truncated"]),
    "corrupt file": ([], ["rank1.pt", "unreadable"]),
    "future version": ([], ["format version 99", "upgrade"]),
    "other preset": (["--preset", "tiny"], ["preset 'nano'", "--preset nano"]),
    "batch not divisible": (["--nproc", "5"], ["12", "5", "checkpoint's global batch"]),
    "no checkpoint": ([], ["no checkpoint"]),
    "nothing left to train": (["--steps", "2"], ["--steps 2", "step 2"]),
}


@pytest.mark.parametrize("how", BAD)
def test_bad_checkpoints_get_one_line_and_change_nothing(ref, tmp_path, how, capsys, monkeypatch):
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("a launch started"))
    ckpt = tmp_path / "ck" / "step_000002"
    shutil.copytree(ckpt_dir(ref[0], 2), ckpt)
    _break(ckpt, how)
    target = tmp_path / "empty" if how == "no checkpoint" else ckpt
    target.mkdir(exist_ok=True)
    before = _snapshot(tmp_path)
    extra, words = BAD[how]
    code = cli.main(["train", "--nproc", "2", "--resume", str(target), "--out",
                     str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]
    assert _snapshot(tmp_path) == before                   # nothing written, nothing replaced


# --- consolidate and export --------------------------------------------------------------------
def _torch_reference_losses(state_dict, optim_state, steps, batch=12):
    """Plain torch: GPT + torch.optim.AdamW + clip_grad_norm_ on whole global batches."""
    from zerolab.data import get_batch, load_tokens
    from zerolab.model import GPT, get_config
    cfg = get_config("nano")
    model = GPT(cfg)
    model.load_state_dict(state_dict, strict=True)
    params = list(model.parameters())           # the GPT-2 / nanoGPT groups zerolab trains with
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    opt.load_state_dict(optim_state)
    tokens, _ = load_tokens(None, cfg.block_size)
    losses = []
    for step in steps:
        x, y = get_batch(tokens, step, batch, cfg.block_size, 0)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.timeout(120)
def test_consolidated_checkpoint_loads_strict_and_trains_on_like_torch(ref, tmp_path, capsys):
    from zerolab.model import GPT, get_config
    out, losses = ref
    model_pt, optim_pt = tmp_path / "model.pt", tmp_path / "optim.pt"
    assert cli.main(["checkpoint", "consolidate", str(out / "stage2" / "checkpoints" /
                     "step_000002"), str(model_pt), "--optimizer", str(optim_pt)]) == 0
    sd = torch.load(model_pt, weights_only=True)
    assert sd.keys() == GPT(get_config("nano")).state_dict().keys()
    assert "lm_head.weight" in sd and all(v.dtype == torch.float32 for v in sd.values())
    ref_losses, model = _torch_reference_losses(sd, torch.load(optim_pt, weights_only=True), [2, 3])
    assert ref_losses == pytest.approx(losses[2:], abs=1e-5, rel=0)
    # the final weights: --save-params (online all_gather of the masters), offline consolidation
    # of step 4, and plain torch continued from step 2 all agree
    saved = torch.load(out / "stage2" / "params.pt", weights_only=True)
    assert cli.main(["checkpoint", "consolidate", str(out / "stage2"), str(model_pt)]) == 0
    final = torch.load(model_pt, weights_only=True)
    assert saved.keys() == final.keys() == sd.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(saved[k], final[k]), k
        torch.testing.assert_close(v, final[k], atol=1e-5, rtol=0)
    capsys.readouterr()


@pytest.mark.timeout(60)
def test_consolidate_to_safetensors(ref, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    from zerolab.model import GPT, get_config
    path = tmp_path / "model.safetensors"
    assert cli.main(["checkpoint", "consolidate", str(ref[0] / "stage2"), str(path),
                     "--safetensors"]) == 0
    GPT(get_config("nano")).load_state_dict(load_file(str(path)), strict=True)


def fsdp2_worker(rank, n, dcp_dir, step):
    """FSDP2 (fully_shard per block + root) on `n` ranks loads the DCP export; returns the mean
    loss of the global batch of `step` (every rank its rows)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zerolab.data import get_batch, load_tokens, rank_slice
    from zerolab.model import GPT, get_config
    cfg = get_config("nano")
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=dcp_dir)
    model.load_state_dict(sd)
    tokens, _ = load_tokens(None, cfg.block_size)
    x, y = get_batch(tokens, step, 12, cfg.block_size, 0)
    with torch.no_grad():
        loss = model(rank_slice(x, rank, n), rank_slice(y, rank, n)).reshape(1)
    dist.all_reduce(loss)
    return loss.item() / n


@pytest.mark.timeout(120)
def test_export_loads_into_fsdp2_on_another_world_size(ref, tmp_path, capsys):
    out, losses = ref
    dcp_dir = tmp_path / "dcp"
    assert cli.main(["checkpoint", "consolidate", str(ckpt_dir(out, 2)), str(tmp_path / "m.pt"),
                     "--dcp", str(dcp_dir)]) == 0
    got = run_ranks(fsdp2_worker, 3, str(dcp_dir), 2, timeout=90)
    assert got[0] == pytest.approx(losses[2], abs=1e-5, rel=0)     # saved at N = 4, loaded at 3
    capsys.readouterr()


# --- one world across two launchers ------------------------------------------------------------
def _launcher(node_rank, port, out, steps="4", timeout="120"):
    args = ["train", "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--nproc", "2", *REF, "--steps", steps, "--timeout", timeout,
            "--out", str(out)]
    return subprocess.Popen([sys.executable, "-m", "zerolab", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"launcher still running after {timeout} s:\n{proc.communicate()[0]}")


@pytest.mark.timeout(200)
def test_two_launchers_form_one_world_of_four(ref, tmp_path):
    out, port = tmp_path / "two", free_port()
    procs = [_launcher(i, port, out) for i in (0, 1)]
    logs = [_finish(p, 150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    for rank in range(4):
        a, b = rank_json(ref[0], 2, rank), rank_json(out, 2, rank)
        assert b["world_size"] == 4 and b["rank"] == rank
        assert b["losses"] == a["losses"]
        assert b["comm"]["bytes_per_step"] == a["comm"]["bytes_per_step"]
        assert b["memory"]["model_states"] == a["memory"]["model_states"]


@pytest.mark.timeout(200)
def test_when_one_launcher_dies_the_other_exits_with_a_clear_line(tmp_path):
    out, port = tmp_path / "dies", free_port()
    procs = [_launcher(i, port, out, steps="100000", timeout="90") for i in (0, 1)]
    deadline, seen = time.monotonic() + 90, ""
    while "step 3/" not in seen and time.monotonic() < deadline:   # training has started
        seen += procs[0].stdout.readline()
    assert "step 3/" in seen, seen
    os.kill(procs[1].pid, signal.SIGKILL)                   # the launcher of node 1 dies
    procs[1].wait(10)
    start = time.monotonic()
    log = _finish(procs[0], 100)
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 90                    # its --timeout
    lines = [l for l in log.splitlines() if l.startswith("zerolab train: error:")]
    assert len(lines) == 1 and "peer rank went away" in lines[0], log[-3000:]


def test_negative_save_every_is_refused_before_any_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("a launch started"))
    code = cli.main(["train", "--save-every", "-1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--save-every -1" in err[0], err
    assert not (tmp_path / "o").exists()


def test_consolidate_of_a_broken_checkpoint_is_one_line(ref, tmp_path, capsys):
    ckpt = tmp_path / "step_000002"
    shutil.copytree(ckpt_dir(ref[0], 2), ckpt)
    (ckpt / "rank2.pt").unlink()
    code = cli.main(["checkpoint", "consolidate", str(ckpt), str(tmp_path / "m.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rank2.pt" in err[0], err
    assert not (tmp_path / "m.pt").exists()
