"""Distributed Muon's three layouts (zerolab/wholematrix/muon_owner.py, muon_a2a.py, muon_replicate.py) step
like one process with torch's own optimizers, and move exactly the bytes of zerolab.wholematrix.muon_theory.

Independent references: single-process torch.optim.Muon (+ torch.optim.AdamW for embeddings,
the head, norms and biases, as torch's Muon docs recommend), torch.optim.Adafactor and
zerolab.wholematrix.lamb.Lamb, stepped with the average over ranks of the ranks' own gradients (each rank's
rows run through the same model in this process); torch's ZeroRedundancyOptimizer's own
partition (owners); the byte formulas checked by hand below. Models: the course's GPT (nano) and
a conv + MLP with tall, wide and odd-sized matrices (not the course's). 2 gloo ranks, one launch.

Tolerance: none. With 2 ranks the ranks' sum is one addition (g0 + g1, the reference's), so the
averaged gradients are bit-identical, and every layout runs torch's own arithmetic on them in
torch's order (a2a: torch's Muon leaves O in a zero tensor, each rank applies torch's
mul_ / add_(alpha) to its rows): equal to the last bit, asserted. It has to be: Muon's
Newton-Schulz runs in bf16, so one fp32 ulp of a weight can flip a bf16 rounding and grow to
~1e-3 in 3 steps (measured with a p·(1 - lr·wd) + (-lr'·O) variant of a2a).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import case_results, global_batch, make_model, run_ranks
from zerolab.wholematrix import muon_theory as mt

STEPS, N = 3, 2
MUON = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=3e-3, weight_decay=0.01)
LAYOUTS = {"owner": "MuonOwner", "a2a": "MuonAllToAll", "replicate": "MuonReplicate"}
# (case, model, layout, whole-matrix optimizer)
CASES = [(m, lay, "muon") for m in ("nano", "convmlp", "convmlp-skip") for lay in LAYOUTS] + [
    ("convmlp", lay, opt) for opt in ("adafactor", "lamb") for lay in ("owner", "replicate")] + [
    ("nano", lay, "adafactor") for lay in ("owner", "replicate")]
SKIPPED = ("wide.weight", "conv.bias")     # convmlp-skip: no gradient on any rank at step 1


class ConvMLP(nn.Module):
    """Not the course's model: a Conv1d (3-D weight: AdamW), a LayerNorm, a tall [48, 20], a wide
    [20, 48] and an odd [7, 20] matrix (the head: AdamW), biases; x [B, 3, 16] -> 7 classes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3)
        self.norm = nn.LayerNorm(70)
        self.up, self.mid = nn.Linear(70, 48), nn.Linear(48, 20)
        self.wide, self.down = nn.Linear(20, 48, bias=False), nn.Linear(48, 20)
        self.head = nn.Linear(20, 7)

    def forward(self, x, y):
        h = self.norm(F.gelu(self.conv(x)).flatten(1))
        h = self.down(F.gelu(self.wide(F.gelu(self.mid(F.gelu(self.up(h)))))))
        return F.cross_entropy(self.head(h), y)


def build(name):
    if name.startswith("convmlp"):
        torch.manual_seed(0)
        return ConvMLP()
    return make_model(name)


def batch(model, step, rows=6):
    if isinstance(model, ConvMLP):
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(rows, 3, 16, generator=g), torch.randint(0, 7, (rows,), generator=g)
    return global_batch(model, step, rows)


def quantise(model):
    """The N = 3 launch: every rank's gradients rounded to multiples of 2^-18 in [-1, 1] (a loop
    may edit its gradients), so that any order of summing 3 of them is exact in fp32 (21 bits)
    and the reference's sum is gloo's whatever order gloo's ring adds them in."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = torch.round(p.grad.clamp(-1, 1) * 2.0 ** 18) / 2.0 ** 18


def drop_grads(model, model_name, step):
    """convmlp-skip: at step 1 two parameters (a Muon matrix, an AdamW bias) have no gradient
    anywhere: torch skips them (no decay, no state update); so must every layout."""
    if model_name == "convmlp-skip" and step == 1:
        for name, p in model.named_parameters():
            if name in SKIPPED:
                p.grad = None


def groups(model, opt):
    from zerolab.wholematrix.wholeopt import muon_param_groups
    if opt == "muon":
        return muon_param_groups(model, muon=MUON, adamw=ADAMW)
    return [{"params": [p for p in model.parameters()], "use_muon": True}]


def whole_class(opt):
    from zerolab.wholematrix.lamb import Lamb
    return {"muon": torch.optim.Muon, "adafactor": torch.optim.Adafactor, "lamb": Lamb}[opt]


def whole_kw(opt):
    return {"muon": {}, "adafactor": dict(lr=0.01), "lamb": dict(lr=0.01, weight_decay=0.01)}[opt]


def worker(rank, n, cases, quantised=False):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zerolab.wholematrix import muon_a2a, muon_owner, muon_replicate
    from zerolab.comm import Comm
    classes = {"owner": muon_owner.MuonOwner, "a2a": muon_a2a.MuonAllToAll,
               "replicate": muon_replicate.MuonReplicate}
    out = {}
    for model_name, layout, opt_name in cases:
        model, comm = build(model_name), Comm()
        gs = groups(model, opt_name)
        opt = classes[layout](gs, whole_class(opt_name), comm=comm, **whole_kw(opt_name))
        for step in range(STEPS):
            comm.step = step
            x, y = batch(model, step)
            model(x[rank::n], y[rank::n]).backward()
            if quantised:
                quantise(model)
            drop_grads(model, model_name, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        last = [r for r in comm.records if r.step == STEPS - 1 and r.what in ("grads", "params")]
        by_op = {}
        for r in last:
            by_op[r.op] = by_op.get(r.op, 0) + r.bytes
        res = {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
               "bytes": by_op, "costs": opt.costs(), "held": opt.held_bytes(),
               "owners": opt.owners, "ops": [(r.op, r.what) for r in last]}
        # a gradient on one rank only is refused on every rank; the state reloads on its rank
        model(*[t[rank::n] for t in batch(model, STEPS)]).backward()
        if rank == 1:
            next(model.parameters()).grad = None
        try:
            opt.step()
        except RuntimeError as err:
            res["refused"] = str(err)
        again = classes[layout](groups(model, opt_name), whole_class(opt_name), comm=comm,
                                **whole_kw(opt_name))
        again.load_state_dict(opt.state_dict())
        res["reloaded"] = again.state_dict() is not None and all(
            torch.equal(a, b) for o1, o2 in ((opt.whole, again.whole),
                                             (opt.fallback, again.fallback)) if o1 is not None
            for s1, s2 in zip(o1.state.values(), o2.state.values())
            for a, b in zip(s1.values(), s2.values()) if torch.is_tensor(a))
        try:
            again.load_state_dict({**opt.state_dict(), "zerolab_rank": 1 - rank})
        except ValueError as err:
            res["other_rank"] = str(err)
        if layout == "owner":
            res["imbalance"] = opt.imbalance()
            torch_zero = ZeroRedundancyOptimizer(
                [{"params": g["params"]} for g in gs], torch.optim.SGD, lr=0.1)
            index = {id(p): i for i, p in enumerate(opt.params)}
            theirs = [None] * len(opt.params)
            for r, rank_groups in enumerate(torch_zero._partition_parameters()):
                for g in rank_groups:
                    for p in g["params"]:
                        theirs[index[id(p)]] = r
            res["torch_owners"] = theirs
        out[(model_name, layout, opt_name)] = res
    return out


def reference(model_name, opt_name, n=N, quantised=False):
    """Single process: the average of the ranks' gradients, torch's optimizers (Muon + AdamW,
    Adafactor, or the paper's Lamb) on the whole parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                     # the ranks' matmuls, bit for bit
    try:
        model = build(model_name)
        gs = groups(model, opt_name)
        if opt_name == "muon":
            opts = [torch.optim.Muon(gs[0]["params"], **MUON),
                    torch.optim.AdamW(gs[1]["params"], **ADAMW)]
        else:
            opts = [whole_class(opt_name)(gs[0]["params"], **whole_kw(opt_name))]
        for step in range(STEPS):
            x, y = batch(model, step)
            grads = []
            for r in range(n):
                model.zero_grad(set_to_none=True)
                model(x[r::n], y[r::n]).backward()
                if quantised:
                    quantise(model)
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *gr in zip(model.parameters(), *grads):
                p.grad = sum(gr[1:], gr[0]) / n
            drop_grads(model, model_name, step)
            for o in opts:
                o.step()
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker, N, CASES, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_layout_equals_single_process_torch(ranks, case):
    model_name, layout, opt_name = case
    expected = reference(model_name, opt_name)
    start = build(model_name).state_dict()
    for rank, res in enumerate(r[case] for r in ranks):
        for name, want in expected.items():
            got = res["params"][name]
            moved = (want - start[name]).abs().max()
            assert moved > 0, f"{name} never moved: the comparison would prove nothing"
            assert torch.equal(got, want), (f"rank {rank} {case} {name}: max diff "
                                            f"{(got - want).abs().max():.3g}")


def test_one_ranks_missing_gradient_is_refused_on_every_rank_and_state_reloads(ranks):
    for case in CASES:
        for rank, res in enumerate(r[case] for r in ranks):
            assert "has a gradient on 1 of 2 ranks" in res.get("refused", ""), (case, rank)
            assert res["reloaded"], (case, rank)
            assert f"rank {1 - rank} of 2" in res.get("other_rank", ""), (case, rank)


CASES3 = [("convmlp", lay, "muon") for lay in LAYOUTS] + [("nano", "a2a", "muon")]


def test_three_ranks_uneven_shards_and_owners():
    """N = 3 (5, 7, 20 and 70 rows do not divide; 3 owners), quantised gradients: each layout
    still equals one process bit for bit, and its ledger its formula."""
    ranks3 = run_ranks(worker, 3, CASES3, True, timeout=240)
    for case in CASES3:
        expected = reference(case[0], case[2], 3, quantised=True)
        for rank, res in enumerate(r[case] for r in ranks3):
            for name, want in expected.items():
                assert torch.equal(res["params"][name], want), (rank, case, name)
            assert res["bytes"] == pytest.approx(res["costs"][rank]["bytes"], rel=1e-12)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_bytes_equal_the_formulas(ranks, case):
    for rank, res in enumerate(r[case] for r in ranks):
        assert res["bytes"] == pytest.approx(res["costs"][rank]["bytes"], rel=1e-12), rank


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "muon"], ids="-".join)
def test_held_bytes_equal_the_formulas(ranks, case):
    """Muon's momentum and AdamW's moments held (owned / all / owned + rows), and the buffers."""
    for rank, res in enumerate(r[case] for r in ranks):
        want = res["costs"][rank]
        assert res["held"] == {"state": want["state_bytes"], "buffers": want["buffer_bytes"]}


def test_formulas_by_hand():
    """Two ranks, fp32: matrices [6, 4] (shard 3 rows = 12) and [4, 4] (8), a bias [5] (3 rows
    of 1 after padding to 6). Owner: greedy puts 24 on rank 0 and 16 + 5 on rank 1, L = 24:
    2 x (1 x 24 x 4) = 192 bytes. Replicate: S = 12 + 8 + 3 = 23: 2 x 23 x 4 = 184. a2a (matrices
    only: [6,4] to rank 0, [4,4] to rank 1): reduce_scatter + all_gather 184, all_to_all rank 0
    sends its shard of the [4,4] (8) there and 1 x 12 back = 20 elements = 80 bytes."""
    shapes, whole = [(6, 4), (4, 4), (5,)], [True, True, False]
    owner = mt.layout_costs("owner", shapes, whole, 2)
    assert sum(owner[0]["bytes"].values()) == 192 == sum(owner[1]["bytes"].values())
    rep = mt.layout_costs("replicate", shapes, whole, 2)
    assert sum(rep[0]["bytes"].values()) == 184
    a2a = mt.layout_costs("a2a", shapes, whole, 2)
    assert a2a[0]["bytes"]["all_to_all"] == 80 and a2a[1]["bytes"]["all_to_all"] == (12 + 8) * 4
    # Newton-Schulz [6, 4]: a = 4, c = 6: 5 x (4·16·6 + 2·64) = 2560 FLOPs; replicate runs both
    assert mt.ns_flops((6, 4)) == 5 * (4 * 16 * 6 + 2 * 64) == mt.ns_flops((4, 6))
    assert rep[0]["ns_flops"] == mt.ns_flops((6, 4)) + mt.ns_flops((4, 4)) == rep[1]["ns_flops"]
    assert a2a[0]["ns_flops"] + a2a[1]["ns_flops"] == rep[0]["ns_flops"]


def test_owners_are_torchs_and_imbalance_reported(ranks):
    for case in CASES:
        if case[1] != "owner":
            continue
        res = ranks[0][case]
        assert res["owners"] == res["torch_owners"], case
        loads = res["imbalance"]["loads"]
        assert res["imbalance"]["elements"] == pytest.approx(max(loads) / (sum(loads) / N))
        assert res["imbalance"]["elements"] >= 1.0


def test_the_7_5b_table_by_hand():
    """7.5B GPT (36 blocks, d = 4096): Newton-Schulz a block = c_attn [3d, d] 5(12d³ + 2d³) +
    attn_proj 5·6d³ + c_fc and mlp_proj 5(16d³ + 2d³) each = 280d³; replicate runs all of it on
    every rank (63 copies redundant at N = 64), owner and a2a each matrix once."""
    from zerolab.course.muontable import BIG, formula_rows
    from zerolab.timing import hardware
    rows = {r["layout"]: r for r in formula_rows(BIG, 64, hardware.get_link("ib-ndr"),
                                                 hardware.get_device("h100"))}
    total = 36 * 280 * 4096 ** 3
    assert rows["replicate"]["ns_flops"] == total
    assert rows["replicate"]["redundant_flops"] == 63 * total
    assert rows["owner"]["redundant_flops"] == 0 == rows["a2a"]["redundant_flops"]
    # replicate = DDP's ring bytes of Ψ fp32 (rows padded to a multiple of 64: < 0.1% more)
    psi = 36 * (12 * 4096 ** 2 + 13 * 4096) + (50304 + 2048 + 2) * 4096
    assert rows["replicate"]["bytes"] == pytest.approx(2 * 63 / 64 * psi * 4, rel=1e-3)


def test_08bs_7_5b_figure_draws_the_table_by_hand():
    """Notebook 08b's figure (wholematrix.scale_costs): replicate's Newton-Schulz and bytes by
    hand as above; a2a adds an all_to_all to replicate's reduce_scatter + all_gather; every
    layout's totals are the `zerolab time --muon` rows."""
    from zerolab.course.muontable import BIG, formula_rows
    from zerolab.course.wholematrix import scale_costs
    from zerolab.timing import hardware
    rows = {r["layout"]: r for r in scale_costs(BIG, 64)}
    table = {r["layout"]: r for r in formula_rows(BIG, 64, hardware.get_link("ib-ndr"),
                                                  hardware.get_device("h100"))}
    assert rows["replicate"]["ns_flops"] == 36 * 280 * 4096 ** 3
    psi = 36 * (12 * 4096 ** 2 + 13 * 4096) + (50304 + 2048 + 2) * 4096
    assert sum(rows["replicate"]["bytes"].values()) == pytest.approx(2 * 63 / 64 * psi * 4, rel=1e-3)
    assert set(rows["a2a"]["bytes"]) == {"reduce_scatter", "all_to_all", "all_gather"}
    assert set(rows["owner"]["bytes"]) == set(rows["replicate"]["bytes"]) == {"reduce_scatter", "all_gather"}
    for layout, r in rows.items():
        assert sum(r["bytes"].values()) == table[layout]["bytes"]
        assert r["ns_flops"] == table[layout]["ns_flops"]
        assert r["state_bytes"] + r["buffer_bytes"] == table[layout]["held_bytes"]


def test_make_muon_refuses_an_unknown_layout():
    from zerolab.variants.compose import make_muon
    with pytest.raises(ValueError, match="owner, a2a, replicate"):
        make_muon([torch.zeros(2, 2)], "zero3")


def test_a2a_refuses_an_optimizer_that_reads_the_weights():
    from zerolab.wholematrix.lamb import Lamb
    from zerolab.wholematrix.muon_a2a import MuonAllToAll
    for cls in (torch.optim.Adafactor, Lamb):
        with pytest.raises(ValueError, match="use MuonOwner or MuonReplicate"):
            MuonAllToAll([torch.zeros(2, 2)], cls)


def test_lamb_matches_the_paper_by_hand():
    """Step 1 of Algorithm 2 with λ = 0, ε = 0: m̂ = g, v̂ = g², r = sign(g); x = [3, 4] (norm 5),
    g = [1, -1]: x - lr·5/√2·[1, -1]."""
    from zerolab.wholematrix.lamb import Lamb
    x = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    opt = Lamb([x], lr=0.1, eps=0.0, weight_decay=0.0)
    x.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
    opt.step()
    step = 0.1 * 5 / 2 ** 0.5
    assert torch.allclose(x.detach(), torch.tensor([3 - step, 4 + step], dtype=torch.float64))


def test_zerolab_time_gains_the_muon_rows(capsys):
    """`zerolab time --muon` prints the three layouts' rows under the stages' table (in-process:
    no launch), the same as muontable's for the same GPT; two tiers are refused in one line."""
    from zerolab.cli.commands import main
    from zerolab.course.muontable import BIG, formula_rows
    from zerolab.timing import hardware
    assert main(["time", "--params", "7.5e9", "--world-size", "64", "--blocks", "36",
                 "--d-model", "4096", "--muon"]) == 0
    out = capsys.readouterr().out
    rows = {r["layout"]: r for r in formula_rows(BIG, 64, hardware.get_link("ib-ndr"),
                                                 hardware.get_device("h100"))}
    for layout in ("owner", "a2a", "replicate"):
        line = next(x for x in out.splitlines() if x.startswith(f"{layout} "))
        assert f"{rows[layout]['ns_flops']:.3g}" in line
    from zerolab.course.muontable import time_table
    topo = hardware.get_topology(8, "nvlink4", "ib-ndr", 64, None)
    with pytest.raises(ValueError, match="one link"):
        time_table(7.5e9, 64, 36, 4096, topo, hardware.get_device("h100"))


def test_lamb_matches_algorithm_2_over_steps():
    """Three steps with weight decay and bias correction against Algorithm 2 written out in
    float64 numpy (m, v, m̂, v̂, r, trust ratio ‖x‖/‖r + λx‖), on a [5, 3] tensor."""
    import numpy as np

    from zerolab.wholematrix.lamb import Lamb
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(5, 3, generator=g, dtype=torch.float64)
    grads = [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    lr, (b1, b2), eps, wd = 0.05, (0.9, 0.99), 1e-6, 0.1
    x = x0.clone().requires_grad_(True)
    opt = Lamb([x], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    xn, m, v = x0.numpy().copy(), np.zeros((5, 3)), np.zeros((5, 3))
    for t, grad in enumerate(grads, 1):
        x.grad = grad.clone()
        opt.step()
        gn = grad.numpy()
        m, v = b1 * m + (1 - b1) * gn, b2 * v + (1 - b2) * gn * gn
        r = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * xn
        xn = xn - lr * np.linalg.norm(xn) / np.linalg.norm(r) * r
    np.testing.assert_allclose(x.detach().numpy(), xn, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="betas"):
        Lamb([x], betas=(0.9, 1.0))
