"""Blocks called out of their registration order under ZeRO-3 (a ModuleDict read in another
order): what it costs is measured and said. ZeRO-3 gathers blocks in registration order; a
block whose turn is skipped is gathered (or prefetched) and freed anyway, so every rank issues
the same all_gathers, and gathered again when it is called. The forward's all_gathers are
counted in the ledger of the same loop run in order and out of order; the one-time notice must
name exactly the difference. The issue's example runs on fully_shard (a ModuleDict of blocks
read c, a, b); a second member, made up: zerolab's ZeRO-3 strategy with a ModuleList's blocks
called in reverse."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_ranks

KEYS = ("a", "b", "c")


class DictToy(nn.Module):
    def __init__(self, container="dict"):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        layers = [nn.Linear(8, 8) for _ in KEYS]
        self.blocks = (nn.ModuleDict(dict(zip(KEYS, layers))) if container == "dict"
                       else nn.ModuleList(layers))
        self.head = nn.Linear(8, 16)

    def forward(self, x, y, order=KEYS):
        h = self.emb(x)
        for k in order:
            h = h + torch.tanh(self.blocks[k](h))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.reshape(-1))


def worker(rank, n, container, order):
    """container "dict": each block given to fully_shard, then the model (torch's AdamW steps
    the shards); "list": zerolab's ZeRO-3 strategy with each block a unit (zero_units)."""
    torch.manual_seed(0)
    model = DictToy(container)
    x = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(rank))
    if container == "dict":
        from zerolab.torchlike import fully_shard
        for b in model.blocks.values():
            fully_shard(b)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        comm = model.comm

        def step():
            model(x, x, order=order).backward()
            opt.step()
            opt.zero_grad()
    else:
        from zerolab import make_strategy
        from zerolab.comm import Comm
        model.zero_units = lambda: [(f"block.{i}", b) for i, b in enumerate(model.blocks)]
        s = make_strategy(3, model, Comm(), lr=1e-3)
        comm = s.comm

        def step():
            s.backward(model(x, x, order=order))
            s.step()
    gathers = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            k0 = len(comm.records)
            step()
            gathers.append(sum(r.op == "all_gather" and r.what == "params" and r.phase == "forward"
                               for r in comm.records[k0:]))
    said = [str(w.message) for w in caught if "registration order" in str(w.message)]
    return {"gathers": gathers, "said": said}


@pytest.mark.parametrize("container,order", [("dict", ("c", "a", "b")), ("list", (2, 1, 0))])
def test_out_of_order_blocks_cost_the_gathers_the_notice_says(container, order):
    in_order = run_ranks(worker, 2, container, KEYS if container == "dict" else (0, 1, 2),
                         timeout=90)
    out = run_ranks(worker, 2, container, order, timeout=90)
    base = in_order[0]["gathers"][-1]
    for r in out:
        extra = r["gathers"][0] - base              # measured: the ledger of the same loop
        assert extra > 0, (r["gathers"], base)
        assert len(r["said"]) == 1 and "\n" not in r["said"][0], r["said"]
        assert f": {extra} extra all_gather(s) in this forward" in r["said"][0], r["said"]
    assert not any(r["said"] for r in in_order)
    print(container, order, "forward all_gathers per step:", base, "in order,",
          out[0]["gathers"][-1], "out of order")


