"""`zerolab bench` runs end to end (nano, 2 ranks, one round) and its byte counts equal the ring
formulas: torch's systems counted by a c10d dispatch counter, zerolab's by its ledger (on gloo a
zerolab reduce_scatter is an in-place all_reduce plus a slice: the counter would see 2x the
logical bytes). zerolab DDP and torch DDP each all-reduce every fp32 gradient once, 2(n-1)/n · 4Ψ,
and so does ZeRO-2 with reduce_scatter + all_gather (plus the 4-byte gradient-norm all_reduce);
FSDP2 with resharding moves 3(n-1)/n · 4Ψ up to its own padding. Its peak column (MemTracker over
one step, the same for every system) holds at least the states held between steps, and sharding
lowers it: zerolab ZeRO-3 below zerolab DDP, FSDP2 (reshard) below torch DDP. Speed targets (and
the memory meter's cost, `--meter-cost`) live in the benchmark's printout, not here."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerolab import theory
from zerolab.model import GPT, get_config, num_params

SYSTEMS = ("zerolab-ddp,zerolab-zero2,zerolab-zero3,torch-ddp,fsdp2-reshard,torchlike-ddp-zero,"
           "torchlike-fsdp")


def _bench(out, *extra):
    proc = subprocess.run([sys.executable, "-m", "zerolab", "bench", "--preset", "nano",
                           "--rounds", "1", "--warmup", "1", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def bench_nano(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = _bench(out, "--systems", SYSTEMS)
    summary = json.loads((out / "bench.json").read_text())
    return stdout, {r["system"]: r for r in summary["rows"]}, summary


def test_bench_states_per_parameter(bench_nano):
    """fp32 on CPU: zerolab keeps an fp32 master copy even in fp32 (theory.bytes_per_param), so
    its DDP holds 4 + 4 + 4 + 4 + 4 = 20 bytes per parameter; torch's AdamW steps the weights in
    place: 16. The table says so, in a B/Ψ column and its footnote."""
    stdout, rows, summary = bench_nano
    psi = num_params(GPT(get_config("nano")))
    assert summary["num_params"] == psi
    assert rows["torch-ddp"]["state_bytes"] == 16 * psi
    per_param = {name: sum(theory.model_state_bytes(psi, 2, stage, "fp32").values())
                 for name, stage in (("zerolab-ddp", 0), ("zerolab-zero2", 2), ("zerolab-zero3", 3))}
    assert per_param["zerolab-ddp"] == 20 * psi
    for name, formula in per_param.items():          # zerolab pads each unit to a multiple of N
        assert rows[name]["state_bytes"] == pytest.approx(formula, rel=1e-3), name
    assert "B/Ψ" in stdout and "20.0" in stdout and "16.0" in stdout
    assert "fp32 master copy" in " ".join(stdout.split())     # (the footnote wraps)


def test_bench_runs_and_counts_bytes(bench_nano):
    stdout, rows, _ = bench_nano
    assert "x torch DDP" in stdout
    psi = num_params(GPT(get_config("nano")))
    ddp = sum(theory.traffic_bytes(psi, 2, 0, "fp32").values())
    assert rows["zerolab-ddp"]["bytes_per_step"] == pytest.approx(ddp, rel=1e-12)
    assert rows["torch-ddp"]["bytes_per_step"] == pytest.approx(ddp, rel=1e-12)
    pad = sum(theory.traffic_bytes(psi, 2, 2, "fp32").values())      # = ddp up to padding
    assert rows["zerolab-zero2"]["bytes_per_step"] - 4 == pytest.approx(pad, rel=1e-3)
    z3 = sum(theory.traffic_bytes(psi, 2, 3, "fp32").values())
    assert rows["fsdp2-reshard"]["bytes_per_step"] == pytest.approx(z3, rel=0.01)
    assert rows["torch-ddp"]["vs_torch_ddp"] == 1.0
    # zerolab behind torch's names: DDP + ZeroRedundancyOptimizer is ZeRO-1 as in the notes
    # (all_reduce + all_gather, 3(n-1)/n · 4Ψ up to padding); fully_shard keeps the root gathered
    # from forward into backward (FSDP2 does too), so it gathers the root once a step, not twice
    z1 = sum(theory.traffic_bytes(psi, 2, 1, "fp32").values())
    assert rows["torchlike-ddp-zero"]["bytes_per_step"] == pytest.approx(z1, rel=1e-3)
    model = GPT(get_config("nano"))
    root = psi - sum(p.numel() for p in model.blocks.parameters())
    once = z3 - (2 - 1) / 2 * 4 * root          # the root's backward all_gather not needed
    assert rows["torchlike-fsdp"]["bytes_per_step"] == pytest.approx(once, rel=0.02)  # dim0 pad
    assert rows["torchlike-fsdp"]["state_bytes"] == pytest.approx(
        rows["fsdp2-reshard"]["state_bytes"], rel=0.02)                  # 16Ψ/N either way


def test_bench_peak_column(bench_nano):
    stdout, rows, _ = bench_nano
    assert "peak MB" in stdout
    for name, r in rows.items():
        assert len(r["peak_bytes_by_rank"]) == 2 and r["peak_bytes"] == max(r["peak_bytes_by_rank"])
        assert r["peak_bytes"] >= r["state_bytes"] > 0, name
    assert rows["zerolab-zero3"]["peak_bytes"] < rows["zerolab-ddp"]["peak_bytes"]
    assert rows["fsdp2-reshard"]["peak_bytes"] < rows["torch-ddp"]["peak_bytes"]


def test_bench_refuses_bad_input(capsys):
    from zerolab import cli
    assert cli.main(["bench", "--systems", "zerolab-ddp,megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'megatron'" in err[0]
    assert cli.main(["bench", "--meter-cost", "--systems", "torch-ddp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'torch-ddp'" in err[0] and "--meter-cost" in err[0]
