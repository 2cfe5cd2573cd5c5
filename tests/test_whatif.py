"""whatif (one rank of a fake large world, meta tensors) against the formulas and against a real
4-rank gloo run of the same preset: same bytes by state on every rank, same ledger bytes; its
peak holds the fp32 gradient copies of the optimizer step, and its time counts attention's FLOPs
at the preset's shape and a realistic MFU."""
from __future__ import annotations

import pytest
import torch
from conftest import run_ranks

from zerolab import STRATEGIES, theory
from zerolab.timing import whatif
from zerolab.timing.hardware import DEVICES, LINKS
from zerolab.comm import Comm
from zerolab.model import GPT, get_config
from zerolab.sharding import storage_bytes


@pytest.fixture(scope="module")
def reports_1b():
    return whatif.whatif("1b", 1024)


def test_1b_at_1024_ranks_matches_the_formula(reports_1b):
    reports = reports_1b
    assert [r["stage"] for r in reports] == [0, 1, 2, 3]
    for r in reports:
        assert r["world_size"] == 1024 and r["num_params"] == 1_211_224_064
        # from the code, on meta tensors; the formula at the padded Ψ (bf16: 2+2+4+4+4 bytes)
        assert r["model_states"] == pytest.approx(r["formula"], rel=1e-12)
        assert r["traffic_per_step"] == pytest.approx(r["formula_traffic"], rel=1e-12)
    # ZeRO-3 holds 16Ψ/N; its peak adds gathered blocks and buckets, far below DDP's 16Ψ
    z3 = reports[3]
    assert z3["model_states_total"] == pytest.approx(16 * z3["num_params_padded"] / 1024)
    assert z3["model_states_total"] < z3["peak_total"] < reports[0]["model_states_total"] / 10


def _real_rank(rank, world_size, preset):
    torch.manual_seed(0)
    cfg = get_config(preset)
    comm, out = Comm(), {}
    for stage in (0, 1, 2, 3):
        model = GPT(cfg).to(torch.bfloat16)
        comm.records.clear()
        strategy = STRATEGIES[stage](model, comm)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
        strategy.backward(strategy.forward(x, x))
        strategy.step()
        held = strategy.state_tensors()
        out[stage] = ({s: storage_bytes(held[s]) for s in theory.STATES},
                      {op: b for op, b in comm.bytes_by_op().items() if op != "broadcast"})
    return out


def test_matches_a_real_4_rank_run():
    real = run_ranks(_real_rank, 4, "nano", timeout=120)
    for rank in range(4):
        fake = {r["stage"]: r for r in whatif.whatif("nano", 4, rank=rank)}
        for stage in (0, 1, 2, 3):
            states, traffic = real[rank][stage]
            assert fake[stage]["model_states"] == states, (rank, stage)
            assert fake[stage]["traffic_per_step"] == pytest.approx(traffic, rel=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="rank 8"):
        whatif.whatif("nano", 8, rank=8)
    with pytest.raises(ValueError, match="'huge'"):
        whatif.whatif("huge", 8)


def test_peak_counts_the_fp32_gradient_copies(reports_1b):
    """On meta every storage's data_ptr is 0, so telling the fp32 copies from views of the bf16
    gradient buffer by data_ptr counted none: DDP's peak read 16Ψ. In the optimizer step DDP holds
    16Ψ + 4Ψ of fp32 copies, ZeRO-1 4Ψ + 12Ψ/N + 4Ψ/N (theory.peak_step_bytes)."""
    for r in reports_1b[:2]:
        psi = r["num_params_padded"]
        assert r["peak"]["grad_fp32"] == theory.grad_copy_bytes(psi, 1024, r["stage"])
        assert r["peak_total"] == theory.peak_step_bytes(psi, 1024, r["stage"])
    assert reports_1b[0]["peak_total"] == 20 * reports_1b[0]["num_params_padded"]


def test_step_times_count_attention_and_mfu(reports_1b):
    ddp = reports_1b[0]
    dev, link = DEVICES["h100"], LINKS["ib-ndr"]
    assert ddp["shape"] == {"n_layer": 24, "d_model": 2048, "seq_len": 1024}
    # by hand: (6Ψ + 12·L·d·s) FLOPs per token, 4096 tokens, at 989e12 x 0.4 FLOP/s
    flops = (6 * ddp["num_params"] + 12 * 24 * 2048 * 1024) * 4096
    for mfu in (0.4, 1.0):
        t = whatif.step_times(ddp, link, dev, 4096, mfu=mfu)
        assert t["overlap"].compute == pytest.approx(flops / (989e12 * mfu), rel=1e-12)
    # tree all_reduces at N = 1024: DDP's 25 all_reduces pay 20 α instead of 2046 α each
    ring = whatif.step_times(ddp, link, dev, 4096)["no_overlap"].total
    auto = whatif.step_times(ddp, link, dev, 4096, algorithm="auto")["no_overlap"].total
    assert ring - auto == pytest.approx(25 * (2046 - 20) * 5e-6, rel=1e-3)


def test_format_whatif_says_what_peak_mfu_and_algorithm_are(reports_1b):
    text = whatif.format_whatif(reports_1b, LINKS["ib-ndr"], DEVICES["h100"], 4096)
    assert "peak: the largest total the memory meter saw during the step" in text
    assert "fp32 gradient copies" in text and "activations are not counted" in text
    assert "MFU 0.4" in text and "12·L·d·s" in text and "L = 24, d = 2048, s = 1024" in text
    assert "collectives: ring. At N = 1024" in text
    with pytest.raises(ValueError, match="mfu 2 is not in"):
        whatif.format_whatif(reports_1b, LINKS["ib-ndr"], DEVICES["h100"], 4096, mfu=2)


def test_unit_layers():
    assert [whatif.unit_layers(n) for n in ("root", "block.3", "block.0-2", "block.10-11")] == [
        0, 1, 3, 2]
