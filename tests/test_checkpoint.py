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
    assert (root / "latest").read_text().split()[0] == "step_000002"     # + meta.json's sha256
    assert not (root / "step_000004").exists() and (root / ".tmp_step_000004").exists()
    ckpt = open_checkpoint(root)                             # complete and loadable
    assert ckpt.step == 2 and ckpt.world_size == 2
    codes, logs = train_ranks([*argv, "--resume", str(root)], 2, tmp_path)
    assert codes == [0, 0], logs
    assert rank_json(out, 1)["losses"] == pytest.approx(ref[1][2:], abs=1e-6, rel=0)
    assert (root / "latest").read_text().split()[0] == "step_000004"
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
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--save-every", "-1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--save-every: '-1'" in err[0], err
    assert not (tmp_path / "o").exists()


def test_consolidate_of_a_broken_checkpoint_is_one_line(ref, tmp_path, capsys):
    ckpt = tmp_path / "step_000002"
    shutil.copytree(ckpt_dir(ref[0], 2), ckpt)
    (ckpt / "rank2.pt").unlink()
    code = cli.main(["checkpoint", "consolidate", str(ckpt), str(tmp_path / "m.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rank2.pt" in err[0], err
    assert not (tmp_path / "m.pt").exists()


# --- everything that is state is saved: frozen parameters, per-parameter step counts ----------
# fp32 at lr 1e-4, as tests/test_equivalence.py (there zerolab matches single-process torch within
# 1e-6). FROZEN: GPT nano with wpe.weight and blocks.0.c_fc.weight frozen. COND: CondToy with
# find_unused_parameters: blocks.0.b gets a gradient at steps 0, 2, 3 only (step count 1, not 2,
# at the save after step 2), blocks.1.b / blocks.1.unused / spare never (no AdamW state at all).
FROZEN = {"model": "nano_frozen", "precision": "fp32", "grad_accum": 1, "rows_per_micro": 2,
          "max_norm": 0.5}
COND = dict(FROZEN, model="cond", find_unused=True, trigger=[[0], [], [3], [1, 2], []])
SAVED_AT, STEPS = 2, 4


def _train_steps(strategy, model, job, rank, n, start, stop):
    """Steps start .. stop - 1 of `job` on this rank's rows (testing.train_job from `start`)."""
    from zerolab.course.testing import global_batch, trigger
    per = job["rows_per_micro"]
    for step in range(start, stop):
        strategy.comm.step = step
        x, y = global_batch(model, step, n * per, trigger=trigger(job, step))
        strategy.backward(strategy.forward(x[rank * per:(rank + 1) * per],
                                           y[rank * per:(rank + 1) * per]))
        strategy.step()


def _strategy(stage, model, job, **kwargs):
    from zerolab.variants.compose import make_strategy
    from zerolab.comm import Comm
    from zerolab.course.testing import LR, WD
    return make_strategy(stage, model, Comm(), max_grad_norm=job["max_norm"], lr=LR, weight_decay=WD,
                             find_unused_parameters=job.get("find_unused", False), **kwargs)


def state_worker(rank, n, root):
    """FROZEN: ZeRO-3 trains SAVED_AT steps, saves, trains one more; then the checkpoint is
    loaded into GPT nano with nothing frozen (other seed). COND: ZeRO-3 trains STEPS steps saving
    after SAVED_AT; resumed by ZeRO-1 with both blocks in one bucket (other units than saved),
    with and without the saved per-parameter counts; and loaded into CondToy (other seed) with
    blocks.0.a.weight frozen."""
    from zerolab.course.testing import LR, WD, make_model
    from zerolab.run import checkpoint

    def meta(model):
        cfg = getattr(model, "cfg", None)
        return {"args": {"lr": LR, "weight_decay": WD}, "losses": [],
                "model_config": cfg.__dict__ if cfg is not None else {}}

    out, root = {}, Path(root)
    model = make_model("nano_frozen")
    s = _strategy(3, model, FROZEN)
    _train_steps(s, model, FROZEN, rank, n, 0, SAVED_AT)
    checkpoint.save(s, model, root / "frozen", SAVED_AT, meta(model))
    _train_steps(s, model, FROZEN, rank, n, SAVED_AT, SAVED_AT + 1)
    out["frozen_next"] = s.full_parameters()
    s.close()
    model = make_model("nano", seed=1)                  # wpe, c_fc trainable now
    s = _strategy(2, model, FROZEN)
    checkpoint.load(s, model, checkpoint.open_checkpoint(root / "frozen"), torch.float32)
    out["unfrozen"] = {"wpe.weight": model.wpe.weight.detach().clone(),
                       "root_steps": s.optimizer.state[s.units[0].master]["step"].clone(),
                       "root_names": list(s.units[0].names)}
    s.close()

    model = make_model("cond")
    s = _strategy(3, model, COND)
    _train_steps(s, model, COND, rank, n, 0, SAVED_AT)
    checkpoint.save(s, model, root / "cond", SAVED_AT, meta(model))
    _train_steps(s, model, COND, rank, n, SAVED_AT, STEPS)
    out["cond"] = s.full_parameters()
    s.close()
    for kind in ("resumed", "one_count"):
        model = make_model("cond", seed=1)
        s = _strategy(1, model, COND, bucket_mb=1)
        assert [u.name for u in s.units] == ["root", "block.0-1"]
        ckpt = checkpoint.open_checkpoint(root / "cond")
        if kind == "one_count":                         # what format version 1 restores
            ckpt._steps = {}
        checkpoint.load(s, model, ckpt, torch.float32)
        _train_steps(s, model, COND, rank, n, SAVED_AT, STEPS)
        out[kind] = s.full_parameters()
        s.close()
    model = make_model("cond", seed=1)
    model.blocks[0].a.weight.requires_grad_(False)      # trainable when saved, frozen now
    s = _strategy(2, model, COND)
    checkpoint.load(s, model, checkpoint.open_checkpoint(root / "cond"), torch.float32)
    out["frozen_now"] = model.blocks[0].a.weight.detach().clone()
    s.close()
    return out


def _torch_run(job, n, steps, model=None, opt=None):
    """Plain torch, no zerolab code but the model and the batches: AdamW over the trainable
    parameters in the GPT-2 groups + clip_grad_norm_ on whole global batches, steps
    `steps` (a range); a new model and optimizer unless given. Returns (model, optimizer)."""
    from zerolab.course.testing import BETAS, EPS, LR, WD, global_batch, make_model, trigger
    if model is None:
        model = make_model(job["model"])
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=LR, betas=BETAS, eps=EPS)
    for step in steps:
        x, y = global_batch(model, step, n * job["rows_per_micro"], trigger=trigger(job, step))
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                       job["max_norm"])
        opt.step()
    return model, opt


def assert_same_optimizer_state(got: dict, want: dict, atol=1e-6):
    """Two torch optimizer state dicts: the same groups and parameter numbering, the same
    parameters with state, the same step count each, moments within atol (exp_avg_sq: 1e-9)."""
    strip = [{k: v for k, v in g.items() if k != "params"} for g in want["param_groups"]]
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]] == strip
    assert got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert got["state"][i]["step"].item() == s["step"].item(), i
        torch.testing.assert_close(got["state"][i]["exp_avg"], s["exp_avg"], atol=atol, rtol=0)
        torch.testing.assert_close(got["state"][i]["exp_avg_sq"], s["exp_avg_sq"], atol=1e-9,
                                   rtol=0)


@pytest.fixture(scope="module")
def state_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    return root, run_ranks(state_worker, 2, str(root), timeout=120)


@pytest.mark.timeout(150)
def test_frozen_parameters_consolidate_into_torch_adamw_over_the_trainable(state_runs, tmp_path,
                                                                           capsys):
    """The issue's example (KeyError: 'wpe.weight' before): GPT nano with two frozen parameters,
    ZeRO-3 on 2 ranks. The consolidated model + optimizer are what single-process torch holds
    after the same steps, load into torch's own AdamW over the trainable parameters, and one
    more step there equals one more step of zerolab. Resumed with them trainable, the frozen
    parameters start from their saved values with fresh AdamW state."""
    from zerolab.course.testing import BETAS, EPS, LR, WD, max_param_diff
    from zerolab.model import GPT, get_config
    root, runs = state_runs
    model_pt, optim_pt = tmp_path / "model.pt", tmp_path / "optim.pt"
    ckpt = root / "frozen" / f"step_{SAVED_AT:06d}"
    assert json.loads((ckpt / "meta.json").read_text())["frozen"] == [
        "wpe.weight", "blocks.0.c_fc.weight"]
    assert cli.main(["checkpoint", "consolidate", str(ckpt), str(model_pt),
                     "--optimizer", str(optim_pt)]) == 0
    assert "frozen, in model.pt only: wpe.weight, blocks.0.c_fc.weight" in capsys.readouterr().out
    sd, optim = torch.load(model_pt, weights_only=True), torch.load(optim_pt, weights_only=True)
    ref_model, ref_opt = _torch_run(FROZEN, 2, range(SAVED_AT))
    assert sd.keys() == ref_model.state_dict().keys()
    for k, v in ref_model.state_dict().items():             # frozen ones included
        torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0)
    assert_same_optimizer_state(optim, ref_opt.state_dict())
    trainable = [p for p in ref_model.parameters() if p.requires_grad]
    assert len(optim["state"]) == len(trainable) == len(list(ref_model.parameters())) - 2
    # a torch user picks it up: GPT + load_state_dict(strict) + AdamW over the trainable params
    model = GPT(get_config("nano"))
    model.load_state_dict(sd, strict=True)
    model.wpe.weight.requires_grad_(False)
    model.blocks[0].c_fc.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    opt.load_state_dict(optim)
    _torch_run(FROZEN, 2, [SAVED_AT], model=model, opt=opt)
    got = {k: v.detach() for k, v in model.named_parameters()}
    for rank in runs:
        assert max_param_diff(rank["frozen_next"], got) <= 1e-6
    _torch_run(FROZEN, 2, [SAVED_AT], model=ref_model, opt=ref_opt)
    assert max_param_diff({k: v.detach() for k, v in ref_model.named_parameters()}, got) <= 1e-6
    # frozen when saved, trainable when resumed: its saved value, AdamW starts it at count 0
    for rank in runs:
        unfrozen = rank["unfrozen"]
        assert torch.equal(unfrozen["wpe.weight"], sd["wpe.weight"])
        counts = dict(zip(unfrozen["root_names"], unfrozen["root_steps"].tolist()))
        assert counts["wpe.weight"] == 0 and counts["wte.weight"] == SAVED_AT


@pytest.mark.timeout(150)
def test_per_parameter_step_counts_survive_a_resume_and_consolidation(state_runs):
    """CondToy with find_unused_parameters: blocks.0.b skipped step 1. Resumed (other stage,
    other units) it follows the uninterrupted run; with one count for all (format version 1's
    restore) it does not. The consolidated optimizer holds torch's own per-parameter counts."""
    from zerolab.course.testing import make_model, max_param_diff
    from zerolab.run.consolidate import consolidate, optimizer_state_dict
    root, runs = state_runs
    for rank in runs:
        assert max_param_diff(rank["resumed"], rank["cond"]) <= 1e-6
        assert max_param_diff(rank["one_count"], rank["cond"]) > 1e-5   # the test can fail
    ref_model, _ = _torch_run(COND, 2, range(STEPS))
    assert max_param_diff(runs[0]["cond"],
                          {k: v.detach() for k, v in ref_model.named_parameters()}) <= 1e-6
    sd, ckpt = consolidate(root / "cond", model=make_model("cond"))
    optim = optimizer_state_dict(ckpt, sd, model=make_model("cond"))
    ref_model, ref_opt = _torch_run(COND, 2, range(SAVED_AT))
    want = ref_opt.state_dict()
    assert_same_optimizer_state(optim, want)
    assert sorted({s["step"].item() for s in want["state"].values()}) == [1.0, 2.0]
    assert len(want["state"]) < len([p for p in ref_model.parameters()])   # never stepped: none
    # trainable when saved, frozen when resumed: it takes its saved value
    assert torch.equal(runs[0]["frozen_now"], ckpt.tensor("blocks.0.a.weight", "master"))


def _as_version_1(src: Path, dst: Path):
    """A copy of checkpoint `src` as format version 1 wrote it: no per-parameter step counts in
    the rank files, no "frozen" in meta.json."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    for f in sorted(dst.glob("rank*.pt")):
        state = torch.load(f, weights_only=True)
        del state["steps"]
        state["format_version"] = 1
        torch.save(state, f)
        meta["files"][f.name] = f.stat().st_size
    del meta["frozen"], meta["sha256"], meta["sealed"]    # nor the hashes of version 3
    meta["format_version"] = 1
    (dst / "meta.json").write_text(json.dumps(meta))


@pytest.mark.timeout(150)
def test_format_version_1_checkpoints_still_resume_and_consolidate(ref, tmp_path, capsys):
    """One count, the checkpoint's step, for every parameter (what version 1 restored)."""
    out, losses = ref
    old = tmp_path / "v1" / "step_000002"
    _as_version_1(ckpt_dir(out, 2), old)
    optims = []
    for src, name in ((ckpt_dir(out, 2), "v2"), (old, "v1")):
        assert cli.main(["checkpoint", "consolidate", str(src), str(tmp_path / f"{name}.pt"),
                         "--optimizer", str(tmp_path / f"{name}_optim.pt")]) == 0
        optims.append(torch.load(tmp_path / f"{name}_optim.pt", weights_only=True))
    assert optims[1]["param_groups"] == optims[0]["param_groups"]
    for i, s in optims[0]["state"].items():
        assert s["step"].item() == optims[1]["state"][i]["step"].item() == 2
        assert torch.equal(s["exp_avg"], optims[1]["state"][i]["exp_avg"])
    codes, logs = train_ranks(["--resume", str(old), "--stage", "1", "--out", str(tmp_path / "r"),
                               "--no-allocator"], 2, tmp_path)
    assert codes == [0, 0], logs
    assert rank_json(tmp_path / "r", 1)["losses"] == pytest.approx(losses[2:], abs=1e-6, rel=0)
    capsys.readouterr()
