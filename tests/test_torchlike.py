"""zerolab.torchlike next to torch's own classes, in the style of torch's distributed tests.

What torch tests for DistributedDataParallel (test_c10d_*, distributed_test.py), for
ZeroRedundancyOptimizer (test_zero_redundancy_optimizer.py) and for FSDP2's fully_shard
(test_fully_shard_training.py, test_fully_shard_mixed_precision.py), asked of zerolab's wrappers:
the ordinary loop - any torch optimizer over `model.parameters()`, `loss.backward()`,
`opt.step()`, `opt.zero_grad()` - trains exactly as

(a) the same loop in one process on the whole global batch (same model, same torch optimizer):
    fp32 results agree within the rounding of averaging over ranks (ATOL), and
(b) torch's own class on the same loop, in the same process group: torch.nn.parallel.
    DistributedDataParallel, torch.distributed.optim.ZeroRedundancyOptimizer (with torch's DDP),
    torch.distributed.fsdp.fully_shard (FSDP2: works on CPU over gloo in torch 2.13, on a 1-D
    "cpu" DeviceMesh; its bf16 run reduces in bf16 on gloo too).

The models have what trips wrappers up: a weight frozen after construction, a fixed
nn.Parameter(requires_grad=False), an embedding tied to the output head, biases, a dim-0 size
(63) that 2 ranks do not divide; and a plain nn.Sequential of Linear layers. Every scenario runs
in ONE group of 2 gloo ranks (`ranks`, module scope: starting ranks costs seconds); the tests
then read its results. All references are computed here from torch alone (no zerolab code).
"""
from __future__ import annotations

import contextlib
import functools
import math
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_ranks
from zerolab import theory, torchlike
from zerolab.course.testing import first_difference

N = 2               # ranks
STEPS = 3           # optimizer steps per scenario
PER = 2             # rows per rank and micro-step
ACCUM = 2           # micro-steps per optimizer step in the accumulation scenarios
ATOL = 1e-6         # fp32: the parameters are O(1); averaging N per-rank means instead of one
                    # global mean changes the gradient by a few ulps, which STEPS updates carry



# --- models and data (module level: the ranks build them too) ---------------------------------
class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class Toy(nn.Module):
    """Embedding tied to the head (which has its own bias), three residual blocks, a fixed gain.
    `build` freezes blocks[1].fc.weight after construction. 3,399 elements, 2,799 trainable."""
    vocab, dim, T = 63, 24, 6

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.vocab, self.dim)
        self.blocks = nn.ModuleList(Block(self.dim) for _ in range(3))
        self.head = nn.Linear(self.dim, self.vocab)
        self.head.weight = self.emb.weight                              # tied
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, self.dim), requires_grad=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h * self.gain)


SEQ_IN, SEQ_OUT = 12, 4


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "toy":
        model = Toy()
        model.blocks[1].fc.weight.requires_grad_(False)               # frozen after construction
        return model
    if kind == "seq":
        return nn.Sequential(nn.Linear(SEQ_IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, SEQ_OUT))
    raise ValueError(kind)


def blocks(kind, model):
    """The modules fully_shard is called on before the root."""
    return list(model.blocks) if kind == "toy" else [m for m in model if isinstance(m, nn.Linear)]


def batch(kind: str, step: int, rows: int):
    """The global batch of `step`: a generator seeded by the step alone."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "toy":
        data = torch.randint(0, Toy.vocab, (rows, Toy.T + 1), generator=g)
        return data[:, :-1], data[:, 1:]
    return torch.randn(rows, SEQ_IN, generator=g), torch.randn(rows, SEQ_OUT, generator=g)


def rank_rows(kind, step, rank, micro=0, accum=1):
    """Rank `rank`'s rows of micro-step `micro`: a slice of the global batch of N*accum*PER."""
    x, y = batch(kind, step, N * accum * PER)
    sl = slice((rank * accum + micro) * PER, (rank * accum + micro + 1) * PER)
    return x[sl], y[sl]


def loss_fn(kind, out, y):
    if kind == "toy":
        return F.cross_entropy(out.float().flatten(0, 1), y.reshape(-1))
    return F.mse_loss(out.float(), y)


# --- optimizers -------------------------------------------------------------------------------
OPTS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.01}),
    "radam": (torch.optim.RAdam, {"lr": 1e-3, "weight_decay": 0.01}),
    # the rest of the element-wise optimizers ZeroRedundancyOptimizer shards (the sweep)
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-3}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-3}),
    "asgd": (torch.optim.ASGD, {"lr": 0.05}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-3}),
}
ELEMENTWISE = ("sgd", "adam", "adamw", "adamax", "adagrad", "adadelta", "rmsprop", "nadam",
               "radam", "asgd", "rprop")
# not element-wise: a shard of a matrix cannot be updated alone (Adafactor's row/column factors,
# Muon's orthogonalisation, LBFGS's whole-model line search, SparseAdam's sparse gradients)
REFUSED = ("Adafactor", "Muon", "LBFGS", "SparseAdam")


def params_as(form, module):
    """`module`'s parameters as a torch user hands them to an optimizer."""
    form = form.removesuffix("-keep")       # the same parameters, zero_grad(set_to_none=False)
    if form == "gen":
        return module.parameters()
    if form == "list":
        return list(module.parameters())
    if form == "groups":    # the GPT-2 split: decay matrices, not biases / gains
        return [{"params": [p for p in module.parameters() if p.dim() >= 2]},
                {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    raise ValueError(form)


def make_opt(name, params, zro=None):
    cls, kw = OPTS[name]
    return cls(params, **kw) if zro is None else zro(params, optimizer_class=cls, **kw)


# --- helpers ------------------------------------------------------------------------------------
def local(t):
    """A DTensor's local shard (torch's FSDP2); zerolab's shards are plain tensors already."""
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(state: dict) -> dict:
    return {k: local(v).detach().float().clone() for k, v in state.items()}


def grads_of(module) -> dict:
    return {k: None if p.grad is None else local(p.grad).detach().float().clone()
            for k, p in module.named_parameters()}


def state_numel(opt) -> int:
    """Elements of optimizer state (tensors of dim >= 1, not the scalar step) held on this rank.
    torch's ZeroRedundancyOptimizer keeps its shard's optimizer in `.optim`."""
    inner = getattr(opt, "optim", None)
    state = (inner if isinstance(inner, torch.optim.Optimizer) else opt).state
    return sum(t.numel() for s in state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() >= 1)


def train(kind, model, rank, opt, *, accum=1, sync=None, set_to_none=True, after_backward=None,
          after_step=None, forward=None):
    """STEPS steps of the loop a torch user writes. sync(bool) -> context: entered around each
    micro-step, True on the last (DDP's no_sync, FSDP's set_requires_gradient_sync).
    after_backward(step): called after each step's last backward, before opt.step();
    after_step(step): after opt.zero_grad()."""
    forward = forward or model
    for step in range(STEPS):
        for micro in range(accum):
            x, y = rank_rows(kind, step, rank, micro, accum)
            with sync(micro == accum - 1) if sync else contextlib.nullcontext():
                loss = loss_fn(kind, forward(x), y) / accum
                loss.backward()
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if after_step is not None:
            after_step(step)


# --- the scenarios, run on every rank -----------------------------------------------------------
def run_ddp(rank, case, tl, mesh):
    """("ddp", impl, model, optimizer, variant). Each rank seeds differently: DDP must start
    every replica from rank 0's weights."""
    _, impl, kind, opt_name, variant = case
    model = build(kind, seed=rank)
    cap = 0.002 if variant == "bucket" else 25.0            # 0.002 MiB: several buckets
    if impl == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    else:
        ddp = tl.DistributedDataParallel(model, bucket_cap_mb=cap)
    out = {"init": snapshot(ddp.module.state_dict())}
    opt = make_opt(opt_name, ddp.parameters())
    comm = getattr(ddp, "comm", None)           # zerolab's ledger; torch's DDP keeps none
    marks = [len(comm.records)] if comm is not None else []

    def after_backward(step):
        if step == 0:
            out["grads0"] = grads_of(ddp.module)

    def sync(on):
        return contextlib.nullcontext() if on else ddp.no_sync()

    def after_step(step):
        if comm is not None:
            marks.append(len(comm.records))

    accum = ACCUM if variant == "accum" else 1
    train(kind, ddp, rank, opt, accum=accum, sync=sync if accum > 1 else None,
          set_to_none=variant != "keep", after_backward=after_backward, after_step=after_step)
    if comm is not None:        # (op, what, S bytes, ring bytes) of each record
        rows = [(r.op, r.what, r.size_bytes, float(r.bytes)) for r in comm.records]
        out["setup"] = rows[:marks[0]]                                  # construction
        out["steps"] = [rows[a:b] for a, b in zip(marks, marks[1:])]   # each optimizer step
    out["state"] = snapshot(ddp.module.state_dict())
    if impl != "torch":
        out["held"] = tl.held_bytes(ddp, opt)
    return out


def run_zro(rank, case, tl, mesh):
    """("zro", impl, model, optimizer, params form). impl: "torch" (torch's ZeroRedundancy-
    Optimizer with torch's DDP), "zl+torchddp" (zerolab's with torch's DDP), "zl+zlddp"."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    _, impl, kind, opt_name, form = case
    model = build(kind, seed=rank)
    ddp = (tl.DistributedDataParallel(model) if impl == "zl+zlddp"
           else torch.nn.parallel.DistributedDataParallel(model))
    zro = ZeroRedundancyOptimizer if impl == "torch" else tl.ZeroRedundancyOptimizer
    opt = make_opt(opt_name, params_as(form, ddp.module), zro=zro)
    train(kind, ddp, rank, opt, set_to_none=not form.endswith("-keep"))
    return {"state": snapshot(ddp.module.state_dict()), "state_numel": state_numel(opt),
            "held": tl.held_bytes(ddp, opt) if impl == "zl+zlddp" else None}


def run_refuse(rank, case, tl, mesh):
    """("refuse", optimizer class name): zerolab's ZeroRedundancyOptimizer must refuse it."""
    cls = getattr(torch.optim, case[1])
    model = build("seq")
    try:
        tl.ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=cls)
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def run_fsdp(rank, case, tl, mesh):
    """("fsdp", impl, model, optimizer, dtype, variant). impl: "torch" (FSDP2), "dim0", "flat"
    (zerolab's layouts). fully_shard shards each rank's own copy: every rank builds seed 0."""
    _, impl, kind, opt_name, dtype, variant = case
    model = build(kind, seed=0)
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[dtype])}
    else:
        fully_shard = tl.fully_shard
        kwargs = {"layout": impl, "mp_policy": tl.MixedPrecisionPolicy(param_dtype=DTYPES[dtype])}
    for b in blocks(kind, model):       # noreshard: FSDP2's SHARD_GRAD_OP for the blocks
        fully_shard(b, reshard_after_forward=variant != "noreshard", **kwargs)
    fully_shard(model, **kwargs)
    opt = make_opt(opt_name, model.parameters())
    out = {}

    def after_backward(step):
        if step == 0:
            out["shards"] = {k: local(p).detach().float().clone()
                             for k, p in model.named_parameters()}
            out["trainable"] = [k for k, p in model.named_parameters() if p.requires_grad]
            out["grads0"] = grads_of(model)
            out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()}
                                   | {str(p.grad.dtype) for p in model.parameters()
                                      if p.grad is not None})

    def forward(x):
        y = model(x)
        out.setdefault("out_dtype", str(y.dtype))
        return y

    @contextlib.contextmanager
    def sync(on):
        model.set_requires_gradient_sync(on)
        yield

    def after_step(step):               # eval: a forward without grad between steps
        if variant == "eval":
            with torch.no_grad():
                model(rank_rows(kind, step, rank, 0, 1)[0])

    accum = ACCUM if variant == "accum" else 1
    train(kind, model, rank, opt, accum=accum, sync=sync if accum > 1 else None,
          set_to_none=variant != "keep", after_backward=after_backward, forward=forward,
          after_step=after_step)
    if impl == "torch":
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in model.state_dict().items()}
    else:
        full = model.full_state_dict()
    out["state"] = snapshot(full)
    if impl != "torch":
        units = model.zerolab_strategy.units
        out["held"] = tl.held_bytes(model, opt)
        out["shard_numel"] = sum(u.shard_numel for u in units)
        out["real_numel"] = sum(u.shard_numel - u.padding_in_shard() for u in units)
    return out


def run_api(rank, case, tl, mesh):
    """("api", what): torch's own argument lists and keywords, given to zerolab's wrappers."""
    what = case[1]
    if what == "ddp-positional":        # torch's positional order, every argument
        model = build("toy", seed=rank)
        ddp = tl.DistributedDataParallel(model, None, None, 0, True, True, None, None, False,
                                         False, True, False)
        opt = make_opt("sgd", ddp.parameters())
        train("toy", ddp, rank, opt)
        return {"state": snapshot(ddp.module.state_dict()),
                "keys": sorted(ddp.state_dict())}
    if what == "fsdp-mesh-ignored":     # mesh=, ignored_params=: the same as FSDP2
        from torch.distributed.fsdp import fully_shard
        out = {}
        for impl in ("torch", "zerolab"):
            model = build("toy", seed=0)
            ignored = {model.blocks[0].fc.bias}
            shard = fully_shard if impl == "torch" else tl.fully_shard
            for b in model.blocks:
                shard(b, mesh=mesh, ignored_params=ignored)
            shard(model, mesh=mesh, ignored_params=ignored)
            opt = make_opt("adamw", model.parameters())
            train("toy", model, rank, opt)
            bias = model.blocks[0].fc.bias
            out[impl] = {"bias": bias.detach().clone(), "bias_shape": tuple(bias.shape)}
            if impl == "zerolab":
                out[impl]["state"] = snapshot(model.full_state_dict())
            else:
                out[impl]["state"] = snapshot({k: v.full_tensor() if hasattr(v, "full_tensor")
                                               else v for k, v in model.state_dict().items()})
        return out
    bad = {"ddp-dim": lambda: tl.DistributedDataParallel(build("seq"), dim=1),
           "ddp-over-fsdp": lambda: tl.DistributedDataParallel(tl.fully_shard(build("seq"))),
           "mp-dtype": lambda: tl.MixedPrecisionPolicy(param_dtype="bf16"),
           "zro-instance": lambda: tl.ZeroRedundancyOptimizer(
               build("seq").parameters(), torch.optim.SGD(build("seq").parameters(), lr=0.1)),
           "zro-other-rank": lambda: _load_other_rank(tl, rank),
           "ddp-bucket": lambda: tl.DistributedDataParallel(build("seq"), bucket_cap_mb=-1),
           "zro-overlap": lambda: tl.ZeroRedundancyOptimizer(
               build("seq").parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1),
           "fsdp-layout": lambda: tl.fully_shard(build("seq"), layout="rows"),
           "fsdp-reshard": lambda: tl.fully_shard(build("seq"), reshard_after_forward=2),
           "fsdp-placement": lambda: tl.fully_shard(build("seq"),
                                                    shard_placement_fn=lambda p: None)}
    try:
        bad[what]()
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


class Branchy(nn.Module):
    """Three blocks and an auxiliary branch; forward(x, use_aux, skip) leaves out the branch
    and/or block 1 (data-dependent control flow, as real models have)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(Toy.vocab, Toy.dim)
        self.blocks = nn.ModuleList(Block(Toy.dim) for _ in range(3))
        self.aux = nn.Linear(Toy.dim, Toy.dim)
        self.head = nn.Linear(Toy.dim, Toy.vocab)

    def forward(self, x, use_aux=False, skip=False):
        h = self.emb(x)
        for i, b in enumerate(self.blocks):
            h = h if (skip and i == 1) else b(h)
        return self.head(self.aux(h) if use_aux else h)


def run_found(rank, case, tl, mesh):
    """("found", what, impl): what a new user tried (issue #19's trial), torch's class vs
    zerolab's on the same loop: a branch used on odd steps (DDP, find_unused_parameters=True;
    p.grad None when no rank used it, so SGD momentum and AdamW's decay leave it alone), a block
    skipped on odd steps (fully_shard), clip_grad_norm_ over fully_shard's shards (the global
    norm on every rank)."""
    from torch.distributed.fsdp import fully_shard
    _, what, impl = case
    torch.manual_seed(0)
    model = Branchy()
    if what == "unused":
        wrap = torch.nn.parallel.DistributedDataParallel if impl == "torch" else \
            tl.DistributedDataParallel
        net, model = model, wrap(model, find_unused_parameters=True)
    else:
        shard = fully_shard if impl == "torch" else tl.fully_shard
        kw = {"mesh": mesh} if impl == "torch" else {}
        for b in model.blocks:
            shard(b, **kw)
        net, model = model, shard(model, **kw)
    opts = [torch.optim.SGD([p for n, p in net.named_parameters() if not n.startswith("head")],
                            lr=0.1, momentum=0.9, weight_decay=0.01),
            torch.optim.AdamW(net.head.parameters(), lr=0.01, weight_decay=0.1)]
    out = {"grad_none": [], "norms": []}
    for step in range(4):
        x, y = rank_rows("toy", step, rank)
        odd = step % 2 == 1
        logits = model(x, use_aux=odd) if what == "unused" else model(x, skip=odd)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        probe = net.aux.weight if what == "unused" else net.blocks[1].fc.bias
        out["grad_none"].append(probe.grad is None)
        if what == "clip":
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))
        for o in opts:
            o.step()
            o.zero_grad()
    full = net.state_dict() if what == "unused" else (
        model.full_state_dict() if impl == "zerolab" else
        {k: v.full_tensor() for k, v in model.state_dict().items()})
    out["state"] = snapshot(full)
    return out


FOUND_CASES = [("found", what, impl) for what in ("unused", "skip", "clip")
               for impl in ("torch", "zerolab")]
def _load_other_rank(tl, rank):
    model = tl.DistributedDataParallel(build("seq"))
    opt = tl.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    state = opt.state_dict()
    state["zerolab_rank"] = 1 - rank                        # the other rank's file
    opt.load_state_dict(state)


API_REFUSED = {"ddp-over-fsdp": "fully_shard", "mp-dtype": "param_dtype",
               "zro-instance": "instance of SGD", "zro-other-rank": "rank",
               "ddp-dim": "dim", "ddp-bucket": "bucket_cap_mb", "zro-overlap": "overlap_with_ddp",
               "fsdp-layout": "layout", "fsdp-reshard": "reshard_after_forward",
               "fsdp-placement": "shard_placement_fn"}
API_CASES = [("api", "ddp-positional"), ("api", "fsdp-mesh-ignored")] + [
    ("api", name) for name in API_REFUSED]
RUNNERS = {"ddp": run_ddp, "zro": run_zro, "refuse": run_refuse, "fsdp": run_fsdp, "api": run_api,
           "found": run_found}


def worker(rank, n, todo):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (n,))       # FSDP2's: a 1-D mesh over gloo
    out = {}
    for case in todo:
        try:
            out[case] = RUNNERS[case[0]](rank, case, torchlike, mesh)
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            out[case] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


# --- the cases ---------------------------------------------------------------------------------
# ("ddp", impl, model, optimizer, variant): impl torch / zerolab; variant plain, bucket (small
#   buckets), accum (no_sync() accumulation), keep (zero_grad(set_to_none=False))
# ("zro", impl, model, optimizer, params form[-keep]): impl torch (with torch's DDP), zl+torchddp,
#   zl+zlddp; form gen / list / groups; -keep: zero_grad(set_to_none=False)
# ("refuse", torch.optim class name)
# ("fsdp", impl, model, optimizer, dtype, variant): impl torch (FSDP2) / dim0 / flat (zerolab's
#   layouts); dtype fp32 / bf16 (param_dtype); variant plain, accum (set_requires_gradient_sync),
#   keep (zero_grad(set_to_none=False))
DDP_CASES = [("ddp", impl, kind, opt, "plain")
             for impl in ("torch", "zerolab") for kind in ("toy", "seq") for opt in ("sgd", "adamw")]
DDP_CASES += [("ddp", impl, "toy", opt, variant) for impl in ("torch", "zerolab")
              for opt, variant in (("adamw", "bucket"), ("adamw", "accum"), ("sgd", "keep"))]
ZRO_CASES = [("zro", impl, "toy", opt, form) for impl in ("torch", "zl+torchddp", "zl+zlddp")
             for opt, form in (("sgd", "gen"), ("adamw", "list"), ("adamw", "groups"),
                               ("adagrad", "gen"), ("radam", "gen"), ("sgd", "gen-keep"))]
SWEEP_CASES = [("zro", "zl+zlddp", "seq", opt, "gen") for opt in ELEMENTWISE]
REFUSE_CASES = [("refuse", name) for name in REFUSED]
FSDP_CASES = [("fsdp", impl, kind, opt, dtype, "plain") for impl in ("torch", "dim0", "flat")
              for kind in ("toy", "seq") for opt in ("sgd", "adamw") for dtype in ("fp32", "bf16")]
FSDP_CASES += [("fsdp", impl, "toy", opt, "fp32", variant) for impl in ("torch", "dim0", "flat")
               for opt, variant in (("adamw", "accum"), ("sgd", "keep"), ("adamw", "noreshard"),
                                    ("sgd", "eval"))]
RUN = DDP_CASES + ZRO_CASES + SWEEP_CASES + REFUSE_CASES + FSDP_CASES + API_CASES + FOUND_CASES


def cases(table, **where):
    """parametrize arguments: the cases of `table` whose fields match `where` (field: value or
    tuple of values; fields impl, model, opt, last), with readable ids."""
    fields = {"impl": 1, "model": 2, "opt": 3, "dtype": 4, "last": -1}
    keep = [c for c in table if all(c[fields[f]] in (v if isinstance(v, tuple) else (v,))
                                    for f, v in where.items())]
    return pytest.mark.parametrize("case", keep, ids=["-".join(c[1:]) for c in keep])


ZEROLAB = ("zerolab", "zl+torchddp", "zl+zlddp", "dim0", "flat")


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker, N, RUN, timeout=300)


def results(ranks, case) -> list[dict]:
    """Every rank's result of `case`; fails with the rank's traceback if it raised."""
    out = [r[case] for r in ranks]
    for rank, r in enumerate(out):
        assert "error" not in r, f"{case} raised on rank {rank}:\n{r['error']}"
    return out


# --- the single-process reference: torch alone ------------------------------------------------
@functools.cache
def reference(kind, opt_name, form="gen", accum=1):
    """The same loop in one process on the whole global batch (N*accum*PER rows, one forward):
    initial state, gradients of step 0, final state (all {name: fp32 tensor})."""
    model = build(kind, seed=0)
    init = snapshot(model.state_dict())
    opt = make_opt(opt_name, params_as(form, model))
    grads0 = None
    for step in range(STEPS):
        x, y = batch(kind, step, N * accum * PER)
        loss_fn(kind, model(x), y).backward()
        if step == 0:
            grads0 = grads_of(model)
        opt.step()
        opt.zero_grad()
    return {"init": init, "grads0": grads0, "state": snapshot(model.state_dict())}


def numels(kind):
    """(trainable elements Ψ, all parameter elements), tied weights counted once."""
    model = build(kind)
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def assert_close(got: dict, expected: dict, atol: float, what=""):
    assert got.keys() == expected.keys(), (what, sorted(got), sorted(expected))
    diff = first_difference(got, expected, atol)
    assert diff is None, f"{what}: (name, index, expected, got, max |diff|) = {diff}, atol {atol}"


def assert_ranks_agree(rs: list[dict], what=""):
    """Every rank ends with the same full weights, bit for bit (DDP's replicas, ZeRO's all_gather
    or broadcast of the updated shards, fully_shard's gathered state dict)."""
    for rank, r in enumerate(rs[1:], 1):
        for k, v in rs[0]["state"].items():
            assert torch.equal(r["state"][k], v), (what, "rank", rank, k)


def assert_grads_close(got: dict, expected: dict, atol: float, what=""):
    assert got.keys() == expected.keys(), what
    for k, g in expected.items():
        assert (got[k] is None) == (g is None), (what, k, "grad present" if g is None else "no grad")
    assert_close({k: v for k, v in got.items() if v is not None},
                 {k: v for k, v in expected.items() if v is not None}, atol, what)


# --- sanity of the setting: the tests below could fail --------------------------------------------
def test_the_models_have_what_wrappers_trip_on():
    model = build("toy")
    assert model.head.weight is model.emb.weight
    assert not model.blocks[1].fc.weight.requires_grad and not model.gain.requires_grad
    assert numels("toy")[0] < numels("toy")[1] < 4000 and numels("seq")[0] < 4000
    # rank 1 builds other weights than rank 0: broadcast at construction is observable
    a, b = build("toy", 0).state_dict(), build("toy", 1).state_dict()
    assert not torch.equal(a["emb.weight"], b["emb.weight"])
    # the optimizers move the weights by much more than ATOL in STEPS steps
    for opt in ("sgd", "adamw"):
        ref = reference("toy", opt)
        moved = max((ref["state"][k] - ref["init"][k]).abs().max().item() for k in ref["init"])
        assert moved > 1000 * ATOL, (opt, moved)


# --- DistributedDataParallel ---------------------------------------------------------------------
@cases(DDP_CASES)
def test_ddp_starts_every_rank_from_rank0_weights(ranks, case):
    ref = reference(case[2], case[3])
    for rank, r in enumerate(results(ranks, case)):
        assert r["init"].keys() == ref["init"].keys()
        for k, v in ref["init"].items():
            assert torch.equal(r["init"][k], v), (case, rank, k)


@cases(DDP_CASES)
def test_ddp_averages_gradients(ranks, case):
    """After backward, every rank's p.grad is the gradient of the global batch's mean loss
    (frozen and fixed parameters: None)."""
    _, _, kind, opt, variant = case
    ref = reference(kind, opt, accum=ACCUM if variant == "accum" else 1)
    for rank, r in enumerate(results(ranks, case)):
        assert_grads_close(r["grads0"], ref["grads0"], ATOL, f"{case} rank {rank}")


@cases(DDP_CASES)
def test_ddp_matches_the_single_process_loop(ranks, case):
    """Plain, small buckets, no_sync() accumulation (against one step on the summed batch),
    zero_grad(set_to_none=False)."""
    _, _, kind, opt, variant = case
    ref = reference(kind, opt, accum=ACCUM if variant == "accum" else 1)
    rs = results(ranks, case)
    assert_ranks_agree(rs, case)
    for rank, r in enumerate(rs):
        assert_close(r["state"], ref["state"], ATOL, f"{case} rank {rank}")


@cases(DDP_CASES, impl=ZEROLAB)
def test_ddp_matches_torch_ddp(ranks, case):
    theirs = results(ranks, ("ddp", "torch", *case[2:]))
    for rank, r in enumerate(results(ranks, case)):
        assert_close(r["state"], theirs[rank]["state"], ATOL, f"{case} rank {rank}")


@cases(DDP_CASES, impl=ZEROLAB)
def test_ddp_ledger_sends_the_trainable_gradients_once_a_step(ranks, case):
    """Per optimizer step the ledger's gradient collectives are all_reduces of Ψ trainable fp32
    gradients (tied weights once, frozen / fixed ones not at all): theory.traffic_bytes at stage
    0, once a step also with no_sync() accumulation. Construction broadcasts every parameter."""
    _, _, kind, _, variant = case
    psi, psi_all = numels(kind)
    per_param = theory.bytes_per_param("fp32")
    accum = ACCUM if variant == "accum" else 1
    for rank, r in enumerate(results(ranks, case)):
        assert len(r["steps"]) == STEPS
        for step, recs in enumerate(r["steps"]):
            grads = [rec for rec in recs if rec[1] == "grads"]
            where = f"{case} rank {rank} step {step}: {grads}"
            assert {rec[0] for rec in grads} == {"all_reduce"}, where
            # zerolab pads each bucket to a multiple of N elements (theory.padded_numel): the
            # formula holds at the padded Ψ, at most N - 1 elements more per bucket
            sent = sum(rec[2] for rec in grads) / per_param["grads"]
            assert psi <= sent <= psi + (N - 1) * len(grads), where
            assert sum(rec[3] for rec in grads) == pytest.approx(
                theory.traffic_bytes(sent, N, 0, "fp32", grad_accum=accum)["all_reduce"]), where
            if variant == "bucket":
                assert len(grads) > 1, where
        bcast = [rec for rec in r["setup"] if rec[0] == "broadcast"]
        assert sum(rec[2] for rec in bcast) == psi_all * per_param["params"], r["setup"]
        assert sum(rec[3] for rec in bcast) == pytest.approx(
            psi_all * per_param["params"] * theory.RING_FACTOR["broadcast"](N)), r["setup"]


# --- ZeroRedundancyOptimizer ---------------------------------------------------------------------
@cases(ZRO_CASES + SWEEP_CASES)
def test_zero_redundancy_optimizer_matches_the_single_process_loop(ranks, case):
    """SGD / AdamW (a generator, a list, decay / no-decay groups) / Adagrad / RAdam on the toy,
    every element-wise optimizer on the Sequential; with torch's DDP or zerolab's."""
    _, _, kind, opt, form = case
    ref = reference(kind, opt, form)
    rs = results(ranks, case)
    assert_ranks_agree(rs, case)
    for rank, r in enumerate(rs):
        assert_close(r["state"], ref["state"], ATOL, f"{case} rank {rank}")


@cases(ZRO_CASES, impl=ZEROLAB)
def test_zero_redundancy_optimizer_matches_torchs(ranks, case):
    theirs = results(ranks, ("zro", "torch", *case[2:]))
    for rank, r in enumerate(results(ranks, case)):
        assert_close(r["state"], theirs[rank]["state"], ATOL, f"{case} rank {rank}")


@cases(ZRO_CASES, opt=("adamw", "sgd"))
def test_zero_redundancy_optimizer_keeps_a_shard_of_the_state(ranks, case):
    """Each rank holds optimizer state for part of the Ψ trainable elements, together all of
    them: torch's splits whole parameters between ranks; zerolab's holds its 1/N range of the
    flat elements of every parameter handed in (frozen ones count in the split but hold no
    state; up to N - 1 elements of padding)."""
    _, impl, kind, opt, _ = case
    psi, psi_all = numels(kind)
    per_elem = {"adamw": 2, "sgd": 1}[opt]          # exp_avg, exp_avg_sq / momentum_buffer
    got = [r["state_numel"] for r in results(ranks, case)]
    assert per_elem * psi <= sum(got) <= per_elem * (psi + N - 1), got
    for n in got:
        assert 0 < n < per_elem * psi, got
        if impl != "torch":
            assert n <= per_elem * math.ceil(psi_all / N), got


@cases(REFUSE_CASES)
def test_zero_redundancy_optimizer_refuses_non_elementwise_in_one_line(ranks, case):
    for rank, r in enumerate(results(ranks, case)):
        assert r["raised"] == "ValueError", (case, rank, r)
        assert "\n" not in r["message"].strip() and case[1] in r["message"], r["message"]


# --- fully_shard -----------------------------------------------------------------------------------


def fsdp_ref(case):
    _, _, kind, opt, _, variant = case
    return reference(kind, opt, accum=ACCUM if variant == "accum" else 1)


@cases(FSDP_CASES, dtype="fp32")
def test_fully_shard_full_state_dict_matches_the_single_process_loop(ranks, case):
    """fp32, plain and set_requires_gradient_sync(False) accumulation: the full state dict -
    every key of the model's state_dict, tied and frozen ones included - on every rank."""
    ref = fsdp_ref(case)
    rs = results(ranks, case)
    assert_ranks_agree(rs, case)
    for rank, r in enumerate(rs):
        assert_close(r["state"], ref["state"], ATOL, f"{case} rank {rank}")


@cases(FSDP_CASES, dtype="fp32", impl=ZEROLAB)
def test_fully_shard_matches_torch_fsdp2(ranks, case):
    theirs = results(ranks, ("fsdp", "torch", *case[2:]))
    for rank, r in enumerate(results(ranks, case)):
        assert_close(r["state"], theirs[rank]["state"], ATOL, f"{case} rank {rank}")


def max_shard(params) -> int:
    """FSDP2's largest local shard of `params`: ceil(rows / N) rows of each."""
    return sum(math.ceil(p.shape[0] / N) * (p.numel() // p.shape[0]) for p in params)


@cases(FSDP_CASES, dtype="fp32")
def test_fully_shard_parameters_are_shards_with_sharded_grads(ranks, case):
    """The trainable model.parameters() hold about 1/N of the trainable elements; together the
    ranks' shards are the whole model and the ranks' gradient shards the whole averaged gradient
    (same sum of squares: what clip_grad_norm_ over model.parameters() computes, so padding must
    read zero). dim-0 layouts (FSDP2's, zerolab's "dim0") hold torch.chunk(full, N)[rank] of each
    parameter and of its gradient; fp32 shards keep fp32 gradients."""
    kind, layout = case[2], case[1]
    ref = fsdp_ref(case)
    trainable = {k: p for k, p in build(kind).named_parameters() if p.requires_grad}
    psi = sum(p.numel() for p in trainable.values())
    sq_params = sq_grads = 0.0
    for rank, r in enumerate(results(ranks, case)):
        assert r["dtypes"] == ["torch.float32"], r["dtypes"]
        held = {k: r["shards"][k] for k in r["trainable"]}
        numel = sum(t.numel() for t in held.values())
        assert numel <= max_shard(trainable.values()) + N * len(trainable), (rank, numel, psi)
        assert numel < 0.75 * psi, (rank, numel, psi)
        sq_params += sum(t.double().square().sum().item() for t in held.values())
        sq_grads += sum(g.double().square().sum().item() for g in r["grads0"].values()
                        if g is not None)
        if layout not in ("torch", "dim0"):
            continue
        assert set(r["trainable"]) == trainable.keys(), r["trainable"]
        for k, full in trainable.items():
            chunks = ref["init"][k].chunk(N)
            chunk = chunks[rank] if rank < len(chunks) else ref["init"][k][:0]
            got = r["shards"][k]
            assert got.shape[1:] == full.shape[1:], (k, got.shape)
            assert got.shape[0] in (chunk.shape[0], math.ceil(full.shape[0] / N)), (k, got.shape)
            assert torch.equal(got[:chunk.shape[0]], chunk), (rank, k)
            gchunk = ref["grads0"][k].chunk(N)[rank] if rank < len(chunks) else chunk
            g = r["grads0"][k]
            assert g is not None and g.shape == got.shape, (rank, k)
            assert (g[:gchunk.shape[0]] - gchunk).abs().max().item() <= ATOL, (rank, k)
    want_p = sum(ref["init"][k].double().square().sum().item() for k in trainable)
    want_g = sum(g.double().square().sum().item() for g in ref["grads0"].values() if g is not None)
    assert sq_params == pytest.approx(want_p, rel=1e-9), "the shards are not the whole model"
    assert sq_grads == pytest.approx(want_g, rel=1e-5), \
        "the gradient shards are not the whole averaged gradient"


@cases(FSDP_CASES, dtype="fp32", model="toy", opt="sgd", last="plain")
def test_fully_shard_frozen_parameters(ranks, case):
    """FSDP2 shards every parameter, requires_grad or not (the frozen blocks.1.fc.weight and the
    fixed gain): each rank holds about 1/N of them. zerolab keeps them whole and replicated
    (documented in zerolab.torchlike.fully_shard): each rank holds rank 0's full values, and
    they get no gradient - the numerics are torch's either way (tests above)."""
    frozen = [p for p in build(case[2]).parameters() if not p.requires_grad]
    for rank, r in enumerate(results(ranks, case)):
        held = [k for k in r["shards"] if k not in r["trainable"]]
        numel = sum(r["shards"][k].numel() for k in held)
        assert all(r["grads0"][k] is None for k in held), rank
        if case[1] == "torch":
            assert 0 < numel <= max_shard(frozen) + N * len(frozen), \
                (rank, {k: tuple(r["shards"][k].shape) for k in held})
        else:
            assert numel == sum(p.numel() for p in frozen), rank
            first = results(ranks, case)[0]
            assert all(torch.equal(r["shards"][k], first["shards"][k]) for k in held), rank


# bf16 compute (MixedPrecisionPolicy(param_dtype=torch.bfloat16)): the forward and backward run in
# bf16 (8-bit significand, relative rounding 2^-8 = 0.4%), and where each implementation casts
# and in which order it sums changes the gradient by a few such roundings - per element, not
# systematically. Tolerances, stated in what they are compared to:
# - SGD: the update is proportional to the gradient, so the weights differ by a few percent of
#   how far they moved: 5% of the largest movement of the fp32 single-process loop.
# - AdamW: its first updates are about lr * sign(gradient) whatever the gradient's size, so an
#   element whose bf16 gradient is near zero can step the other way: 2 * lr per step.
def bf16_atol(case):
    _, _, kind, opt, _, _ = case
    if opt == "adamw":
        return 2 * OPTS["adamw"][1]["lr"] * STEPS
    ref = reference(kind, opt)
    return 0.05 * max((ref["state"][k] - ref["init"][k]).abs().max().item() for k in ref["init"])


@cases(FSDP_CASES, dtype="bf16")
def test_fully_shard_bf16_compute_is_close_to_the_fp32_loop(ranks, case):
    ref = fsdp_ref(case)
    for rank, r in enumerate(results(ranks, case)):
        assert r["out_dtype"] == "torch.bfloat16", r["out_dtype"]
        assert r["dtypes"] == ["torch.float32"], r["dtypes"]      # fp32 shards, fp32 grads
        assert_close(r["state"], ref["state"], bf16_atol(case), f"{case} rank {rank}")


@cases(FSDP_CASES, dtype="bf16", impl=ZEROLAB)
def test_fully_shard_bf16_matches_torch_fsdp2(ranks, case):
    theirs = results(ranks, ("fsdp", "torch", *case[2:]))
    for rank, r in enumerate(results(ranks, case)):
        assert r["out_dtype"] == theirs[rank]["out_dtype"] and r["dtypes"] == theirs[rank]["dtypes"]
        assert_close(r["state"], theirs[rank]["state"], bf16_atol(case), f"{case} rank {rank}")


# --- bytes held on each rank: the notes' table for a torch optimizer --------------------------------
# fp32 weights and a torch optimizer (no separate master copy): params 4 bytes, grads 4 bytes and
# the optimizer's per-element state (AdamW: exp_avg + exp_avg_sq = 8 bytes; SGD with momentum: 4)
# per trainable element - 16Ψ for AdamW, the notes' 2 + 2 + 12 regrouped - and each stage divides
# what it shards by N (padded to whole shards, counted: zerolab pads, it does not hide it).
STATE_BYTES = {"adamw": 8, "sgd": 4}


def trainable(kind):
    model = build(kind)
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters() if not p.requires_grad))


@cases(DDP_CASES, impl="zerolab")
def test_ddp_holds_16_psi(ranks, case):
    psi, frozen = trainable(case[2])
    for rank, r in enumerate(results(ranks, case)):
        held = r["held"]
        assert held["params"] == 4 * (psi + frozen), rank
        assert 4 * psi <= held["grads"] < 4 * (psi + N * 8), rank       # + bucket padding
        assert held["optimizer"] == STATE_BYTES[case[3]] * psi, rank


@cases(ZRO_CASES, impl="zl+zlddp", opt=tuple(STATE_BYTES))
def test_zero_redundancy_optimizer_holds_states_over_n(ranks, case):
    psi, frozen = trainable(case[2])
    rs = results(ranks, case)
    per = STATE_BYTES[case[3]]
    total = sum(r["held"]["optimizer"] for r in rs)
    assert total == per * psi, [r["held"] for r in rs]     # every element's state, once
    for r in rs:
        # one flat buffer per group (frozen parameters given to it included), padded to N
        assert 4 * (psi + frozen) <= r["held"]["params"] < 4 * (psi + frozen + 2 * N)
        assert r["held"]["optimizer"] <= per * (math.ceil((psi + frozen) / N) + 1)


@cases(FSDP_CASES, dtype="fp32", impl=ZEROLAB, last="plain")
def test_fully_shard_holds_16_psi_over_n(ranks, case):
    psi, frozen = trainable(case[2])
    rs = results(ranks, case)
    assert sum(r["real_numel"] for r in rs) == psi
    for rank, r in enumerate(rs):
        held = r["held"]
        assert held["params"] == 4 * (r["shard_numel"] + frozen), rank     # padding included
        assert held["grads"] == 4 * r["shard_numel"], rank
        assert held["optimizer"] == STATE_BYTES[case[3]] * r["real_numel"], rank
        assert r["shard_numel"] <= math.ceil(psi / N) + max_padding(case[1], case[2]), rank


def max_padding(layout, kind):
    """Padding a rank's shard may hold: < N elements per unit ("flat"), < one row per parameter
    and rank ("dim0")."""
    model = build(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    if layout == "flat":
        return N * len(params)
    return sum(p.numel() // max(p.shape[0], 1) if p.dim() else 1 for p in params)


# --- torch's argument lists, as an outside suite would pass them -----------------------------------
def test_ddp_takes_torchs_positional_arguments(ranks):
    """DistributedDataParallel(module, device_ids, output_device, dim, broadcast_buffers,
    init_sync, process_group, bucket_cap_mb, find_unused_parameters, check_reduction,
    gradient_as_bucket_view, static_graph): torch's order; the loop equals one process, and the
    wrapper's state_dict keys are torch DDP's ("module." + the module's)."""
    ref = reference("toy", "sgd")
    for rank, r in enumerate(results(ranks, ("api", "ddp-positional"))):
        assert_close(r["state"], ref["state"], ATOL, f"rank {rank}")
        assert r["keys"] == sorted("module." + k for k in build("toy").state_dict()), rank


def test_fully_shard_mesh_and_ignored_params_as_fsdp2(ranks):
    """mesh= and ignored_params=: the ignored parameter stays whole and its gradient is not
    reduced (each rank's own, as in FSDP2: the replicas of it differ); everything else equals
    FSDP2 on the same loop."""
    rs = results(ranks, ("api", "fsdp-mesh-ignored"))
    for rank, r in enumerate(rs):
        assert r["zerolab"]["bias_shape"] == r["torch"]["bias_shape"] == (Toy.dim,), rank
        assert torch.allclose(r["zerolab"]["bias"], r["torch"]["bias"], atol=ATOL), rank
        theirs = {k: v for k, v in r["torch"]["state"].items() if k != "blocks.0.fc.bias"}
        assert_close({k: r["zerolab"]["state"][k] for k in theirs}, theirs, ATOL, f"rank {rank}")
    assert not torch.equal(rs[0]["zerolab"]["bias"], rs[1]["zerolab"]["bias"])


@pytest.mark.parametrize("name", sorted(API_REFUSED))
def test_wrappers_refuse_what_they_do_not_offer_in_one_line(ranks, name):
    for rank, r in enumerate(results(ranks, ("api", name))):
        assert r["raised"] in ("ValueError", "TypeError"), (name, rank, r)
        assert "\n" not in r["message"].strip() and API_REFUSED[name] in r["message"], r["message"]


# --- what a new user's trial found (the example of each kind made a test) -----------------------
@pytest.mark.parametrize("what", ["unused", "skip", "clip"])
def test_zerolab_equals_torch_where_the_trial_found_differences(ranks, what):
    """A parameter no rank used keeps p.grad None (torch's optimizers then skip it: no momentum,
    no weight decay), under DDP with find_unused_parameters=True and under fully_shard with a
    block skipped; clip_grad_norm_(model.parameters()) under fully_shard clips by the global
    norm, as FSDP2's DTensor gradients do. Each equals torch's class on every rank."""
    theirs, ours = (results(ranks, ("found", what, impl)) for impl in ("torch", "zerolab"))
    for rank, (t, z) in enumerate(zip(theirs, ours)):
        assert z["grad_none"] == t["grad_none"], (rank, z["grad_none"], t["grad_none"])
        assert z["norms"] == pytest.approx(t["norms"], rel=1e-6), rank
        assert_close(z["state"], t["state"], ATOL, f"{what} rank {rank}")
    if what != "clip":
        assert any(t["grad_none"]) and not all(t["grad_none"])     # the case really happened
