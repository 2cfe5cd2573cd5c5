"""The ledger of a learner's own model run through zerolab.torchlike: every collective, once, in
one ledger, tagged with the phase it runs in (issue #31, part 4).

The reference is independent of zerolab's bookkeeping: every method of torch's ProcessGroup that
starts a collective is wrapped in each rank (`count_collectives`), so each collective the process
really issues is seen - (section of the loop it ran in, op, elements) - where the section is what
the loop is doing, set by the loop itself: "setup" (wrapping), "forward" (`model(x)`),
"backward" (`loss.backward()`), "step" (clipping and `opt.step()`), "eval" (`model(x)` under
no_grad, the full state dict, consolidating the optimizer). The wrapper's ledger
(`model.comm.records`) must be exactly that list: the same collectives, in the same order, each
with the phase the loop was in. On gloo, zerolab's reduce_scatter is an in-place all_reduce
underneath (zerolab.comm): counted as one.

And against torch's own FSDP2 on the same loop, counted the same way: the all_gathers and
reduce_scatters of forward and backward, in order and size, and the trained weights.

Models shaped unlike the course's GPT: an MLP whose root returns its sharded head's output
directly (`return self.head(h)`), sibling blocks in a ModuleDict around a root of its own, a conv
net (conv blocks with GroupNorm, a pooled linear head). 2 gloo ranks, one group for the module.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import case_results as results
from conftest import run_ranks

N = 2               # ranks
STEPS = 2           # optimizer steps per scenario
ATOL = 1e-6         # fp32, parameters O(1): averaging over ranks moves a few ulps


# --- models (module level: the ranks build them) --------------------------------------------------
class MLP(nn.Module):
    """Three hidden Linear blocks and a head; forward returns the head's output itself (`tail`:
    `* 1.0` after it, the workaround the issue found)."""

    def __init__(self, tail=False):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.tail = tail

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = torch.relu(b(h))
        out = self.head(h)
        return out * 1.0 if self.tail else out

    def shard_order(self):              # the modules fully_shard is called on before the root
        return [*self.blocks, self.head]

    @staticmethod
    def batch(g, rows):
        return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)

    @staticmethod
    def loss(out, y):
        return F.mse_loss(out, y)


class Siblings(nn.Module):
    """A ModuleDict of sibling blocks (encoder / decoder, different widths) around a root that
    holds its own embedding and output projection."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 12)
        self.parts = nn.ModuleDict({
            "enc": nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12)),
            "mid": nn.LayerNorm(12),
            "dec": nn.Sequential(nn.Linear(12, 18), nn.GELU(), nn.Linear(18, 12))})
        self.out = nn.Linear(12, 11)

    def forward(self, x):
        h = self.emb(x)
        for name in ("enc", "mid", "dec"):
            h = h + self.parts[name](h)
        return self.out(h)

    def shard_order(self):
        return list(self.parts.values())

    @staticmethod
    def batch(g, rows):
        x = torch.randint(0, 11, (rows, 5), generator=g)
        return x, (x * 3 + 1) % 11

    @staticmethod
    def loss(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())


class ConvNet(nn.Module):
    """Images 3 x 8 x 8 -> 5 classes: a conv stem, two Conv-GroupNorm-ReLU blocks of 13 channels
    (a row count 2 ranks do not divide), global average pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, 13, 3, padding=1), nn.GroupNorm(1, 13), nn.ReLU())
            for c in (8, 13))
        self.head = nn.Linear(13, 5)

    def forward(self, x):
        h = F.relu(self.stem(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean((2, 3)))

    def shard_order(self):
        return list(self.blocks)

    @staticmethod
    def batch(g, rows):
        return torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 5, (rows,), generator=g)

    @staticmethod
    def loss(out, y):
        return F.cross_entropy(out, y)


MODELS = {"mlp": MLP, "siblings": Siblings, "conv": ConvNet}


def build(kind):
    torch.manual_seed(0)
    return MODELS[kind]()


def shard_plan(model, variant):
    """The modules fully_shard is called on before the root, in call order. "nested": the
    siblings interleaved with a parent - parts.enc[0], parts.dec, then parts.enc (which holds
    enc[0]), parts.mid - so the Comm of enc[0]'s call, which enc's call reuses, gets a record
    after dec's Comm got its own."""
    if variant == "nested":
        return [model.parts["enc"][0], model.parts["dec"], model.parts["enc"], model.parts["mid"]]
    return model.shard_order()


def rows(kind, step, rank, per=2):
    """Rank `rank`'s rows of the global batch of `step` (N * per rows, drawn the same on every
    rank from a generator seeded by the step)."""
    x, y = MODELS[kind].batch(torch.Generator().manual_seed(100 + step), N * per)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


# --- the independent count: every collective the process issues, by the loop's section ---------
SECTION = ["idle"]
ISSUED: list = []
# ProcessGroup method -> (op, which positional argument holds the full tensor)
STARTS = {"allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
          "broadcast": ("broadcast", 0), "all_gather_single": ("all_gather", 0),
          "_allgather_base": ("all_gather", 0), "allgather": ("all_gather", 0),
          "allgather_into_tensor_coalesced": ("all_gather", 0),
          "reduce_scatter_single": ("reduce_scatter", 1),
          "_reduce_scatter_base": ("reduce_scatter", 1),
          "reduce_scatter": ("reduce_scatter", 1),
          "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1), "reduce": ("reduce", 0),
          "gather": ("gather", 0), "scatter": ("scatter", 0), "alltoall_base": ("all_to_all", 0)}


def count_collectives():
    """Wrap torch's ProcessGroup methods (once per process): each call appends (section, op,
    elements of the full tensor) to ISSUED while the loop is in a section other than "idle"."""
    PG = dist.ProcessGroup
    if getattr(PG, "_counted", False):
        return
    for name, (op, arg) in STARTS.items():
        orig = getattr(PG, name, None)
        if orig is None:
            continue

        def wrapped(self, *args, _orig=orig, _op=op, _arg=arg, **kwargs):
            if SECTION[0] != "idle":
                t = args[_arg]
                while isinstance(t, (list, tuple)):
                    t = t[0]
                ISSUED.append((SECTION[0], _op, t.numel()))
            return _orig(self, *args, **kwargs)
        setattr(PG, name, wrapped)
    PG._counted = True


class section:
    """`with section("forward"): ...`: what the loop does inside is counted under that name."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.before, SECTION[0] = SECTION[0], self.name

    def __exit__(self, *exc):
        SECTION[0] = self.before


def as_issued(records) -> list:
    """The ledger's records as the count sees them: (phase, op, elements); gloo's reduce_scatter
    is issued as an all_reduce of the full tensor."""
    return [(r.phase, "all_reduce" if r.op == "reduce_scatter" else r.op, r.numel) for r in records]


def traffic(rows_) -> list:
    """(phase, op, elements) of the all_gathers and reduce_scatters of forward and backward."""
    return [r for r in rows_ if r[0] in ("forward", "backward")
            and r[1] in ("all_gather", "reduce_scatter")]


# --- the scenarios, run on every rank -------------------------------------------------------------
def fsdp_loop(rank, kind, impl, variant, mesh):
    """fully_shard on the blocks, then the root; STEPS steps of SGD with momentum. variant:
    "plain"; "clip" (clip_grad_norm_ between backward and step); "twice" (two forwards, one
    backward of their sum); "eval" (a forward under no_grad after each step: phase "eval", as
    zerolab's stages tag it); "tail" (the MLP
    returns head(h) * 1.0); "nested" (`shard_plan`)."""
    from zerolab import torchlike as tl
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        kw = {"mesh": mesh}
    else:
        fully_shard, kw = tl.fully_shard, {}
    start = len(ISSUED)
    with section("setup"):
        model = build(kind)
        if variant == "tail":
            model.tail = True
        blocks = shard_plan(model, variant)
        for b in blocks:
            fully_shard(b, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"norms": []}
    for step in range(STEPS):
        x, y = rows(kind, step, rank)
        with section("forward"):
            pred = model(x)
            if variant == "twice":
                pred2 = model(x.flip(0))
        with section("backward"):
            loss = model.loss(pred, y)
            if variant == "twice":
                loss = loss + model.loss(pred2, y.flip(0))
            loss.backward()
        with section("step"):
            if variant == "clip":
                out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            opt.step()
            opt.zero_grad()
        if variant == "eval":               # (zerolab's stages call it "eval" too)
            with section("eval"), torch.no_grad():
                model(x)
    with section("eval"):
        full = (model.full_state_dict() if impl != "torch" else
                {k: v.full_tensor() for k, v in model.state_dict().items()})
    out["state"] = {k: v.detach().float().clone() for k, v in full.items()}
    out["issued"] = ISSUED[start:]
    if impl != "torch":
        comm = model.comm
        out["ledger"] = as_issued(comm.records)
        out["units"] = [(r.phase, r.op, r.what, r.unit) for r in comm.records]
        out["raw"] = [(r.phase, r.op, r.numel) for r in comm.records]
        out["one_comm"] = [b.comm is comm for b in blocks]
    return out


def ddp_loop(rank, kind, variant, mesh):
    """torchlike's DistributedDataParallel (find_unused_parameters=True: a flag all_reduce each
    backward; a buffer, broadcast before every forward, as torch's) with its
    ZeroRedundancyOptimizer(comm=model.comm); a forward under no_grad after each step;
    consolidated on rank 0 at the end."""
    from zerolab import torchlike as tl
    start = len(ISSUED)
    with section("setup"):
        net = build(kind)
        net.register_buffer("tag", torch.arange(3.0))      # DDP broadcasts it every forward
        model = tl.DistributedDataParallel(net, find_unused_parameters=True, bucket_cap_mb=0.001)
        opt = tl.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                         comm=model.comm)
    for step in range(STEPS):
        x, y = rows(kind, step, rank)
        with section("forward"):
            pred = model(x)
        with section("backward"):
            model.module.loss(pred, y).backward()
        with section("step"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        with section("eval"), torch.no_grad():
            model(x)
    with section("eval"):
        opt.consolidate_state_dict(0)
    return {"issued": ISSUED[start:], "ledger": as_issued(model.comm.records),
            "state": {k: v.detach().float().clone() for k, v in model.module.state_dict().items()
                      if k != "tag"}}


def single_process(kind, variant):
    """The fully_shard loop in one process on the whole batch: torch alone."""
    model = build(kind)
    if variant == "tail":
        model.tail = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = MODELS[kind].batch(torch.Generator().manual_seed(100 + step), N * 2)
        loss = model.loss(model(x), y)
        if variant == "twice":
            loss = loss + model.loss(model(x.view(N, 2, *x.shape[1:]).flip(1).flatten(0, 1)),
                                     y.view(N, 2, *y.shape[1:]).flip(1).flatten(0, 1))
        loss.backward()
        if variant == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


FSDP_CASES = [("fsdp", kind, impl, "plain") for kind in MODELS for impl in ("torch", "zerolab")]
FSDP_CASES += [("fsdp", "mlp", impl, v) for v in ("clip", "twice", "eval", "tail")
               for impl in ("torch", "zerolab")]
FSDP_CASES += [("fsdp", "siblings", impl, "nested") for impl in ("torch", "zerolab")]
DDP_CASES = [("ddp", kind, "plain") for kind in ("conv", "siblings")]
RUN = FSDP_CASES + DDP_CASES


def worker(rank, n, todo):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (n,))
    count_collectives()
    out = {}
    for case in todo:
        try:
            out[case] = (fsdp_loop(rank, *case[1:], mesh) if case[0] == "fsdp"
                         else ddp_loop(rank, *case[1:], mesh))
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            out[case] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker, N, RUN, timeout=240)


def assert_close(got, want, atol, what):
    assert got.keys() == want.keys(), what
    for k in want:
        diff = (got[k] - want[k]).abs().max().item()
        assert diff <= atol, f"{what}: {k} differs by {diff} (atol {atol})"


ZL_CASES = [c for c in RUN if c[0] == "ddp" or c[2] == "zerolab"]


def ids(cases):
    return ["-".join(c) for c in cases]


def first_difference(r) -> tuple:
    """(position, ledger's row, issued row) where the two lists first differ."""
    a, b = r["ledger"] + [None], r["issued"] + [None]
    return next((i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y)


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ZL_CASES, ids=ids(ZL_CASES))
def test_every_collective_is_in_the_one_ledger_with_its_phase(ranks, case):
    """The ledger is exactly what the process issued: same collectives, same order, and each
    one's phase is the section of the loop it ran in - fully_shard's start-up broadcasts of every
    block (siblings included), the gathers of a block whose output the model returns (backward,
    not "setup"), the per-backward flag all_reduce of the parameters used (backward), the norm
    all_reduce of clip_grad_norm_ (step), the full state dict and the optimizer's consolidation
    (eval)."""
    for rank, r in enumerate(results(ranks, case)):
        assert r["ledger"] == r["issued"], f"{case} rank {rank}: {first_difference(r)}"
        phases = {p for p, _, _ in r["issued"]}                           # (not vacuous)
        assert {"setup", "forward", "backward", "eval"} <= phases, phases


@pytest.mark.parametrize("case", [c for c in ZL_CASES if c[0] == "fsdp"],
                         ids=ids([c for c in ZL_CASES if c[0] == "fsdp"]))
def test_every_block_writes_into_the_roots_ledger(ranks, case):
    """`block.comm` of every fully_shard'ed block is the root's Comm (the one the strategy
    uses), and the setup section holds one broadcast per call that had something to send."""
    calls = len(shard_plan(build(case[1]), case[3])) + 1
    for rank, r in enumerate(results(ranks, case)):
        assert all(r["one_comm"]), (case, rank, r["one_comm"])
        setup = [u for u in r["units"] if u[0] == "setup"]
        assert len(setup) == calls and {u[1] for u in setup} == {"broadcast"}, setup


FSDP_ZL = [c for c in FSDP_CASES if c[2] == "zerolab"]
AS_FSDP2 = [c for c in FSDP_ZL if c[3] != "eval"]


@pytest.mark.parametrize("case", AS_FSDP2, ids=ids(AS_FSDP2))
def test_fully_shard_gathers_and_reduces_as_fsdp2(ranks, case):
    """Forward and backward issue the all_gathers and reduce_scatters torch's FSDP2 issues on
    the same model and loop, in the same order, of the same sizes: a block whose output the
    model returns is gathered once its backward begins and the block before it is prefetched
    then, as with `* 1.0` after it. ("twice": FSDP2 gathers the head's weights a second time
    for the second forward's backward; zerolab keeps them: compared as sets. "nested": the same
    collectives, compared as multisets - in backward zerolab prefetches in the reverse of the
    order in which the blocks' forwards began (enc before enc.0), FSDP2 in the reverse of the
    order in which they ended (enc.0 first: it ends inside enc), so the two backward gathers of
    enc and enc.0 come in the other order. Not "eval": after
    a forward without grad zerolab frees the root's weights, FSDP2 keeps them to the next
    backward, so zerolab's next forward gathers the root once more - a choice, not a count.)"""
    theirs = results(ranks, ("fsdp", case[1], "torch", case[3]))
    for rank, r in enumerate(results(ranks, case)):
        ours = traffic(r["raw"])
        want = traffic(theirs[rank]["issued"])
        if case[3] == "twice":
            assert sorted(set(ours)) == sorted(set(want)), (rank, ours, want)
        elif case[3] == "nested":
            assert sorted(ours) == sorted(want), (rank, ours, want)
        else:
            assert ours == want, f"{case} rank {rank}:\nzerolab {ours}\nFSDP2   {want}"


@pytest.mark.parametrize("case", FSDP_ZL, ids=ids(FSDP_ZL))
def test_fully_shard_trains_as_fsdp2_and_one_process(ranks, case):
    theirs = results(ranks, ("fsdp", case[1], "torch", case[3]))
    ref = single_process(case[1], case[3])
    for rank, r in enumerate(results(ranks, case)):
        assert_close(r["state"], theirs[rank]["state"], ATOL, f"{case} rank {rank} vs FSDP2")
        assert_close(r["state"], ref, ATOL, f"{case} rank {rank} vs one process")
        assert r["norms"] == pytest.approx(theirs[rank]["norms"], rel=1e-6)


def test_a_backward_begins_once_however_many_forwards(ranks):
    """Two forwards, one backward of their sum: the backward's set-up (the ranks' agreement, one
    all_reduce) and its end (the used-parameters flags, one all_reduce) happen once per backward,
    as FSDP2's root pre-backward and final callback do."""
    for rank, r in enumerate(results(ranks, ("fsdp", "mlp", "zerolab", "twice"))):
        agree = [u for u in r["units"] if u[3] == "agree"]
        used = [u for u in r["units"] if u[3] == "used_params"]
        assert len(agree) == len(used) == STEPS, (rank, agree, used)
        assert {u[0] for u in agree + used} == {"backward"}


def test_ddp_and_zero_redundancy_optimizer_train_as_one_process(ranks):
    for kind in ("conv", "siblings"):
        model = build(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(STEPS):
            x, y = MODELS[kind].batch(torch.Generator().manual_seed(100 + step), N * 2)
            model.loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        want = {k: v.detach().float() for k, v in model.state_dict().items()}
        for rank, r in enumerate(results(ranks, ("ddp", kind, "plain"))):
            assert_close(r["state"], want, ATOL, f"{kind} rank {rank}")
