"""ZeRO-3's knobs, measured: prefetch depth 0 / 1 / 2 / all and keeping the root gathered change
neither the result (fp32: bit-identical parameters after two steps) nor the bytes moved, only
when gathers are issued and what is held: the meter's gathered-weights peak is root + (1 + depth)
blocks (all blocks for depth -1: in-flight gathers stack), and keep_root saves one root
all_gather per step at the price of holding the root between forward and backward."""
from __future__ import annotations

import torch
from conftest import global_batch, make_model, run_ranks

from zerolab.comm import Comm
from zerolab.memory import MemoryMeter
from zerolab.variants.compose import make_strategy

CONFIGS = [(0, False), (1, False), (2, False), (-1, False), (0, True)]


def _train(rank, world_size):
    comm, out = Comm(), {}
    for depth, keep_root in CONFIGS:
        model = make_model("nano4")
        meter = MemoryMeter()
        z = make_strategy(3, model, comm, prefetch=depth, keep_root=keep_root, meter=meter,
                          lr=1e-2)
        comm.records.clear()
        after_forward = []
        for step in range(2):
            comm.step = step
            x, y = global_batch(model, step, 4)
            xs, ys = x[rank::world_size], y[rank::world_size]
            loss = z.forward(xs, ys)
            meter.sample(z, "after forward")
            after_forward.append(meter.current["gathered_params"])
            z.backward(loss)
            z.step()
        sizes = {u.name: u.padded_numel * 4 for u in z.units}
        root_gathers = sum(r.op == "all_gather" and r.unit == "root" and r.step == 1
                           for r in comm.records)
        peak = meter.peak["gathered_params"]        # before full_parameters gathers everything
        out[depth, keep_root] = {"params": z.full_parameters(), "peak": peak,
                                 "sizes": sizes, "after_forward": after_forward[-1],
                                 "root_gathers": root_gathers,
                                 "bytes": comm.bytes_by_op(step=1)}
    return out


def test_prefetch_depth_and_keep_root():
    results = run_ranks(_train, 2, timeout=120)
    for res in results:
        base = res[0, False]
        root, block = base["sizes"]["root"], base["sizes"]["block.0"]
        n_blocks = len(base["sizes"]) - 1
        for (depth, keep_root), r in res.items():
            for name, p in base["params"].items():
                assert torch.equal(r["params"][name], p), (depth, keep_root, name)
            assert r["bytes"] == base["bytes"] or keep_root
            held = n_blocks if depth == -1 else min(1 + depth, n_blocks)
            assert r["peak"] == root + held * block, (depth, keep_root, r["peak"], root, block)
        assert base["root_gathers"] == 2 and base["after_forward"] == 0
        kept = res[0, True]
        assert kept["root_gathers"] == 1 and kept["after_forward"] == root
        saved = base["bytes"]["all_gather"] - kept["bytes"]["all_gather"]
        assert saved == root / 2            # one all_gather of the root: (n-1)/n · S at n = 2
