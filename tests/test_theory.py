"""The formulas against numbers published elsewhere, and against ratios recomputed here.

Sources: the ZeRO paper (Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12 gives
120 / 31.4 / 16.6 / 1.9 GB per device), the course notes (16Ψ, 5.5Ψ, 3.75Ψ, 2Ψ bytes per rank at
N = 8), nccl-tests' PERFORMANCE.md (ring bytes and busbw factors).
"""
from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import pytest

from zerolab import theory


def paper_round(x: float) -> float:
    """One decimal, halves rounded up as printed in the paper (1.875 GB -> 1.9)."""
    return float(Decimal(repr(x)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


# --- memory ------------------------------------------------------------------------------------
def test_zero_paper_figure_1():
    gb = [theory.model_state_total(7.5e9, 64, stage) / 1e9 for stage in (0, 1, 2, 3)]
    assert [paper_round(x) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_notes_bytes_per_parameter_at_n8():
    assert [theory.model_state_total(1, 8, s) for s in (0, 1, 2, 3)] == [16, 5.5, 3.75, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_per_state_bytes_follow_the_sharding_table(n):
    psi = 1000
    full = {"params": 2 * psi, "grads": 2 * psi, "master_weights": 4 * psi, "exp_avg": 4 * psi,
            "exp_avg_sq": 4 * psi}
    # written out here: optimizer states are sharded from stage 1, grads from 2, params from 3
    sharded = {0: set(), 1: {"master_weights", "exp_avg", "exp_avg_sq"},
               2: {"grads", "master_weights", "exp_avg", "exp_avg_sq"}, 3: set(full)}
    for stage in (0, 1, 2, 3):
        expect = {k: v / n if k in sharded[stage] else v for k, v in full.items()}
        assert theory.model_state_bytes(psi, n, stage) == pytest.approx(expect, rel=1e-15)
        fp32 = {k: 4 * psi / n if k in sharded[stage] else 4 * psi for k in full}
        assert theory.model_state_bytes(psi, n, stage, "fp32") == pytest.approx(fp32, rel=1e-15)


def test_optimizer_bytes_k_changes_only_the_optimizer_states():
    # K = 12 is the default; K = 4 (e.g. an fp32 master and nothing else) at N = 1
    assert theory.model_state_total(1, 1, 0, optimizer_bytes=12) == 16
    assert theory.model_state_total(1, 1, 0, optimizer_bytes=4) == 8


# --- traffic -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("precision,width", [("bf16", 2), ("fp32", 4)])
def test_traffic_per_step(n, precision, width):
    psi = 1_000_003
    two = 2 * (n - 1) / n * width * psi          # DDP, ZeRO-2, ZeRO-1 with reduce_scatter
    three = 3 * (n - 1) / n * width * psi        # ZeRO-3, ZeRO-1 as in the notes (all_reduce)

    def total(**kw):
        return sum(theory.traffic_bytes(psi, n, precision=precision, **kw).values())

    assert total(stage=0) == pytest.approx(two, rel=1e-12)
    assert total(stage=1, zero1_grad_op="reduce_scatter") == pytest.approx(two, rel=1e-12)
    assert total(stage=1, zero1_grad_op="all_reduce") == pytest.approx(three, rel=1e-12)
    assert total(stage=2) == pytest.approx(two, rel=1e-12)
    assert total(stage=3) == pytest.approx(three, rel=1e-12)
    # ZeRO-3 by op: two all-gathers of the params (forward, backward), one reduce-scatter
    z3 = theory.traffic_bytes(psi, n, 3, precision)
    assert z3["all_gather"] == pytest.approx(2 * (n - 1) / n * width * psi, rel=1e-12)
    assert z3["reduce_scatter"] == pytest.approx((n - 1) / n * width * psi, rel=1e-12)
    assert z3["all_reduce"] == 0


def test_traffic_with_gradient_accumulation():
    psi, n, A = 1000, 4, 3
    one = {s: theory.traffic_bytes(psi, n, s) for s in (0, 2, 3)}
    acc = {s: theory.traffic_bytes(psi, n, s, grad_accum=A) for s in (0, 2, 3)}
    assert acc[0] == one[0]                                   # DDP syncs once per step
    assert acc[2]["reduce_scatter"] == pytest.approx(A * one[2]["reduce_scatter"])
    assert acc[2]["all_gather"] == one[2]["all_gather"]       # one gather after the step
    assert acc[3] == pytest.approx({k: A * v for k, v in one[3].items()})


# --- busbw (nccl-tests PERFORMANCE.md) ---------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_busbw_factors(n):
    S, t = 4e9, 2.0
    algbw = S / t
    assert theory.busbw("all_reduce", S, t, n) == pytest.approx(algbw * 2 * (n - 1) / n)
    assert theory.busbw("reduce_scatter", S, t, n) == pytest.approx(algbw * (n - 1) / n)
    assert theory.busbw("all_gather", S, t, n) == pytest.approx(algbw * (n - 1) / n)
    assert theory.busbw("broadcast", S, t, n) == pytest.approx(algbw)


def test_padded_numel():
    assert [theory.padded_numel(k, 4) for k in (1, 3, 4, 1001, 5005)] == [4, 4, 4, 1004, 5008]


# --- bad inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("call,bad", [
    (lambda: theory.model_state_bytes(1e9, 8, 4), "stage 4"),
    (lambda: theory.model_state_bytes(1e9, 8, -1), "stage -1"),
    (lambda: theory.model_state_bytes(1e9, 8, "1"), "stage '1'"),
    (lambda: theory.model_state_bytes(1e9, 0, 1), "world_size 0"),
    (lambda: theory.model_state_bytes(1e9, 2.5, 1), "world_size 2.5"),
    (lambda: theory.model_state_bytes(1e9, 8, 1, precision="fp16"), "precision 'fp16'"),
    (lambda: theory.traffic_bytes(1e9, 8, 1, zero1_grad_op="all_gather"),
     "zero1_grad_op 'all_gather'"),
    (lambda: theory.traffic_bytes(1e9, 8, 5), "stage 5"),
    (lambda: theory.busbw("alltoall", 1e9, 1.0, 8), "op 'alltoall'"),
])
def test_bad_inputs_raise_value_error_naming_the_value(call, bad):
    with pytest.raises(ValueError) as err:
        call()
    assert bad in str(err.value)
