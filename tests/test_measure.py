"""What the ranks hold and move, measured, against the formulas of zerolab.theory.

Memory: `MemoryMeter.current` after a step equals `theory.model_state_bytes` at the padded Ψ,
exactly, on every rank. Traffic: the comm ledger of one step equals `theory.traffic_bytes`, and an
independent `TorchDispatchMode` that watches torch's own c10d ops (and computes ring bytes itself
from the tensors it sees) agrees with the ledger op by op.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import pytest
import torch

from conftest import global_batch, make_model, run_ranks
from zerolab import theory

VARIANTS = [(0, None), (1, "all_reduce"), (1, "reduce_scatter"), (2, None), (3, None),
            (3, "prefetch")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEPS = 2          # measure the second step: AdamW creates exp_avg / exp_avg_sq in the first


def _watch_c10d():
    """A TorchDispatchMode that sums per-rank ring bytes of every c10d collective it sees."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class C10dWatch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.unknown = defaultdict(float), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func)
            if "c10d" in name:
                n = dist.get_world_size()
                sizes = [t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                         if isinstance(t, torch.Tensor)]
                # nccl-tests ring bytes per rank; S is the full array: the larger of (output,
                # input) for reduce-scatter and all-gather, the tensors themselves otherwise
                if "allreduce" in name:
                    self.bytes["all_reduce"] += sum(sizes) * 2 * (n - 1) / n
                elif "reduce_scatter" in name:
                    self.bytes["reduce_scatter"] += max(sizes) * (n - 1) / n
                elif "allgather" in name or "all_gather" in name:
                    self.bytes["all_gather"] += max(sizes) * (n - 1) / n
                elif "broadcast" in name:
                    self.bytes["broadcast"] += sum(sizes)
                else:
                    self.unknown.append(name)
            return func(*args, **kwargs)

    return C10dWatch()


def _allocator_step(s):
    """Run `s.step()` under MemTracker (the allocator's view, independent of the meter); return
    its peak in bytes. Every tensor alive before the step is registered as external."""
    from torch.distributed._tools.mem_tracker import MemTracker
    held = [t for ts in s.state_tensors().values() for t in ts if t is not None]
    tracker = MemTracker()
    tracker.track_external(s.model, s.optimizer, *held)
    with tracker:
        s.step()
    snap = tracker.get_tracker_snapshot("peak")
    return sum(int(v) for dev, stats in snap.items() for k, v in stats.items()
               if str(k).split(".")[-1].lower() == "total")


def measure_worker(rank, n, model_name, precision, grad_accum, grad_dtype=None):
    """Per variant: this rank's units, Ψ, meter current/peak after the measured step, ledger bytes
    of that step (grads+params by theory's ops, and all kinds), the dispatch-mode bytes, the
    meter's peak inside the optimizer step and the allocator's (MemTracker) over the step."""
    from zerolab.variants.compose import make_strategy
    from zerolab.comm import Comm
    from zerolab.memory import MemoryMeter
    from zerolab.model import num_params

    out = {}
    for stage, grad_op in VARIANTS:
        model = make_model(model_name).to(DTYPES[precision])
        psi = num_params(model)             # before ZeRO-3 empties the parameters at rest
        comm, meter = Comm(), MemoryMeter()
        kwargs = ({"prefetch": True} if grad_op == "prefetch" else {"grad_op": grad_op} if grad_op
                  else {"prefetch": False} if stage == 3 else {})
        s = make_strategy(stage, model, comm, max_grad_norm=1.0, lr=1e-3, weight_decay=0.1,
                              meter=meter, grad_dtype=DTYPES[grad_dtype] if grad_dtype else None,
                              **kwargs)
        watch = _watch_c10d()
        for step in range(STEPS):
            comm.step = step
            meter.reset_peaks()
            meter.sample(s, "step start")
            x, y = global_batch(model, step, 2 * n * grad_accum)
            with watch if step == STEPS - 1 else contextlib.nullcontext():
                for micro in range(grad_accum):
                    rows = slice((rank * grad_accum + micro) * 2,
                                 (rank * grad_accum + micro + 1) * 2)
                    loss = s.forward(x[rows], y[rows])
                    # the course's loop: ZeRO-2/3 reduce-scatter every micro-step (the notes'
                    # memory; sync=False would hold the full gradient, test_loops.py)
                    s.backward(loss / grad_accum, sync=micro == grad_accum - 1 or stage >= 2)
                allocator = _allocator_step(s) if step == STEPS - 1 else s.step()
        last = STEPS - 1
        out[(stage, grad_op)] = {
            "units": [(u.name, u.numel, u.padded_numel, u.shard_numel) for u in s.units],
            "psi": psi, "current": dict(meter.current), "peak": dict(meter.peak),
            "ledger": comm.bytes_by_op(step=last),
            "ledger_all": comm.bytes_by_op(step=last, what=("grads", "params", "metric")),
            "watched": dict(watch.bytes), "unknown_ops": watch.unknown,
            "peak_step": meter.peak_by_phase["step"], "allocator_step": allocator,
            "max_param_numel": max(max(u.shapes, key=lambda sh: sh.numel()).numel()
                                   for u in s.units),
        }
        s.close()
    return out


@pytest.fixture(scope="module")
def nano4_bf16():
    """GPT nano with 4 blocks, bf16, 3 ranks (3 divides none of its unit sizes), no accumulation."""
    return run_ranks(measure_worker, 3, "nano4", "bf16", 1)


@pytest.fixture(scope="module")
def odd_fp32_accum2():
    """The odd-sized toy model, fp32, 4 ranks, 2 micro-steps per optimizer step."""
    return run_ranks(measure_worker, 4, "odd", "fp32", 2)


@pytest.fixture(scope="module")
def nano_bf16_fp32_grads():
    """GPT nano, bf16 weights with fp32 gradients (--grad-dtype fp32: 18 bytes per parameter)."""
    return run_ranks(measure_worker, 2, "nano", "bf16", 1, "fp32")


CASES = [("nano4_bf16", 3, "bf16", 1), ("odd_fp32_accum2", 4, "fp32", 2),
         ("nano_bf16_fp32_grads", 2, "bf16", 1)]
GRAD_DTYPE = {"nano_bf16_fp32_grads": "fp32"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fixture,n,precision,A", CASES)
def test_model_state_bytes_equal_formula_at_padded_psi(request, fixture, n, precision, A):
    for rank, result in enumerate(request.getfixturevalue(fixture)):
        for (stage, grad_op), r in result.items():
            psi_padded = sum(u[2] for u in r["units"])
            psi = r["psi"]
            assert psi == sum(u[1] for u in r["units"])
            assert all(u[2] % n == 0 and u[3] * n == u[2] for u in r["units"])
            assert 0 <= psi_padded - psi < n * len(r["units"])
            expect = theory.model_state_bytes(psi_padded, n, stage, precision,
                                              grad_dtype=GRAD_DTYPE.get(fixture))
            measured = {state: r["current"][state] for state in theory.STATES}
            assert measured == expect, (stage, grad_op, rank)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fixture,n,precision,A", CASES)
def test_ledger_bytes_per_step_equal_formula(request, fixture, n, precision, A):
    for rank, result in enumerate(request.getfixturevalue(fixture)):
        for (stage, grad_op), r in result.items():
            psi_padded = sum(u[2] for u in r["units"])
            expect = theory.traffic_bytes(psi_padded, n, stage, precision, grad_op if stage == 1 else "all_reduce",
                                          grad_accum=A, grad_dtype=GRAD_DTYPE.get(fixture))
            ledger = r["ledger"]
            assert ledger["broadcast"] == 0
            # float sums of (n-1)/n-scaled terms: equal up to rounding, hence rel=1e-12
            assert {op: ledger[op] for op in expect} == pytest.approx(expect, rel=1e-12), \
                (stage, grad_op, rank)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fixture,n,precision,A", CASES)
def test_ledger_agrees_with_torch_dispatch_watch(request, fixture, n, precision, A):
    for rank, result in enumerate(request.getfixturevalue(fixture)):
        for (stage, grad_op), r in result.items():
            assert r["unknown_ops"] == []
            watched = {op: r["watched"].get(op, 0.0) for op in r["ledger_all"]}
            # on gloo zerolab runs a reduce_scatter of S as an in-place all_reduce of S plus a
            # slice (comm.Comm.reduce_scatter): c10d sees an all_reduce, 2(n-1)/n·S per rank,
            # twice the logical (n-1)/n·S the ledger counts for the reduce_scatter
            expect = dict(r["ledger_all"])
            expect["all_reduce"] += 2 * expect["reduce_scatter"]
            expect["reduce_scatter"] = 0.0
            assert watched == pytest.approx(expect, rel=1e-12), (stage, grad_op, rank)
            assert sum(watched.values()) > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fixture,n,precision,A", CASES)
def test_peak_inside_the_optimizer_step_equals_formula_and_the_allocator(request, fixture, n,
                                                                         precision, A):
    """The meter samples inside the step: its peak there is the resident model states plus the
    fp32 gradient copies (bf16 grads: 20Ψ in DDP, 4Ψ + 16Ψ/N in ZeRO-1, ...; fp32 grads: none).
    MemTracker, which sees every tensor the allocator hands out, peaks at most two fp32 copies of
    the largest parameter above it (AdamW's per-parameter temporaries `exp_avg_sq.sqrt()` and its
    quotient, which the meter does not categorise) plus 4 KiB of scalars, and never below it."""
    for rank, result in enumerate(request.getfixturevalue(fixture)):
        for (stage, grad_op), r in result.items():
            psi_padded = sum(u[2] for u in r["units"])
            expect = theory.peak_step_bytes(psi_padded, n, stage, precision, GRAD_DTYPE.get(fixture))
            assert r["peak_step"] == expect, (stage, grad_op, rank)
            margin = 2 * 4 * r["max_param_numel"] + 4096
            assert r["peak_step"] <= r["allocator_step"] <= r["peak_step"] + margin, \
                (stage, grad_op, rank, r["allocator_step"] - r["peak_step"], margin)


@pytest.mark.timeout(180)
def test_zero2_grads_never_exceed_the_shard(nano4_bf16):
    for result in nano4_bf16:
        r = result[(2, None)]
        shard_bytes = sum(u[3] for u in r["units"]) * 2          # bf16
        assert r["peak"]["grads"] == shard_bytes
        full_bytes = sum(u[2] for u in r["units"]) * 2
        assert 0 < r["peak"]["grad_buckets"] < full_bytes        # never every bucket at once


@pytest.mark.timeout(180)
def test_zero3_never_gathers_every_block_at_once(nano4_bf16):
    for result in nano4_bf16:
        r = result[(3, None)]
        blocks = [u for u in r["units"] if u[0].startswith("block.")]
        assert len(blocks) >= 4
        full_bytes = sum(u[2] for u in r["units"]) * 2           # bf16
        assert 0 < r["peak"]["gathered_params"] < full_bytes
        assert r["current"]["gathered_params"] == 0              # all freed after the step


@pytest.mark.timeout(180)
def test_zero3_prefetch_holds_one_more_block_and_moves_the_same_bytes(nano4_bf16):
    """Without prefetch the gathered peak is the root unit plus one block; prefetching the next
    block's all_gather adds exactly one block; the bytes on the wire are the same."""
    for result in nano4_bf16:
        plain, ahead = result[(3, None)], result[(3, "prefetch")]
        size = {name: padded * 2 for name, _, padded, _ in plain["units"]}     # bf16 bytes
        block = max(v for k, v in size.items() if k.startswith("block."))
        assert plain["peak"]["gathered_params"] == size["root"] + block
        assert ahead["peak"]["gathered_params"] == size["root"] + 2 * block
        assert ahead["ledger"] == plain["ledger"]
        assert ahead["current"]["gathered_params"] == 0


@pytest.mark.parametrize("n", [1, 3, 4, 7])
def test_padding_held_by_the_ranks_adds_up_to_the_padding(n):
    """Over all ranks, the padding inside the shards is exactly each unit's padding, once; a
    replicated state carries the whole padding on every rank (zerolab.memory.padding_bytes)."""
    from zerolab import theory
    from zerolab.memory import padding_bytes
    from zerolab.sharding import FlatUnit

    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((1001, 5), (3,), (1,), (2, 2))]
    layouts = [[FlatUnit("a", params[:2], n, r), FlatUnit("b", params[2:], n, r)] for r in range(n)]
    pad = sum(u.padded_numel - u.numel for u in layouts[0])
    assert 0 <= pad < n * 2
    per = theory.bytes_per_param("bf16")
    for stage in theory.STAGES:
        held = [padding_bytes(units, stage) for units in layouts]
        for state in theory.STATES:
            if theory.is_sharded(state, stage):
                assert sum(h[state] for h in held) == pad * per[state]
            else:
                assert all(h[state] == pad * per[state] for h in held)


def test_an_idle_meter_does_no_work():
    """`zerolab train` keeps the meter idle (enabled = False) in the steps whose memory it does
    not report: there `sample` must not even ask the strategy for its tensors; enabled again,
    it samples them."""
    from zerolab.memory import MemoryMeter

    class Strategy:
        calls = 0

        def state_tensors(self):
            self.calls += 1
            return {"params": [torch.zeros(3)], "grads": [torch.zeros(5)]}

    s, meter = Strategy(), MemoryMeter(enabled=False)
    meter.sample(s, "idle")
    assert s.calls == 0 and meter.current == {} and meter.peak_total == 0
    meter.enabled = True
    meter.sample(s, "on")
    assert s.calls == 1 and meter.current == {"params": 12, "grads": 20} and meter.peak_total == 32
