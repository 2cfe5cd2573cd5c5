"""Activation checkpointing (`--activation-checkpointing`, `GPTConfig.activation_checkpointing`):
the same arithmetic with fewer saved activations, under every strategy's hooks.

References: the same model without checkpointing (torch's autograd), MemTracker's ACT bytes, and
zerolab's ledger of a run without checkpointing.
"""
from __future__ import annotations

import torch

from conftest import run_ranks


def _nano(ac: bool, T: int = 32):
    from zerolab.model import GPT, get_config
    torch.manual_seed(0)
    return GPT(get_config("nano", activation_checkpointing=ac, block_size=T))


def test_same_loss_and_gradients_fewer_activation_bytes():
    from torch.distributed._tools.mem_tracker import MemTracker
    x = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for ac in (False, True):
        model = _nano(ac)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss = model(x, x)
            loss.backward()
        act = sum(int(v) for stats in tracker.get_tracker_snapshot("peak").values()
                  for k, v in stats.items() if str(k).endswith("ACT"))
        out[ac] = loss.item(), [p.grad for p in model.parameters()], act
    assert out[True][0] == out[False][0]
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))
    # each block keeps only its input [B, T, C] fp32 instead of ~a dozen tensors of that size
    assert out[True][2] < out[False][2] / 2, (out[True][2], out[False][2])


def ac_worker(rank, n):
    from zerolab import STRATEGIES
    from zerolab.comm import Comm
    from zerolab.data import rank_slice
    result = {}
    for stage in (2, 3):
        for ac in (False, True):
            comm = Comm()
            strategy = STRATEGIES[stage](_nano(ac).to(torch.bfloat16), comm, max_grad_norm=1.0,
                                         lr=1e-3, weight_decay=0.1)
            losses = []
            for step in range(2):
                comm.step = step
                g = torch.Generator().manual_seed(step)
                x = torch.randint(0, 256, (4, 32), generator=g)
                loss = strategy.forward(rank_slice(x, rank, n), rank_slice(x, rank, n))
                strategy.backward(loss)
                strategy.step()
                losses.append(loss.item())
            ledger = [(r.phase, r.op, r.unit, r.numel) for r in comm.records]
            result[stage, ac] = losses, ledger, {k: v.clone() for k, v in strategy.full_parameters().items()}
    return result


def test_zero2_zero3_with_checkpointing_train_and_communicate_the_same():
    for res in run_ranks(ac_worker, 2, timeout=120):
        for stage in (2, 3):
            plain, ac = res[stage, False], res[stage, True]
            assert ac[0] == plain[0], (stage, ac[0], plain[0])          # losses, bit for bit
            assert ac[1] == plain[1], stage                             # same collectives, same order
            assert all(torch.equal(ac[2][k], plain[2][k]) for k in plain[2]), stage
