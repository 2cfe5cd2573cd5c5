"""Collectives in a rank-dependent order: exact when the varying blocks are one unit, else stopped
on every rank within seconds, in one line - never a hang.

The model is a small mixture of experts: a router picks one of three experts per token, and the
layer runs its experts busiest first, so each rank calls them in the order of its own tokens
(DeepSpeed#4808). With each expert a unit of its own, ZeRO-3's all_gathers come in a different
order on each rank (before zerolab.loop.order, a hang until the group's timeout). With the MoE layer a
leaf (`zerolab.set_leaf_modules`, DeepSpeed's set_z3_leaf_modules) it is one unit and every stage
ends within fp32 rounding of one process running torch alone. A second member of the kind, made
up here: a loop that reads the weights on rank 0 only (`with strategy.gathered():` under
`if rank == 0`, as logging code does) - all_gathers issued on one rank only.
"""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_ranks
from zerolab.course.testing import BETAS, EPS, LR, WD, max_param_diff
from zerolab.sharding import decays

VOCAB, DIM, EXPERTS, ROWS, T, STEPS = 32, 16, 3, 2, 8, 2


class MoE(nn.Module):
    """Top-1 routing; experts run busiest first (the order depends on this rank's tokens)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
                                     for _ in range(EXPERTS))

    def forward(self, h):
        flat = h.reshape(-1, DIM)
        probs = F.softmax(self.router(flat), dim=-1)
        choice = probs.argmax(-1)
        counts = torch.bincount(choice, minlength=EXPERTS).tolist()
        out = torch.zeros_like(flat)
        for e in sorted(range(EXPERTS), key=lambda e: (-counts[e], e)):
            idx = (choice == e).nonzero().squeeze(-1)
            if idx.numel():
                out = out.index_add(0, idx, self.experts[e](flat[idx]) * probs[idx, e:e + 1])
        return h + out.reshape(h.shape)


class MoEToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, VOCAB)

    def zero_units(self):                   # each expert a unit: what set_leaf_modules undoes
        return [("router", self.moe.router)] + [
            (f"expert.{i}", e) for i, e in enumerate(self.moe.experts)]

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.moe(self.emb(x))).flatten(0, 1), y.reshape(-1))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (ROWS, T), generator=g)
    return x, torch.roll(x, 1, dims=1)


def expert_orders(model, rank, step=0) -> list:
    """The order in which rank `rank`'s tokens call the experts (to check the test's premise)."""
    with torch.no_grad():
        flat = model.emb(batch(step, rank)[0]).reshape(-1, DIM)
        counts = torch.bincount(model.moe.router(flat).argmax(-1), minlength=EXPERTS).tolist()
    return sorted(range(EXPERTS), key=lambda e: (-counts[e], e))


CASES = {   # name: (stage, leaf, rank 0 reads the weights alone before step 1)
    "zero3-per-expert": (3, False, False), "zero3-leaf": (3, True, False),
    "zero2-per-expert": (2, False, False), "ddp-per-expert": (0, False, False),
    "zero3-leaf-rank0-reads": (3, True, True), "zero3-rank-order": (3, False, False),
}


def rank_order_worker(rank, n):
    """test_loops' LoopToy, its blocks called (0, 1, 2) on rank 0 and (1, 0, 2) on rank 1."""
    from test_loops import LoopToy

    from zerolab import make_strategy
    from zerolab.comm import Comm
    torch.manual_seed(0)
    model = LoopToy()
    s = make_strategy(3, model, Comm(), lr=LR, weight_decay=WD)
    x = torch.randint(0, model.vocab, (2, 4))
    t0 = time.perf_counter()
    try:
        s.backward(model(x, x, order=(0, 1, 2) if rank == 0 else (1, 0, 2)))
        s.step()
        return {"params": s.full_parameters()}
    except RuntimeError as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0}


def worker(rank, n, case):
    from zerolab import make_strategy, set_leaf_modules
    from zerolab.comm import Comm
    stage, leaf, rank0_reads = CASES[case]
    torch.manual_seed(0)
    model = MoEToy()
    if leaf:
        set_leaf_modules(model, [MoE])
    s = make_strategy(stage, model, Comm(), lr=LR, weight_decay=WD, find_unused_parameters=True)
    t0 = time.perf_counter()
    try:
        for step in range(STEPS):
            if rank0_reads and step == 1 and rank == 0:
                with s.gathered():
                    float(model.head.weight.sum())
            s.backward(s.forward(*batch(step, rank)))
            s.step()
        return {"params": s.full_parameters(), "units": [u.name for u in s.units]}
    except RuntimeError as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0}


def fsdp_worker(rank, n, per_expert):
    """torchlike.fully_shard: each expert sharded on its own (per_expert), or the MoE layer as
    one, then the root; the loop steps torch's AdamW on the shards."""
    from zerolab.torchlike import fully_shard
    torch.manual_seed(0)
    model = MoEToy()
    for m in (list(model.moe.experts) if per_expert else [model.moe]):
        fully_shard(m)
    fully_shard(model)
    opt = torch_adamw(model)
    t0 = time.perf_counter()
    try:
        for step in range(STEPS):
            model(*batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        return {"params": {k: v.detach().float() for k, v in model.full_state_dict().items()}}
    except RuntimeError as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0}


def test_fully_shard_of_the_moe_layer_is_exact_and_of_each_expert_is_stopped_in_one_line():
    ref = reference(2)
    for rank, r in enumerate(run_ranks(fsdp_worker, 2, False, timeout=120)):
        assert "error" not in r, (rank, r)
        assert max_param_diff(r["params"], ref) <= 1e-6, rank
    for rank, r in enumerate(run_ranks(fsdp_worker, 2, True, timeout=120)):
        e = r.get("error")
        assert e and e.startswith("CollectiveOrderError") and "\n" not in e, (rank, r)
        assert "shard their parent only" in e and r["after_s"] < 15, (rank, r)


def torch_adamw(model):
    """torch's AdamW with the strategies' groups: weight decay WD on 2-D weights only
    (`sharding.decays`), the run's lr, betas and eps."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if decays(p)], "weight_decay": WD},
                              {"params": [p for p in params if not decays(p)],
                               "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS)


def reference(n) -> dict:
    torch.manual_seed(0)
    model = MoEToy()
    opt = torch_adamw(model)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        sum(model(*batch(step, r)) / n for r in range(n)).backward()
        opt.step()
    return {k: v.detach().float() for k, v in model.named_parameters()}


def test_the_ranks_really_call_the_experts_in_different_orders():
    torch.manual_seed(0)
    model = MoEToy()
    assert expert_orders(model, 0) != expert_orders(model, 1)


@pytest.mark.parametrize("case", ["zero3-leaf", "zero2-per-expert", "ddp-per-expert"])
def test_rank_dependent_expert_order_is_exact_when_the_order_cannot_reach_the_collectives(case):
    results = run_ranks(worker, 2, case, timeout=120)
    ref = reference(2)
    for rank, r in enumerate(results):
        assert "error" not in r, (case, rank, r)
        assert max_param_diff(r["params"], ref) <= 1e-6, (case, rank)
    if CASES[case][1]:                      # the leaf: router and experts are one unit
        assert [u for u in results[0]["units"] if u != "root"] == ["moe"], results[0]["units"]


@pytest.mark.parametrize("case", ["zero3-per-expert", "zero3-leaf-rank0-reads",
                                  "zero3-rank-order"])
def test_collectives_in_a_rank_dependent_order_stop_every_rank_in_one_line_within_seconds(case):
    results = (run_ranks(rank_order_worker, 2, timeout=120) if case == "zero3-rank-order"
               else run_ranks(worker, 2, case, timeout=120))
    for rank, r in enumerate(results):
        e = r.get("error")
        assert e and e.startswith("CollectiveOrderError"), (case, rank, r)
        assert "\n" not in e and "every rank" in e, e
        fix = "enter it on every rank" if case.endswith("reads") else "set_leaf_modules"
        assert fix in e, e          # the advice the loop can follow
        assert r["after_s"] < 15, (case, rank, r["after_s"])
    if case == "zero3-per-expert":          # it names the experts it found out of step,
        assert any("expert." in r["error"] for r in results), results   # and their layer
        assert all("set_leaf_modules(model, [MoE])" in r["error"] for r in results), results
    if case == "zero3-rank-order":
        assert any("block." in r["error"] for r in results), results
    print(case, [(round(r["after_s"], 2), r["error"]) for r in results])


# --- uneven micro-steps: a rank skips a micro-batch the others run -------------------------------
# ZeRO-3 gathers weights in every forward, so a rank that skips its last micro-batch (its forward
# raised, torchtitan#1329, and it calls strategy.sync_grads() as the no_final_sync refusal advises)
# issues reduce_scatters where the others gather: stopped, naming the forward passes each ran and a
# way out that ZeRO-3 can take (the batch with its loss times 0). A second member, made up: DDP
# reducing every micro-step (sync=True), one rank with an extra micro-batch.
MICRO = 3
UNEVEN = {  # name: (stage, what the odd rank does)
    "zero3-skip-last": (3, "skip"), "zero3-loss-times-0": (3, "times0"),
    "ddp-extra-micro": (0, "extra"),
}


def uneven_worker(rank, n, case):
    from zerolab import make_strategy, set_leaf_modules
    from zerolab.comm import Comm
    stage, odd = UNEVEN[case]
    torch.manual_seed(0)
    model = MoEToy()
    set_leaf_modules(model, [MoE])
    s = make_strategy(stage, model, Comm(), lr=LR, weight_decay=WD, find_unused_parameters=True)
    t0 = time.perf_counter()
    try:
        for step in range(STEPS):
            micro = MICRO + (odd == "extra" and rank == 0 and step == 0)
            for m in range(micro):
                last = m == micro - 1
                x, y = batch(10 * step + m, rank)
                if odd != "extra" and rank == 1 and step == 0 and last:
                    if odd == "skip":           # the forward raised: no backward for it
                        s.sync_grads()
                        continue
                    x, y = batch(10 * step + m - 1, rank)   # a batch it has, weighed 0
                    s.backward(s.forward(x, y) * 0, sync=True)
                    continue
                s.backward(s.forward(x, y) / MICRO, sync=last or stage == 0)
            s.step()
        return {"params": s.full_parameters()}
    except RuntimeError as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0}


def uneven_reference(n) -> dict:
    """One process: each step's gradient is the sum over the batches that ran of loss / MICRO,
    averaged over the n ranks (rank 1's last micro-batch of step 0 is skipped)."""
    torch.manual_seed(0)
    model = MoEToy()
    opt = torch_adamw(model)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ran = [(r, m) for r in range(n) for m in range(MICRO)
               if not (r == 1 and step == 0 and m == MICRO - 1)]
        sum(model(*batch(10 * step + m, r)) / MICRO / n for r, m in ran).backward()
        opt.step()
    return {k: v.detach().float() for k, v in model.named_parameters()}


def test_uneven_micro_steps_stop_in_one_line_naming_them_and_the_advice_is_exact():
    for case in ("zero3-skip-last", "ddp-extra-micro"):
        results = run_ranks(uneven_worker, 2, case, timeout=120)
        for rank, r in enumerate(results):
            e = r.get("error")
            assert e and e.startswith("CollectiveOrderError") and "\n" not in e, (case, rank, r)
            assert "forward passes in optimizer step 1" in e and "loss times 0" in e, e
            assert "set_leaf_modules" not in e and r["after_s"] < 15, (case, rank, r)
        counts = {(MICRO, MICRO - 1), (MICRO + 1, MICRO)}   # as far as each rank got
        said = [tuple(int(w) for w in re.findall(r"ran (\d+) forward passes in optimizer step 1, "
                                                  r"rank \d (\d+)", r["error"])[0])
                for r in results]
        assert all(tuple(sorted(p, reverse=True)) in counts for p in said), (case, said)
    ref = uneven_reference(2)                   # the advice, followed: exact
    for rank, r in enumerate(run_ranks(uneven_worker, 2, "zero3-loss-times-0", timeout=120)):
        assert "error" not in r, (rank, r)
        assert max_param_diff(r["params"], ref) <= 1e-6, rank


def test_the_leaf_advice_names_the_layer_that_holds_the_blocks():
    from zerolab.loop.leaves import holders
    from zerolab.loop.order import message
    torch.manual_seed(0)
    model = MoEToy()

    class Unit:                                 # what holders reads of a unit
        def __init__(self, name, module):
            self.name, self.modules = name, [module]
    units = [Unit(f"expert.{i}", e) for i, e in enumerate(model.moe.experts)]
    parents = holders(model, units)
    assert parents == {f"expert.{i}": "MoE" for i in range(EXPERTS)}, parents
    a = [5, "all_gather", "params", "expert.0", 272, "forward"]
    b = [5, "all_gather", "params", "expert.2", 272, "forward"]
    said = message(0, a, 1, b, None, parents)
    assert "set_leaf_modules(model, [MoE])" in said and "find_unused_parameters=True" in said


def _leaf_shard_worker(rank, n):
    from zerolab import set_leaf_modules
    from zerolab.torchlike import fully_shard
    torch.manual_seed(0)
    model = MoEToy()
    set_leaf_modules(model, [MoE])
    for e in model.moe.experts:
        fully_shard(e)
    try:
        fully_shard(model)
    except ValueError as e:
        return str(e)


def test_fully_shard_inside_a_leaf_is_refused_in_one_line_naming_the_leaf():
    """set_leaf_modules(model, [MoE]) then fully_shard on each expert (the leaf ignored, before):
    refused when the root is sharded, naming the experts and the layer to shard instead."""
    for said in run_ranks(_leaf_shard_worker, 2, timeout=120):
        assert said and "\n" not in said, said
        assert "experts.0" in said and "fully_shard on the MoE itself" in said, said
