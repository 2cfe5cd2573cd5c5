"""Optimizers that keep parameters replicated refuse ranks whose weights differ, in one line on
every rank, at construction (`zerolab.loop.replicas`): the Muon layouts and ZeroRedundancyOptimizer
without DDP after `torch.manual_seed(rank)` (the issue's slip, on a small conv + MLP + LayerNorm
model), and one made up here: the same layouts with LAMB as the whole-matrix optimizer, where
only one bias differs between the ranks. The ranks' weights really differ (checked here with
torch.distributed.all_gather alone); with one seed nothing is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import run_ranks


class ConvMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.conv(x).mean(-1)
        return self.head(self.norm(h + self.mlp(h)))


def build(kind, model):
    from zerolab.variants.compose import make_muon
    from zerolab.wholematrix.lamb import Lamb as LAMB
    from zerolab.torchlike import ZeroRedundancyOptimizer
    from zerolab.wholematrix.wholeopt import muon_param_groups
    if kind == "zero-optimizer":
        return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    layout, _, inner = kind.partition("-")
    if inner == "lamb":
        return make_muon(list(model.parameters()), layout, optimizer_class=LAMB, lr=1e-3)
    return make_muon(muon_param_groups(model), layout)


def worker(rank, n, kind, seeding):
    import torch.distributed as dist
    torch.manual_seed(rank if seeding == "rank" else 0)
    model = ConvMLP()
    if seeding == "one-bias":
        with torch.no_grad():
            model.head.bias[0] += rank
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(every, flat)
    apart = max(float((e - flat).abs().max()) for e in every)
    try:
        build(kind, model)
        return {"apart": apart}
    except ValueError as e:
        return {"apart": apart, "error": str(e)}


KINDS = ["owner", "a2a", "replicate", "zero-optimizer", "owner-lamb", "replicate-lamb"]


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_apart_are_refused_in_one_line_on_every_rank(kind):
    seeding = "one-bias" if kind.endswith("lamb") else "rank"
    said = run_ranks(worker, 2, kind, seeding, timeout=90)
    assert all(r["apart"] > 0 for r in said), said          # the premise: they differ
    lines = {r.get("error") for r in said}
    assert len(lines) == 1 and None not in lines, said
    line = lines.pop()
    assert "\n" not in line and "different values" in line and "torch.manual_seed(0)" in line
    assert "broadcast(p.data, 0)" in line, line


@pytest.mark.parametrize("kind", ["a2a", "zero-optimizer"])
def test_one_seed_is_accepted(kind):
    said = run_ranks(worker, 2, kind, "same", timeout=90)
    assert all(r["apart"] == 0 and "error" not in r for r in said), said

