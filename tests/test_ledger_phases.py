"""Every collective of a run is in the ledger with the phase it runs in, however the loop calls
the model.

A loop that calls `model(x, y)` itself - not `strategy.forward` - used to leave ZeRO-3's forward
all_gathers (and ZeRO-1/2's gather-before-forward all_gathers) under "setup", the phase of the
constructor. The frame now sets the phase when the model's forward begins (forward, or eval
under torch.no_grad()); the used-parameters all_reduce of find_unused_parameters is the step's
(where step() asks for it; the torch-shaped wrappers ask at the end of backward:
tests/test_torchlike*). The reference is the
loop itself: which calls it made, in which context.
"""
from __future__ import annotations

import torch

from conftest import global_batch, make_model, run_ranks

VARIANTS = {"zero3": (3, {}), "zero2-before-forward": (2, {"gather": "before_forward"}),
            "ddp-unused": (0, {"find_unused_parameters": True}),
            "zero3-unused": (3, {"find_unused_parameters": True})}


def worker(rank, n):
    from zerolab import make_strategy
    from zerolab.comm import Comm
    out = {}
    for name, (stage, kw) in VARIANTS.items():
        model = make_model("nano")
        comm = Comm()
        s = make_strategy(stage, model, comm, **kw)
        built = len(comm.records)
        phases = []                         # (phase the loop was in, records it issued)
        for step in range(2):
            comm.step = step
            x, y = global_batch(model, step, 2 * n)
            start = len(comm.records)
            loss = model(x[rank::n], y[rank::n])            # the loop calls the model itself
            phases.append(("forward", comm.records[start:]))
            start = len(comm.records)
            s.backward(loss)
            phases.append(("backward", comm.records[start:]))
            start = len(comm.records)
            s.step()
            phases.append(("step", comm.records[start:]))
            start = len(comm.records)
            with torch.no_grad():
                model(x[rank::n], y[rank::n])
            phases.append(("eval", comm.records[start:]))
        out[name] = {"setup": sorted({r.phase for r in comm.records[:built]}),
                     "calls": [(want, sorted({r.phase for r in recs}), len(recs))
                               for want, recs in phases],
                     "after_build": comm.current_phase,
                     "used_params": sorted({r.phase for r in comm.records
                                            if r.unit == "used_params"})}
        s.close()
    return out


def test_every_collective_is_recorded_in_the_phase_the_loop_was_in():
    results = run_ranks(worker, 2, timeout=120)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["setup"] == ["setup"], (name, r)
            assert r["after_build"] == "setup", (name, r)   # the frame restores it
            for want, got, count in r["calls"]:
                assert got in ([], [want]), (rank, name, want, got)
            issued = {want for want, got, count in r["calls"] if count}
            # not vacuous: ZeRO-3 gathers in every forward, with grad and without; ZeRO-2's
            # deferred all_gather runs in the first forward after a step (here the eval one);
            # find_unused_parameters' flags are all_reduced where step() needs them
            must = {"zero3": {"forward", "eval"}, "zero2-before-forward": {"eval"},
                    "ddp-unused": {"step"}, "zero3-unused": {"forward", "step"}}[name]
            assert must <= issued, (rank, name, issued)
    units = {n: r["used_params"] for n, r in results[0].items()}
    assert units["ddp-unused"] == units["zero3-unused"] == ["step"], units
