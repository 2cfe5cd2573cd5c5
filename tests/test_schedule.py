"""One schedule: the cost model replays the collectives the strategy code issues, and nothing else.

`zerolab.timing.schedule.record` runs the strategy that zerolab.variants.compose builds for a stage and its
variant options on a skeleton model (meta tensors, a Comm that moves nothing) and keeps the
second step's events. Held here against the independent reference, the same strategy training
the course's GPT on gloo ranks: the collectives of its second step, in issue order - op, what
they move, for which unit, on which tier, in which phase, and the fraction of the unit's padded
elements each one carries - are the recorded ones, for every stage and every variant the cost
model is asked about. Then `costmodel.step_time` is a replay of exactly those collectives (the
guards' agreement check excepted: the docstring of timing/schedule.py says why), and a variant
that moves the collectives (a deeper prefetch) moves them in the replay without any change in
zerolab/timing/.
"""
from __future__ import annotations

import pytest

from conftest import make_model, run_ranks
from zerolab.timing import costmodel, hardware, schedule

CASES = [(0, {}), (1, {}), (1, {"grad_op": "reduce_scatter"}), (1, {"gather": "before_forward"}),
         (2, {}), (2, {"gather": "before_forward"}), (3, {}), (3, {"prefetch": 0}),
         (3, {"prefetch": 2}), (3, {"prefetch": -1, "keep_root": True})]
HYBRID = [(3, {"hybrid": "hsdp", "ranks_per_node": 2}), (3, {"hybrid": "hpz", "ranks_per_node": 2})]


def ledger_worker(rank, n, cases):
    """The collectives of the second step of each case, as (op, what, unit, tier, phase,
    numel / the unit's padded numel), in issue order (the guards' checks left out)."""
    from zerolab.comm import Comm
    from zerolab.variants.compose import make_strategy
    from conftest import global_batch
    out = []
    for stage, opts in cases:
        model = make_model("nano")
        comm = Comm()
        s = make_strategy(stage, model, comm, lr=1e-3, **opts)
        padded = {u.name: u.padded_numel for u in s.units}
        first = 0
        for step in range(2):
            comm.step = step
            first = len(comm.records)
            x, y = global_batch(model, step, 2 * n)
            s.backward(s.forward(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
            s.step()
        out.append([(r.op, r.what, r.unit, r.tier, r.phase,
                     r.numel / padded[r.unit] if r.unit in padded else 0.0)
                    for r in comm.records[first:]
                    if r.what in ("grads", "params") or r.unit == "grad_norm"])
        s.close()
    return out


def recorded(stage, opts, n_blocks):
    return [(op, what, unit, tier, phase, fraction) for kind, *rest in
            schedule.record(stage, n_blocks, True, **opts) if kind == "issue"
            for _, op, what, unit, fraction, tier, _, phase in [rest]]


def _same(real, rec):
    assert [r[:5] for r in real] == [r[:5] for r in rec]
    for a, b in zip(real, rec):
        assert a[5] == pytest.approx(b[5]) or a[1] == "metric"


def test_the_recorded_schedule_is_what_the_code_issues():
    blocks = len(make_model("nano").blocks)
    real = run_ranks(ledger_worker, 2, CASES, timeout=180)[0]
    for (stage, opts), ledger in zip(CASES, real):
        rec = recorded(stage, opts, blocks)
        assert len(rec) == len(ledger) > 0, (stage, opts)
        _same(ledger, rec)


def test_hybrid_schedules_are_what_the_code_issues():
    blocks = len(make_model("nano").blocks)
    real = run_ranks(ledger_worker, 4, HYBRID, timeout=180)[0]
    for (stage, opts), ledger in zip(HYBRID, real):
        rec = recorded(stage, opts, blocks)
        assert len(rec) == len(ledger) > 0, opts
        assert {r[3] for r in rec} == ({"intra", "inter"} if opts["hybrid"] == "hsdp"
                                       else {"", "intra"}), opts
        _same(ledger, rec)


def test_step_time_replays_the_recorded_collectives():
    """Its collectives are the schedule's issues, in order, sized unit x fraction x width."""
    link = hardware.LINKS["ib-ndr"]
    units = [costmodel.Unit("root", 4e6, 1e-3, 2e-3)] + [
        costmodel.Unit(f"block.{i}", 1e7, 2e-3, 4e-3) for i in range(3)]
    width = {"grads": 2, "params": 2}
    for stage, opts in CASES:
        kw = {("zero1_grad_op" if k == "grad_op" else "zero12_gather" if k == "gather" else k): v
              for k, v in opts.items()}
        kw.setdefault("prefetch", 1 if stage == 3 else False)
        got = costmodel.step_time(stage, units, 8, link, **kw)
        rec = recorded(stage, {**opts, **({"prefetch": kw["prefetch"]} if stage == 3 else {})}, 3)
        named = {u.name: u for u in units}
        assert [(c.op, c.unit, c.phase) for c in got.collectives] == \
            [(op, unit, phase) for op, _, unit, _, phase, _ in rec]
        for c, (op, what, unit, _, _, fraction) in zip(got.collectives, rec):
            size = 4 if what == "metric" else fraction * named[unit].numel * width[what]
            assert c.size_bytes == pytest.approx(size)


def test_a_deeper_prefetch_moves_the_gathers_in_the_replay():
    """PrefetchDepth lives in zerolab/variants/prefetch.py; the replay sees what it does: with depth -1
    every block's forward gather is issued before the first block computes."""
    events = schedule.record(3, 4, True, prefetch=-1)
    first_compute = next(i for i, e in enumerate(events) if e[0] == "compute")
    gathers = [i for i, e in enumerate(events) if e[0] == "issue" and e[2] == "all_gather"
               and e[8] == "forward"]
    assert len(gathers) == 5 and all(i < first_compute for i in gathers)
    one = schedule.record(3, 4, True)           # the lesson's default: one block ahead
    first_compute = next(i for i, e in enumerate(one) if e[0] == "compute")
    assert sum(1 for i, e in enumerate(one) if e[0] == "issue" and e[2] == "all_gather"
               and i < first_compute) == 3   # the root, block 0 (waited for), block 1 ahead
