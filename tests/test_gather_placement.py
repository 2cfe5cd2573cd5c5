"""Where ZeRO-1/2 all_gather the updated weights: at the end of the step (gather="after_step", the
notes') or just before each unit's next forward, one unit ahead (gather="before_forward", FSDP's
SHARD_GRAD_OP). The same collectives, moved in time: the same parameters bit for bit (and so
single-process AdamW's), the same bytes in every step of the ledger, and in the ledger's order
each unit's gather after the step whose update it carries and before that unit's forward. Between
the step and the next forward the weights are not all here yet: reads refuse in one line, and
every reader of full weights (gathered(), full_parameters(), an eval forward, close(), a
checkpoint) gets the same values as after_step.
"""
from __future__ import annotations

import pytest
import torch

from conftest import global_batch, make_model, run_ranks
from zerolab import theory
from zerolab.course import testing

STEPS = 4
VARIANTS = [(1, "all_reduce"), (1, "reduce_scatter"), (2, None)]
MODES = ("after_step", "before_forward")
NANO = dict(model="nano", precision="fp32", grad_accum=1, rows_per_micro=2, max_norm=0.5)
# blocks.1 skipped by one rank's forward at some steps, parameters no rank uses (find_unused)
COND = dict(NANO, model="cond", find_unused=True, trigger=[[0], [], [3], [1, 2]])
BF16_ACCUM = dict(NANO, precision="bf16", grad_accum=2, rows_per_micro=1, lr=1e-3)


def _strategy(stage, grad_op, model, comm, job, gather, **kw):
    from zerolab.variants.compose import make_strategy
    kwargs = dict(max_grad_norm=job["max_norm"], lr=job.get("lr", testing.LR),
                  weight_decay=testing.WD, find_unused_parameters=job.get("find_unused", False),
                  gather=gather, **kw)
    if grad_op:
        kwargs["grad_op"] = grad_op
    return make_strategy(stage, model, comm, **kwargs)


def train(s, model, job, rank, n, steps, start=0, marks=None, meter=None):
    """testing.train_job's loop from step `start` (ZeRO-2 reduces every micro-step, as the course
    does); `marks` gets (step, "end", ledger length) after each step; `meter` samples each step
    from its start, as `zerolab train` does. (losses, norms)."""
    A, per = job["grad_accum"], job["rows_per_micro"]
    losses, norms = [], []
    for step in range(start, start + steps):
        s.comm.step = step
        if meter is not None:
            meter.reset_peaks()
            meter.sample(s, "step start")
        x, y = global_batch(model, step, n * A * per, trigger=testing.trigger(job, step))
        local = 0.0
        for micro in range(A):
            rows = slice((rank * A + micro) * per, (rank * A + micro + 1) * per)
            loss = s.forward(x[rows], y[rows])
            s.backward(loss / A, sync=micro == A - 1 or s.stage >= 2)
            local += loss.item() / A
        losses.append(local)
        norms.append(float(s.step()))
        if marks is not None:
            marks.append((step, "end", len(s.comm.records)))
    return losses, norms


def train_worker(rank, n, jobs):
    """Per job, variant and mode: losses, norms, final parameters, the ledger (params and grads)
    and the ledger's length when each step ended and when each unit's forward began (forward
    pre-hooks registered after the strategy's: the model's for the root unit)."""
    from zerolab.comm import Comm
    from zerolab.memory import MemoryMeter
    out = []
    for job in jobs:
        results = {}
        for stage, grad_op in VARIANTS:
            for gather in MODES:
                model = make_model(job["model"]).to(testing.DTYPES[job["precision"]])
                comm, meter = Comm(), MemoryMeter()
                s = _strategy(stage, grad_op, model, comm, job, gather, meter=meter)
                marks = []                  # (step, "end" | unit name, len(comm.records))
                for u in s.units:
                    for m in u.modules[:1] or [model]:
                        m.register_forward_pre_hook(
                            lambda *_, u=u: marks.append((comm.step, u.name, len(comm.records))))
                losses, norms = train(s, model, job, rank, n, STEPS, marks=marks, meter=meter)
                memory = {"current": dict(meter.current), "step": meter.peak_by_phase["step"]}
                params = s.full_parameters()        # completes the last step's gathers
                results[(stage, grad_op, gather)] = {
                    "losses": losses, "norms": norms, "params": params, "marks": marks,
                    "memory": memory,
                    "units": [u.name for u in s.units],
                    "records": [(r.step, r.phase, r.op, r.what, r.unit, r.seq)
                                for r in comm.records if r.what in ("grads", "params")],
                    "bytes": [comm.bytes_by_op(step=k) for k in range(STEPS)],
                    "psi": sum(u.padded_numel for u in s.units)}
                s.close()
        out.append(results)
    return out


@pytest.fixture(scope="module")
def runs():
    """2 ranks: GPT nano fp32, the toy with skipped blocks, GPT nano bf16 with 2 micro-steps."""
    jobs = [NANO, COND, BF16_ACCUM]
    return dict(zip(("nano", "cond", "bf16"), zip(*run_ranks(train_worker, 2, jobs))))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["nano", "cond", "bf16"])
def test_before_forward_trains_bit_identically_to_after_step(runs, name):
    for rank, r in enumerate(runs[name]):
        for stage, grad_op in VARIANTS:
            a, b = r[(stage, grad_op, "after_step")], r[(stage, grad_op, "before_forward")]
            assert a["losses"] == b["losses"] and a["norms"] == b["norms"], (stage, grad_op, rank)
            for k in a["params"]:
                assert torch.equal(a["params"][k], b["params"][k]), (stage, grad_op, rank, k)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,job", [("nano", NANO), ("cond", COND)])
def test_both_modes_match_single_process_adamw(runs, name, job):
    ref = testing.reference(job, 2, STEPS)
    for rank, r in enumerate(runs[name]):
        for variant in r:
            assert r[variant]["norms"] == pytest.approx(ref["norms"], rel=2e-6), (variant, rank)
            assert testing.max_param_diff(r[variant]["params"], ref["params"]) <= 1e-6, variant


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,job", [("nano", NANO), ("cond", COND), ("bf16", BF16_ACCUM)])
def test_every_step_moves_the_same_bytes_as_the_formula(runs, name, job):
    for rank, r in enumerate(runs[name]):
        for (stage, grad_op, gather), v in r.items():
            expect = theory.traffic_bytes(v["psi"], 2, stage, job["precision"], grad_op or
                                          "all_reduce", grad_accum=job["grad_accum"])
            for step in range(STEPS):
                got = v["bytes"][step]
                assert got["broadcast"] == 0
                assert {op: got[op] for op in expect} == pytest.approx(expect, rel=1e-12), \
                    (stage, grad_op, gather, rank, step)
            assert v["bytes"] == r[(stage, grad_op, "after_step")]["bytes"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,job", [("nano", NANO), ("bf16", BF16_ACCUM)])
def test_both_modes_hold_the_formulas_bytes_after_and_during_the_step(runs, name, job):
    """The full bf16 weights stay resident in both modes: model states after the step and the
    peak inside it equal `theory` (tests/test_measure.py's figures) in both."""
    for r in runs[name]:
        for (stage, grad_op, gather), v in r.items():
            held = theory.model_state_bytes(v["psi"], 2, stage, job["precision"])
            assert {k: v["memory"]["current"][k] for k in held} == held, (stage, grad_op, gather)
            assert v["memory"]["step"] == theory.peak_step_bytes(v["psi"], 2, stage,
                                                                 job["precision"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["nano", "cond", "bf16"])
def test_each_gather_is_issued_after_its_step_and_before_its_units_forward(runs, name):
    for r in runs[name]:
        for (stage, grad_op, gather), v in r.items():
            gathers = {(rec[0], rec[4]): rec for rec in v["records"] if rec[2] == "all_gather"}
            units = v["units"]
            assert sorted(gathers) == sorted((k, u) for k in range(STEPS) for u in units)
            end = {step: at for step, what, at in v["marks"] if what == "end"}
            if gather == "after_step":      # the notes: the step gathers every unit at its end
                assert all(rec[1] == "step" and rec[5] < end[rec[0]] for rec in gathers.values())
                continue
            # the first forward of each unit in each step (micro-steps run it again)
            fwd = {}
            for step, what, at in v["marks"]:
                if what != "end":
                    fwd.setdefault((step, what), at)
            for step in range(STEPS - 1):   # step k's update, gathered in step k + 1's forward
                seqs = [gathers[step, u][5] for u in units]
                assert seqs == sorted(seqs), "issued in unit order"
                for i, u in enumerate(units):
                    rec = gathers[step, u]
                    assert rec[1] == "forward" and rec[5] >= end[step], (step, u, rec)
                    if (step + 1, u) in fwd:        # (a block the rank skipped has no forward)
                        assert rec[5] < fwd[step + 1, u], (step, u)
                    # one unit ahead: issued before the unit before it computes (so the two
                    # overlap), not before the one before that started
                    if i >= 1 and (step + 1, units[i - 1]) in fwd:
                        assert rec[5] < fwd[step + 1, units[i - 1]], (step, u)
                    if i >= 2 and (step + 1, units[i - 2]) in fwd:
                        assert rec[5] >= fwd[step + 1, units[i - 2]], (step, u)
            last = [gathers[STEPS - 1, u] for u in units]      # completed by full_parameters()
            assert all(rec[1] == "eval" and rec[5] >= end[STEPS - 1] for rec in last)


def readers_worker(rank, n, folder):
    """ZeRO-1 and ZeRO-2, both modes, 2 steps, then each reader between the step and the next
    forward: what it returns, or the error it raises, and a checkpoint saved there, loaded into
    a new strategy that trains one more step; then `p.data = t` between a step and the next
    forward, a step, and close()."""
    from zerolab.comm import Comm
    from zerolab.loop.guards import ShardedValues
    from zerolab.run import checkpoint
    out = {}
    for stage in (1, 2):
        for gather in MODES:
            model = make_model("nano")
            s = _strategy(stage, None, model, Comm(), NANO, gather)
            train(s, model, NANO, rank, n, 2)
            r = out[stage, gather] = {}
            saved = checkpoint.save(s, model, f"{folder}/{stage}{gather}", 2, {"losses": []})
            other = make_model("nano")
            t = _strategy(stage, None, other, Comm(), NANO, gather)
            checkpoint.load(t, other, checkpoint.open_checkpoint(saved), torch.float32)
            train(t, other, NANO, rank, n, 1, start=2)
            r["resumed"] = t.full_parameters()
            t.close()
            try:
                r["read"] = model.wte.weight.sum().item()
            except ShardedValues as err:
                r["read"] = str(err)
            try:
                r["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
            except ShardedValues as err:
                r["state_dict"] = str(err)
            r["shard"] = {u: {k: t.clone() for k, t in d.items()} for u, d in s.shard_state().items()}
            with s.gathered():
                r["gathered"] = {k: v.clone() for k, v in model.state_dict().items()}
            x, y = global_batch(model, 5, 2 * n)
            with torch.no_grad():
                r["eval"] = s.forward(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2]).item()
            train(s, model, NANO, rank, n, 1, start=2)
            r["continued"] = s.full_parameters()
            model.wpe.weight.data = torch.full_like(model.wpe.weight, 0.01)
            r["after_edit"] = train(s, model, NANO, rank, n, 1, start=3)[0]
            s.close()
            r["closed"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.timeout(120)
def test_readers_between_step_and_forward_get_full_weights_or_one_line(tmp_path):
    for out in run_ranks(readers_worker, 2, str(tmp_path)):
        for stage in (1, 2):
            a, b = out[stage, "after_step"], out[stage, "before_forward"]
            # a plain read and state_dict() refuse, naming the way out (never stale values)
            for what in ("read", "state_dict"):
                assert isinstance(b[what], str) and "gathered()" in b[what], (stage, what)
                assert "\n" not in b[what] and f"ZeRO-{stage}" in b[what]
            assert isinstance(a["read"], float)
            # this rank's range (a checkpoint), gathered(), an eval forward: the same values
            for u in a["shard"]:
                for k in a["shard"][u]:
                    assert torch.equal(a["shard"][u][k], b["shard"][u][k]), (stage, u, k)
            for k in a["gathered"]:
                assert torch.equal(a["gathered"][k], b["gathered"][k]), (stage, k)
            assert a["eval"] == b["eval"]
            # a checkpoint saved between the step and its gathers resumes bit-identically
            for k in a["continued"]:
                assert torch.equal(a["continued"][k], b["continued"][k]), (stage, k)
                for v in (a, b):
                    assert torch.equal(v["resumed"][k], v["continued"][k]), (stage, k)
            # `p.data = t` between a step and the next forward: t is used and kept, as after_step
            assert a["after_edit"] == b["after_edit"]
            for k in a["closed"]:           # close() leaves the model its full trained weights
                assert torch.equal(a["closed"][k], b["closed"][k]), (stage, k)


def test_unknown_gather_mode_is_refused():
    """A bad mode is one line naming the accepted ones; the lesson's classes take no variant's
    option at all and say where it goes (zerolab.variants.compose), before anything is built."""
    from zerolab import ZeRO1, ZeRO2
    from zerolab.variants.compose import make_strategy
    for stage, cls in ((1, ZeRO1), (2, ZeRO2)):
        with pytest.raises(ValueError, match="before_forward"):
            make_strategy(stage, torch.nn.Linear(2, 2), None, gather="later")
        with pytest.raises(TypeError, match="compose.make_strategy"):
            cls(torch.nn.Linear(2, 2), comm=None, gather="before_forward")
    with pytest.raises(ValueError, match="ZeRO-1 and ZeRO-2's"):
        make_strategy(3, torch.nn.Linear(2, 2), None, gather="before_forward")


def test_the_option_reaches_the_strategy_from_every_door():
    """--zero12-gather (nb.launch's zero12_gather=) is parsed, checked, passed on to the ranks and
    given to ZeRO-1 / ZeRO-2 by run/stage.py; its default is placement.DEFAULT_GATHER."""
    import types

    from zerolab.variants.placement import DEFAULT_GATHER
    from zerolab.run import options, stage

    assert options.parse("ranks", []).zero12_gather == DEFAULT_GATHER
    assert options.parse("train", ["--zero12-gather", "before_forward"]).zero12_gather == \
        "before_forward"
    with pytest.raises(ValueError, match="zero12-gather"):
        options.parse("ranks", ["--zero12-gather", "later"])
    argv = options.argv_for("ranks", zero12_gather="before_forward")
    assert argv == ["--zero12-gather", "before_forward"]
    args = options.parse("train", ["--zero12-gather", "before_forward", "--stage", "2"])
    assert "--zero12-gather" in options.rank_argv(args)
    comm = types.SimpleNamespace(world_size=1, rank=0)       # one rank: no collective at setup
    for st in (1, 2):
        s = stage.make_strategy(st, make_model("nano"), comm, args, None)
        assert s.gather == "before_forward" and s.deferred is not None
        s.close()
    args.zero12_gather = None                               # an older args object: the default
    assert stage.make_strategy(2, make_model("nano"), comm, args, None).gather == DEFAULT_GATHER
