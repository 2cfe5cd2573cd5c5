"""ZeRO-Offload (zerolab/variants/offload.py): ZeRO-1/2 with the optimizer states and AdamW on the host.

Arithmetic: the same casts, clipping and AdamW as without offload, so on the CPU (device = host)
every loss, norm and parameter equals the non-offloaded stage's bit for bit, and so single-process
torch AdamW's (fp32, within test_equivalence's bound) - ZeRO-1 (both gradient paths), ZeRO-2 and
its before_forward gather, weights edited by the loop between steps and inside gathered().
Bytes: the meter's device and host categories equal `offload.device_bytes` / `host_bytes` at the
padded Ψ exactly (a toy whose sizes 2 does not divide), and each step's ledger moves exactly
`offload.transfer_bytes`. Time: on an emulated slow link a transfer takes no less than the link's
α-β time and not much more (zerolab.course.offloadcheck's table, run here on nano). The CLI:
`zerolab train --stage 2 --offload-optimizer` prints the host's bytes next to the formula, and
combinations it does not support are refused in one line.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import global_batch, make_model, run_ranks, run_zerolab
from zerolab import theory
from zerolab.variants import offload
from zerolab.course import testing

STEPS = 3
NANO = dict(model="nano", precision="fp32", grad_accum=1, rows_per_micro=2, max_norm=0.5)
ODD = dict(NANO, model="odd", precision="bf16", lr=1e-3)
EDITS = dict(NANO, precision="bf16", lr=1e-3)
# (stage, grad_op, gather) of the offloaded runs; each is compared with the same without offload
VARIANTS = [(2, None, "after_step"), (2, None, "before_forward"), (1, "all_reduce", "after_step"),
            (1, "reduce_scatter", "after_step")]
LINK = "0.1@100"        # 12.5 MB/s, α 100 us: nano's 34,688 B a step each way take ~3 ms


def _build(stage, grad_op, gather, model, comm, job, off, meter=None):
    from zerolab.variants.compose import make_strategy
    kw = dict(max_grad_norm=job["max_norm"], lr=job.get("lr", testing.LR), weight_decay=testing.WD,
              gather=gather, offload=off, meter=meter)
    if grad_op:
        kw["grad_op"] = grad_op
    return make_strategy(stage, model, comm, **kw)


def _train(s, model, rank, edits=False):
    """testing.train_job's loop (2 rows per rank) - with edits=True one that edits every
    weight: in place before step 1 (every rank alike), inside gathered(modifier_rank=0) before
    step 2 (rank 0 only: broadcast). (losses, norms, the offload ledger of each step)."""
    losses, norms, ledger = [], [], []
    for step in range(STEPS):
        s.comm.step = step
        with torch.no_grad():
            if edits and step == 1:
                for p in model.parameters():
                    p.mul_(0.9)
            if edits and step == 2:
                with s.gathered(modifier_rank=0):
                    for p in model.parameters():
                        p.add_(0.01 * (rank == 0))
        x, y = global_batch(model, step, 4)
        loss = s.forward(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2])
        s.backward(loss)
        norms.append(float(s.step()))
        losses.append(loss.item())
        ledger.append(list(s.offload.records) if getattr(s, "offload", None) is not None else [])
    return losses, norms, ledger


def offload_worker(rank, n, check_args):
    """Per variant: losses, norms and final parameters with and without offload (fp32 nano,
    bf16 odd toy, bf16 nano with edits); the odd toy's bytes; then offloadcheck on nano."""
    from zerolab.comm import Comm
    from zerolab.course import offloadcheck
    from zerolab.memory import MemoryMeter
    from zerolab.timing import hardware

    out = {}
    for stage, grad_op, gather in VARIANTS:
        for name, job in (("nano", NANO), ("odd", ODD), ("edits", EDITS)):
            if name != "nano" and (gather, grad_op) != ("after_step", None) and (
                    name, grad_op) != ("odd", "all_reduce"):
                continue                    # bytes: ZeRO-2 and ZeRO-1; edits: ZeRO-2
            for off in (None, offload.Offload(hardware.parse_link("pcie4"))):
                model = make_model(job["model"]).to(testing.DTYPES[job["precision"]])
                meter = MemoryMeter()
                s = _build(stage, grad_op, gather, model, Comm(), job, off, meter)
                if name == "nano":
                    losses, norms = testing.train_job(s, model, job, rank, n, STEPS)
                else:
                    losses, norms, ledger = _train(s, model, rank, edits=name == "edits")
                r = {"losses": losses, "norms": norms, "params": s.full_parameters()}
                if name != "nano" and off is not None:
                    r.update(current=dict(meter.current), peak_step=meter.peak_by_phase["step"],
                             peak_host=meter.peak_host_total,
                             psi=sum(u.padded_numel for u in s.units), ledger=ledger)
                out[(name, stage, grad_op, gather, off is not None)] = r
                s.close()
    args = offloadcheck.parser().parse_args(check_args)
    out["check"] = offloadcheck.rank_measure(args)
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A small text (the stdlib sources take seconds to read on a loaded machine)."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("ZeRO-Offload keeps the optimizer states on the host, AdamW too. " * 600)
    return path


@pytest.fixture(scope="module")
def runs(text):
    return run_ranks(offload_worker, 2, ["--preset", "nano", "--warmup", "1", "--rounds", "4",
                                         "--repeats", "2", "--offload-link", LINK, "--data",
                                         str(text)], timeout=240)


def _pairs(result, names=("nano", "odd", "edits")):
    for key, r in result.items():
        if key != "check" and key[-1] and key[0] in names:
            yield key, r, result[key[:-1] + (False,)]


@pytest.mark.timeout(300)
def test_offloaded_runs_equal_the_stage_bit_for_bit(runs):
    for result in runs:
        for key, got, plain in _pairs(result):
            assert got["losses"] == plain["losses"] and got["norms"] == plain["norms"], key
            assert all(torch.equal(got["params"][k], v) for k, v in plain["params"].items()), key


@pytest.mark.timeout(300)
def test_offloaded_runs_match_single_process_adamw(runs):
    ref = testing.reference(NANO, 2, STEPS)
    for rank, result in enumerate(runs):
        for key, got, _ in _pairs(result, ("nano",)):
            mean = [sum(r[key]["losses"][i] for r in runs) / 2 for i in range(STEPS)]
            assert mean == pytest.approx(ref["losses"], rel=2e-6), key
            assert got["norms"] == pytest.approx(ref["norms"], rel=2e-6), key
            assert testing.max_param_diff(got["params"], ref["params"]) <= 1e-6, (key, rank)


@pytest.mark.timeout(300)
def test_edits_between_steps_reach_the_host_master(runs):
    """The loop's in-place edit (step 1) and rank 0's gathered() edit (step 2) are brought down
    once per unit, in their step only, and train as without offload (the equality test above)."""
    for result in runs:
        for key, got, plain in _pairs(result, ("edits",)):
            edits = [(t, r["unit"]) for t, step in enumerate(got["ledger"]) for r in step
                     if r["dir"] == "edits"]
            units = ["root", "block.0", "block.1"]
            assert sorted(edits) == sorted((t, u) for t in (1, 2) for u in units), (key, edits)
            assert all(r["step"] == t for t, step in enumerate(got["ledger"]) for r in step)


@pytest.mark.timeout(300)
def test_device_and_host_bytes_and_transfers_equal_the_formulas(runs):
    for rank, result in enumerate(runs):
        for key, got, _ in _pairs(result, ("odd",)):
            stage, psi = key[1], got["psi"]
            assert psi == 5006 + 18 + 4 + 4004                 # bias3 padded: 3 -> 4
            device = offload.device_bytes(psi, 2, stage, "bf16")
            host = offload.host_bytes(psi, 2, "bf16")
            assert {k: got["current"][k] for k in theory.STATES} == device, (key, rank)
            assert {k: got["current"][k] for k in offload.HOST_STATES} == host, (key, rank)
            assert got["peak_step"] == sum(device.values()), (key, rank)    # no fp32 copy here
            assert got["peak_host"] == sum(host.values()) == 18 * psi / 2
            moved = offload.transfer_bytes(psi, 2)
            for t, step in enumerate(got["ledger"]):
                by = {d: sum(r["bytes"] for r in step if r["dir"] == d) for d in moved}
                assert by == moved and all(r["step"] == t for r in step), (key, t, step)
                assert len(step) == 2 * 4           # one copy per unit each way


@pytest.mark.timeout(300)
def test_offloadcheck_measures_exact_bytes_same_losses_and_the_emulated_link(runs):
    from zerolab.course import offloadcheck
    summary = runs[0]["check"]
    rows = offloadcheck.table(summary)
    assert [r["label"] for r in rows] == ["ZeRO-2", f"ZeRO-2 offload {LINK}"]
    assert all(r["exact"] and r["same_losses"] for r in rows)
    off = rows[1]
    assert off["moved"] == {**off["moved_formula"], "edits": 0}
    assert off["floor"] >= 0.999            # emulated: no transfer faster than its α-β time
    for d in ("down_s", "up_s"):            # and a step's transfers not much slower
        model, t = off["model"][d], off["time"][d]
        assert model == pytest.approx(3 * 100e-6 + 34_688 / 12.5e6)
        assert t["median"] <= model + 0.25, (d, model, t)
    assert off["time"]["down_s"]["min"] >= 0.999 * off["model"]["down_s"]   # waited at once
    assert off["model"]["host_s"] > 0 and off["time"]["host_s"]["median"] > 0
    text = offloadcheck.format_table(summary)
    assert "yes   equal" in text and "model" in text


@pytest.mark.timeout(180)
def test_zerolab_train_offloads_from_the_command_line(tmp_path, text):
    res = run_zerolab(["train", "--stage", "2", "--offload-optimizer", "--preset", "nano",
                       "--steps", "2", "--nproc", "2", "--out", str(tmp_path), "--data",
                       str(text)])
    assert res.returncode == 0, res.stdout + res.stderr
    host = next(line for line in res.stdout.splitlines() if line.startswith("  host"))
    assert "312,192     312,192  1.000" in host and "emulated pcie4" in host, res.stdout
    for rank in (0, 1):
        r = json.loads((tmp_path / "stage2" / f"rank{rank}.json").read_text())
        assert r["memory"]["model_states"] == r["theory"]["model_states_padded"]
        assert r["memory"]["host"] == r["theory"]["host_padded"]
        o = r["offload"]
        assert o["bytes_per_step"] == {**o["bytes_per_step_formula"], "edits": 0}
        assert o["link"]["name"] == "pcie4" and o["emulated"] and len(o["steps"]) == 2


@pytest.mark.parametrize("flags, says", [
    (["--stage", "3"], "not stage 3's: run it with --stage 1 or 2"),
    (["--stage", "0,2"], "not stage 0's"),
    (["--stage", "2", "--optimizer-states", "bf16-master"], "nothing to offload"),
    (["--stage", "2", "--offload-link", "fast"], "--offload-link 'fast' is not one of"),
])
def test_unsupported_combinations_are_refused_in_one_line(flags, says):
    from zerolab.run import options
    with pytest.raises(ValueError, match=says) as err:
        options.check(options.parse("train", ["--offload-optimizer", *flags]), world_size=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs --offload-optimizer"):
        options.check(options.parse("train", ["--offload-link", "pcie4"]), world_size=2)


def test_the_options_reach_the_strategy_and_the_formulas_scale():
    from zerolab.run import knobs, options
    args = options.parse("train", ["--stage", "1,2", "--offload-optimizer", "--offload-link",
                                   "1@10", "--nproc", "2"])
    argv = options.rank_argv(args)
    assert "--offload-optimizer --offload-link 1@10" in " ".join(argv)
    ranks = options.parse("ranks", argv)
    options.check(ranks, world_size=2)
    off = knobs.strategy_kwargs(2, ranks)["offload"]
    assert (off.link.bandwidth, off.link.latency) == pytest.approx((1e9 / 8, 10e-6))
    assert knobs.strategy_kwargs(2, options.parse("ranks", []))["offload"] is None
    psi, n = 7.5e9, 64                      # the ZeRO paper's example
    assert sum(offload.device_bytes(psi, n, 2).values()) == 2 * psi + 2 * psi / n
    assert sum(offload.device_bytes(psi, n, 1).values()) == 4 * psi
    assert sum(offload.host_bytes(psi, n).values()) == 18 * psi / n
    assert offload.host_bytes(psi, n, "fp32")["host_staging"] == 0
    assert offload.transfer_bytes(psi, n) == {"down": 2 * psi / n, "up": 2 * psi / n}
    import types

    from zerolab.variants.compose import make_strategy
    comm = types.SimpleNamespace(world_size=1, rank=0)      # one rank: no collective at setup
    with pytest.raises(ValueError, match="nothing to offload"):
        make_strategy(2, make_model("nano").to(torch.bfloat16), comm, offload=True,
                      optimizer_states="bf16-master")
    s = make_strategy(2, make_model("nano").to(torch.bfloat16), comm, offload=offload.Offload())
    with pytest.raises(ValueError, match="serves a strategy already"):
        make_strategy(2, make_model("nano").to(torch.bfloat16), comm, offload=s.offload)


def test_offloadcheck_refuses_a_device_it_cannot_use_in_one_line(monkeypatch):
    """`--device cuda` runs one NCCL rank per GPU: without a GPU, or with more ranks than GPUs,
    the check stops before launching with one line (it raised a traceback from inside each
    rank: torch's set_device on a CPU build)."""
    import subprocess
    import sys
    import time

    from zerolab.course import offloadcheck
    if offloadcheck.cuda_device_count() == 0:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "zerolab.course.offloadcheck", "--device",
                               "cuda", "--nproc", "1", "--rounds", "1"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stdout == "" and time.perf_counter() - t0 < 30
        assert proc.stderr.strip().splitlines() == [
            "offloadcheck: --device cuda but torch sees no CUDA device (use --device cpu)"]
    with pytest.raises(SystemExit, match=r"--nproc 2 > 1 GPU\(s\) here \(use --nproc 1"):
        offloadcheck.check_device("cuda", 2, gpus=1)
    with pytest.raises(SystemExit, match="--nproc 0: give 1 or more ranks"):
        offloadcheck.check_device("cpu", 0)
    offloadcheck.check_device("cuda", 1, gpus=1)          # what the H200 reference run used
    offloadcheck.check_device("cpu", 4, gpus=0)
