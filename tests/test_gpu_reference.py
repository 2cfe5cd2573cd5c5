"""The committed GPU reference run (labs/gpu_reference/h200-2026-12-04, `labs/gpu_session.sh` on
one H200, torch 2.11 + CUDA 13) held against the formulas and the CPU reference, on any machine.

What it pins: the run really was on CUDA; every rank's model-state bytes and ledger bytes per step
equal `zerolab.theory` at the run's padded Ψ (recomputed here from the rank's own options, not
read from the run's "theory" field); every fp32 stage's losses on the GPU match the gloo-CPU
fp32 reference to 1e-4 relative; and before each stage nothing is left over once cuBLAS's
workspaces are dropped, while those workspaces (the library's, the same in every later stage)
were what the first GPU run's leak check had counted.
"""
import json
import re
import statistics
from pathlib import Path

import pytest

from zerolab import theory
from zerolab.model import get_config
from zerolab.timing import flops, hardware

RUN = Path(__file__).resolve().parent.parent / "labs" / "gpu_reference" / "h200-2026-12-04"
RANKS = sorted(RUN.glob("*/stage*/rank*.json"))


def _load(path):
    return json.loads(path.read_text())


def test_the_reference_run_is_there_and_ran_on_cuda():
    notes = [r for r in RANKS if r.parts[-3] == "notes"]
    assert len(notes) == 8 and len([r for r in RANKS if r.parts[-3] == "fp32"]) == 8
    for path in notes:
        r = _load(path)
        assert r["device"].startswith("cuda") and r["backend"] == "gloo", path
    assert "NVIDIA H200" in (RUN / "env.txt").read_text()


@pytest.mark.parametrize("path", [p for p in RANKS if p.parts[-3] != "ref_cpu"],
                         ids=lambda p: "/".join(p.parts[-3:]))
def test_measured_bytes_equal_the_formulas(path):
    r = _load(path)
    psi, n, stage = r["num_params_padded"], r["world_size"], r["stage"]
    states = theory.model_state_bytes(psi, n, stage, r["precision"], grad_dtype=r["grad_dtype"],
                                      states=r["optimizer_states"], rounding=r["master_rounding"])
    assert r["memory"]["model_states"] == {k: pytest.approx(v, abs=0) for k, v in states.items()}
    traffic = theory.traffic_bytes(psi, n, stage, r["precision"],
                                   zero1_grad_op=r["zero1_grad_op"] or "all_reduce",
                                   grad_accum=r["grad_accum"], grad_dtype=r["grad_dtype"])
    measured = r["comm"]["bytes_per_step"]
    assert {k: measured[k] for k in traffic} == {k: pytest.approx(v, abs=0)
                                                  for k, v in traffic.items()}


def test_gpu_losses_match_the_cpu_fp32_reference():
    ref = _load(RUN / "ref_cpu" / "stage0" / "rank0.json")
    assert ref["device"] == "cpu"
    for path in RUN.glob("fp32/stage*/rank0.json"):
        r = _load(path)
        assert r["device"].startswith("cuda")
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-4), path


def test_nothing_leaks_between_stages_once_cublas_workspaces_are_dropped():
    for run in ("notes", "fp32"):
        for rank in (0, 1):
            before = [_load(RUN / run / f"stage{s}" / f"rank{rank}.json")["before_stage"]
                      for s in range(4)]
            assert all(b["strategies_alive"] == 0 for b in before)
            alloc = [b["cuda"]["allocated"] for b in before]
            assert max(alloc) - alloc[0] <= 1 << 20, alloc
            spaces = [b["cuda"]["library_workspaces"] for b in before]
            # nothing before the first matmul; then the same library bytes before every stage
            assert spaces[0] == 0 and len(set(spaces[1:])) == 1 and spaces[1] > 0, spaces


def test_the_bench_ratios_are_the_medians_of_their_rounds():
    for path in sorted(RUN.glob("bench*.json")):
        rows = {r["system"]: r for r in _load(path)["rows"]}
        base = statistics.median(rows["torch-ddp"]["times_s"])
        for r in rows.values():
            assert r["vs_torch_ddp"] == pytest.approx(statistics.median(r["times_s"]) / base), path


def test_the_mfu_notebook_12_quotes_follows_from_the_committed_run():
    """Notebook 12 §3 quotes gpt2's MFU on the H200 as 0.19-0.26: forward + backward FLOPs
    (6Ψ + 12·L·d·T a token, `flops.flops_per_token`) over the measured median fwd_bwd seconds of
    the plain ZeRO-2 step, over the H200's datasheet peak."""
    mfus = []
    for path in sorted(RUN.glob("offloadcheck*.json")):
        d = _load(path)
        assert d["device"] == "cuda" and d["preset"] == "gpt2" and d["world_size"] == 1
        plain = d["ranks"][0][0]
        assert plain["link"] is None                    # the row without offload
        seconds = statistics.median(x["fwd_bwd_s"] for x in plain["rounds"])
        c = get_config(d["preset"])
        per_token = flops.flops_per_token(d["psi_padded"], n_layer=c.n_layer, d_model=c.n_embd,
                                          seq_len=c.block_size)
        step = per_token * d["batch_size"] * c.block_size
        mfus.append(step / seconds / hardware.get_device("h200").flops)
    assert len(mfus) == 2
    prose = json.loads((RUN.parents[2] / "notebooks" / "12_time.ipynb").read_text())
    quoted = re.search(r"an MFU of \*\*(0\.\d+)-(0\.\d+)\*\*",
                       " ".join("".join(c["source"]) for c in prose["cells"]).replace("\n", " "))
    assert quoted, "notebook 12 no longer quotes the H200's MFU"
    assert [float(quoted[1]), float(quoted[2])] == [round(min(mfus), 2), round(max(mfus), 2)]
    assert max(mfus) < flops.MFU                        # the prose: below the cost model's default
