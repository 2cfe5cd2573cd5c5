"""The low-precision state ladder (zerolab.optim: optimizer_states, master_rounding).

Bytes: after a step every rung's measured model states equal `theory.model_state_bytes` exactly,
on both ranks, at every stage (16 / 12 / 10 / 8 bytes per parameter, sharded as the fp32 states).
Arithmetic, against plain torch: stochastic rounding lands on one of the two bf16 neighbours,
is unbiased and repeats with its seed; an update below bf16's resolution stalls with nearest
rounding and is recovered by Kahan compensation (and, on average, by stochastic rounding).
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import global_batch, make_model, run_ranks
from zerolab import theory
from zerolab.optim import FlatAdamW, round_stochastic

RUNGS = [("bf16-moments", "nearest"), ("bf16-master", "kahan"), ("bf16-master", "nearest"),
         ("bf16-master", "stochastic")]
STEPS = 2           # measure after the second step: the moments appear in the first


def ladder_worker(rank, n):
    """Per (rung, stage), built from the ranks' options: Ψ padded, the meter's bytes after the last step, its peak inside the
    step, and the losses."""
    from zerolab.comm import Comm
    from zerolab.memory import MemoryMeter
    from zerolab.run import options
    from zerolab.run.stage import make_strategy

    out = {}
    for states, rounding in RUNGS:           # as `zerolab train --optimizer-states ...` does
        args = options.parse("ranks", ["--optimizer-states", states, "--master-rounding", rounding])
        for stage in theory.STAGES:
            model = make_model("nano").to(torch.bfloat16)
            comm, meter = Comm(), MemoryMeter()
            s = make_strategy(stage, model, comm, args, meter)
            assert (s.optimizer.states, s.optimizer.rounding) == (states, rounding)
            losses = []
            for step in range(STEPS):
                comm.step = step
                meter.reset_peaks()
                x, y = global_batch(model, step, 2 * n)
                loss = s.forward(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2])
                s.backward(loss)
                s.step()
                losses.append(float(loss))
            out[(states, rounding, stage)] = {
                "psi_padded": sum(u.padded_numel for u in s.units), "losses": losses,
                "current": {k: meter.current.get(k, 0) for k in theory.STATES},
                "grad_fp32": meter.peak.get("grad_fp32", 0),
                "peak_step": meter.peak_by_phase["step"]}
            s.close()
    return out


@pytest.fixture(scope="module")
def ladder_runs():
    return run_ranks(ladder_worker, 2)


@pytest.mark.timeout(180)
def test_every_rung_holds_exactly_its_formula_at_every_stage(ladder_runs):
    for rank, result in enumerate(ladder_runs):
        for (states, rounding, stage), r in result.items():
            expect = theory.model_state_bytes(r["psi_padded"], 2, stage, "bf16",
                                              states=states, rounding=rounding)
            assert r["current"] == expect, (states, rounding, stage, rank)
            per = sum(theory.bytes_per_param("bf16", None, states, rounding).values())
            assert per == {("bf16-moments", "nearest"): 12,
                           ("bf16-master", "kahan"): 10}.get((states, rounding), 8)
            assert r["grad_fp32"] == theory.grad_copy_bytes(r["psi_padded"], 2, stage, "bf16",
                                                            states=states), (states, stage)
            assert r["peak_step"] == theory.peak_step_bytes(
                r["psi_padded"], 2, stage, "bf16", states=states, rounding=rounding), \
                (states, rounding, stage, rank)


@pytest.mark.timeout(180)
def test_deterministic_rungs_train_alike_at_every_stage(ladder_runs):
    """Nearest and Kahan rounding are elementwise and need no random bits: every stage computes
    the same losses. Stochastic rounding draws per rank for shards, so only DDP vs itself."""
    for result in ladder_runs:
        for states, rounding in RUNGS:
            losses = [result[(states, rounding, s)]["losses"] for s in theory.STAGES]
            assert all(math.isfinite(v) for row in losses for v in row)
            if rounding != "stochastic":
                assert all(row == losses[0] for row in losses), (states, rounding, losses)


def bf16_neighbours(x: torch.Tensor):
    """(below, above): the bf16 grid points around positive fp32 `x`, by float64 arithmetic."""
    x64 = x.double()
    ulp = torch.exp2(torch.floor(torch.log2(x64)) - 7)        # bf16: 8 significant bits
    below = torch.floor(x64 / ulp) * ulp
    return below, below + ulp


def test_stochastic_rounding_is_unbiased_and_repeats_with_its_seed():
    torch.manual_seed(0)
    x = torch.rand(64, dtype=torch.float64).add(1.0).mul(torch.logspace(-3, 3, 64)).float()
    below, above = bf16_neighbours(x)
    draws = 4000
    g = torch.Generator().manual_seed(1)
    rounded = torch.stack([round_stochastic(x, g) for _ in range(draws)]).double()
    assert ((rounded == below) | (rounded == above)).all()
    p_up = (x.double() - below) / (above - below)
    sigma = (above - below) * torch.sqrt(p_up * (1 - p_up) / draws)
    assert ((rounded.mean(0) - x.double()).abs() <= 5 * sigma + 1e-12 * x.double()).all()
    nearest_bias = (x.to(torch.bfloat16).double() - x.double()).abs().mean()
    assert (rounded.mean(0) - x.double()).abs().mean() < nearest_bias / 5
    exact = torch.tensor([1.0, -2.5, 0.0, 3.0e-3]).to(torch.bfloat16).float()
    assert torch.equal(round_stochastic(exact).float(), exact)
    again = [round_stochastic(x, torch.Generator().manual_seed(1)) for _ in range(2)]
    assert torch.equal(again[0], again[1]) and torch.equal(again[0].double(), rounded[0])
    assert not torch.equal(round_stochastic(x, torch.Generator().manual_seed(2)), again[0])


W0 = (1 + torch.arange(256) / 256).to(torch.bfloat16)     # bf16 weights in [1, 2): ulp 2^-7


def _toy(rounding, steps, lr=2e-4, seed=0, rank=0):
    """W0 under a constant gradient: each AdamW update is ~lr = 2e-4, below half a bf16 ulp
    (2^-8 = 0.0039); the weights after `steps` (rounding None: torch's AdamW on fp32 copies)."""
    w = W0.float().clone() if rounding is None else W0.clone()
    opt = (torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
           if rounding is None else
           FlatAdamW([w], [[(0, 256)]], [[False]], lr=lr, weight_decay=0.0,
                     optimizer_states="bf16-master", master_rounding=rounding,
                     rounding_seed=seed, rank=rank))
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
    return w.detach()


def test_kahan_recovers_updates_that_nearest_rounding_loses():
    steps = 100                                     # fp32 moves each weight by ~0.02
    ref = _toy(None, steps).double()                # plain torch, fp32 weights
    assert (W0.double() - ref).min() > 0.015
    assert torch.equal(_toy("nearest", steps), W0)  # every update rounded away: stalled
    below, above = bf16_neighbours(ref.float())
    assert ((_toy("kahan", steps).double() - ref).abs() <= above - below).all()
    sr = _toy("stochastic", steps)                  # unbiased: right on average, noisy one by one
    assert abs((sr.double() - ref).mean()) < 0.1 * (W0.double() - ref).mean()
    assert torch.equal(sr, _toy("stochastic", steps))               # seeded: repeats
    assert not torch.equal(sr, _toy("stochastic", steps, rank=1))   # another shard's stream


def test_default_rung_is_the_unchanged_fp32_update():
    """optimizer_states "fp32" runs the very code path of before (torch's AdamW over views):
    equal, bit for bit, to torch.optim.AdamW; tests/test_equivalence.py covers the strategies."""
    torch.manual_seed(0)
    w = torch.randn(300)
    grads = [torch.randn(300) for _ in range(3)]
    a = w.clone()
    opt = FlatAdamW([a], [[(0, 100), (100, 300)]], [[True, False]], lr=1e-2)
    for g in grads:
        a.grad = g.clone()
        opt.step()
    b1, b2 = w[:100].clone().requires_grad_(), w[100:].clone().requires_grad_()
    ref = torch.optim.AdamW([{"params": [b1], "weight_decay": 0.1},
                             {"params": [b2], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    for g in grads:
        b1.grad, b2.grad = g[:100].clone(), g[100:].clone()
        ref.step()
    assert torch.equal(a, torch.cat([b1.detach(), b2.detach()]))
    assert opt.master_buffers([a]) == [a]


@pytest.mark.parametrize("states,rounding,precision,grad_dtype,says", [
    ("bf16", "nearest", "bf16", None, "--optimizer-states 'bf16' is not one of"),
    ("bf16-master", "up", "bf16", None, "--master-rounding 'up' is not one of"),
    ("bf16-moments", "kahan", "bf16", None, "needs --optimizer-states bf16-master"),
    ("bf16-master", "nearest", "fp32", None, "needs --precision bf16"),
    ("bf16-master", "nearest", "bf16", "fp32", "with fp32 gradients"),
])
def test_bad_combinations_are_refused_in_one_line(states, rounding, precision, grad_dtype, says):
    with pytest.raises(ValueError, match=says) as err:
        theory.check_optimizer_states(states, rounding, precision, grad_dtype)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="masters must be bf16"):
        FlatAdamW([torch.zeros(4)], [[(0, 4)]], [[True]], optimizer_states="bf16-master")


def test_ladder_rungs_and_megatron_table():
    rows = theory.state_ladder(1e9, 8)
    assert [r["bytes_per_param"] for r in rows] == [16, 12, 10, 8, 8]
    for r in rows:
        assert r["per_rank"][0] == r["bytes_per_param"] * 1e9
        assert r["per_rank"][3] == r["bytes_per_param"] * 1e9 / 8
        assert r["per_rank"][1] == 4e9 + (r["bytes_per_param"] - 4) * 1e9 / 8
    assert {k: a + b for k, (a, b) in theory.MEGATRON_BYTES.items()} == {
        ("fp16", "fp16"): 20, ("bf16", "fp32"): 18, ("fp32", "fp32"): 16}
    from zerolab.course.ladder import format_state_ladder
    text = format_state_ladder(1e9, 8)
    assert "Megatron" in text and "bf16/fp32: 18 = 6 + 12/d" in text
    assert [line.split()[-5] for line in text.splitlines()[1:6]] == ["16", "12", "10", "8", "8"]


def test_options_reach_the_ranks_and_bad_values_say_so_in_one_line():
    from zerolab.run import options
    args = options.parse("train", ["--optimizer-states", "bf16-master", "--master-rounding",
                                   "stochastic", "--nproc", "2"])
    argv = options.rank_argv(args)
    assert " ".join(argv).count("--optimizer-states bf16-master --master-rounding stochastic") == 1
    options.check(options.parse("ranks", argv), world_size=2)
    for flags, says in ((["--master-rounding", "kahan"], "needs --optimizer-states bf16-master"),
                        (["--optimizer-states", "bf16-master", "--precision", "fp32"],
                         "needs --precision bf16")):
        with pytest.raises(ValueError, match=says) as err:
            options.check(options.parse("train", flags), world_size=2)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="invalid choice: 'bf16'"):
        options.parse("train", ["--optimizer-states", "bf16"])


def test_a_rung_is_resumed_with_its_checkpoint_and_kahan_is_not_checkpointed():
    """--resume takes the checkpoint's --optimizer-states / --master-rounding (a resume without
    the flags must not silently continue on fp32 states); Kahan's compensation buffer is not in
    a checkpoint, so saving or resuming with it is refused in one line."""
    from zerolab.run import checkpoint, options
    assert {"optimizer_states", "master_rounding"} <= set(checkpoint.RESUMED_ARGS)
    kahan = ["--optimizer-states", "bf16-master", "--master-rounding", "kahan"]
    for more in (["--save-every", "2"], ["--resume", "somewhere"]):
        with pytest.raises(ValueError, match="kahan cannot be checkpointed") as err:
            options.check(options.parse("train", kahan + more), world_size=2)
        assert "\n" not in str(err.value)
    options.check(options.parse("train", kahan), world_size=2)      # without checkpoints: fine
