"""The optional track, exercises (i) and (j): the learner writes a whole strategy class.

(i) strategy_ddp: `BucketedDDP(model, comm, bucket_cap_mb)` puts gradient buckets on the model
    and starts each bucket's all_reduce from a post-accumulate-grad hook, while backward still
    runs; `finish()` (after `loss.backward()`) waits and leaves the average in every p.grad.
(j) strategy_zero1: `ShardedAdamW(param_groups, comm, lr, betas, eps)` keeps AdamW's state for
    this rank's 1/N range of each group only; `step()` updates that range, then all_gathers.
The interfaces are documented in the skeletons (skeletons/strategy_ddp.py, strategy_zero1.py).

On N gloo ranks (`track_worker`) the check drives the learner's class with torch alone (the loop
of the skeleton's header: GPT nano, fp32, STEPS steps, clipping at MAX_NORM) and grades:
1. correctness: after every step every parameter on every rank equals
   `zerolab.course.testing.reference` (torch's AdamW on the whole global batch) within ATOL; (i)
   also the global gradient norm (summed gradients instead of averaged show there);
2. bytes: the ledger against `theory.traffic_bytes` (each gradient all-reduced once; each
   parameter all-gathered once, up to the padding) and, (i), buckets of at most the cap, fewer
   collectives than parameters; (j), the tensors the optimizer keeps between steps (found by
   walking the object) against ZeRO-1's 12Ψ/N (`theory.model_state_bytes`);
3. time on the emulated link (`timing.linkemu`): (i) every gradient all_reduce is issued during
   `loss.backward()`, and on a model whose blocks sleep a set time (`SleepNet`: the machine's
   load cannot stretch it) backward + finish() exposes (takes longer than the same backward
   without DDP) at most half way between the model's overlap and no-overlap times
   (`overlap_times`: about one all_reduce, and all of them); (j) the step's
   all_gathers take no longer than MAX_GATHERS collectives would (each pays (n-1)·α).
The reference solutions live in tests/exercise_solutions/ (used by the tests only).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

from ... import theory
from ...timing import costmodel, hardware
from .checker import ATOL, CALL_TIMEOUT, MAX_NORM, STEPS, learner_functions
from .outcome import failure, unrun

ROWS = 2                                    # rows of the global batch per rank and step
CAP_MB = 0.03                               # (i): 7,864 fp32 gradients a bucket on GPT nano
SLEEP_LINK = hardware.get_link(gbps=0.1, latency_us=200)     # (i): 12.5 MB/s
SLEEP_BLOCKS, SLEEP_DIM, FWD_S, BWD_S, TIMED = 4, 320, 0.005, 0.05, 3
GATHER_LINK = hardware.get_link(gbps=1.0, latency_us=5000)   # (j): α = 5 ms a ring step
MAX_GATHERS = 6                             # (j): one per parameter group is 2


# --- a model whose compute time the machine's load cannot stretch (as tests/test_linkemu.py) ----
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepNet(nn.Module):
    """SLEEP_BLOCKS blocks Linear(dim, dim)(sleep(x)): each sleeps FWD_S in forward and BWD_S in
    backward, after its Linear's gradients are ready (autograd runs the Linear's backward first;
    the input needs a gradient, so that block 0's sleep runs in backward too)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(SLEEP_DIM, SLEEP_DIM) for _ in range(SLEEP_BLOCKS))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(_Sleep.apply(x, FWD_S, BWD_S))
        return (x - y).pow(2).mean()


def overlap_times(n: int) -> tuple[float, float, float]:
    """(with overlap, without, one all_reduce): seconds of communication left exposed after
    SleepNet's backward, one bucket a block. With overlap, bucket k's all_reduce starts when
    block k's backward is done (autograd may run its hooks even earlier) or the link is free:
    about the last all_reduce stays exposed. Without: every all_reduce's time."""
    comm = costmodel.collective_time("all_reduce", 4 * (SLEEP_DIM + 1) * SLEEP_DIM, n, SLEEP_LINK)
    free = 0.0
    for k in range(SLEEP_BLOCKS):
        free = max((k + 1) * BWD_S, free) + comm
    return free - SLEEP_BLOCKS * BWD_S, SLEEP_BLOCKS * comm, comm


# --- what an object keeps: every tensor reachable from it, but not the model's own ---------------
def held_bytes(obj, exclude) -> int:
    """Bytes of the distinct storages of the tensors reachable from `obj` (attributes, lists,
    dicts, torch optimizers' state), leaving out storages in `exclude` (data_ptrs)."""
    from ...comm import Comm
    seen, storages, stack = set(), {}, [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (nn.Module, Comm, type)) or callable(o) \
                and not isinstance(o, torch.Tensor):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.nbytes() and s.data_ptr() not in exclude:
                storages[s.data_ptr()] = s.nbytes()
            if o.grad is not None:
                stack.append(o.grad)
        elif isinstance(o, dict):
            stack += [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif isinstance(o, torch.optim.Optimizer):
            stack += [o.state, o.param_groups]
        elif hasattr(o, "__dict__") and not type(o).__module__.startswith("torch"):
            stack.append(vars(o))
    return sum(storages.values())


# --- inside each rank ---------------------------------------------------------------------------
def _correctness(rank, n, name, cls, found):
    import torch.distributed as dist

    from .. import testing
    from ...comm import Comm
    from ...sharding import make_optimizer
    job = dict(model="nano", precision="fp32", grad_accum=1, rows_per_micro=ROWS, max_norm=MAX_NORM)
    ref = testing.reference(job, n, STEPS, history=True)
    dist.barrier()                          # together from here: call_timeout is per call
    model, comm = testing.make_model("nano"), Comm()
    params = [p for p in model.parameters() if p.requires_grad]
    psi = sum(p.numel() for p in params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": testing.WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if name == "strategy_ddp":
        strategy = cls(model, comm, CAP_MB)
        opt = make_optimizer(params, lr=testing.LR, betas=testing.BETAS, eps=testing.EPS,
                             weight_decay=testing.WD)
    else:
        opt = cls(groups, comm, testing.LR, testing.BETAS, testing.EPS)
    mine = {p.untyped_storage().data_ptr() for p in params}
    stats = {"psi": psi}

    def finding(step, kind, text):
        found.append({"step": step, "rank": rank, "kind": kind, "text": text})

    for step in range(STEPS):
        comm.step = step
        for p in params:
            p.grad = None
        x, y = testing.global_batch(model, step, n * ROWS)
        comm.current_phase = "forward"
        loss = model(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS])
        comm.current_phase = "backward"
        loss.backward()
        if name == "strategy_ddp":
            comm.current_phase = "finish"
            strategy.finish()
        else:                                   # (j): the gradients averaged outside the ledger
            for p in params:
                dist.all_reduce(p.grad)
                p.grad.div_(n)
        comm.current_phase = "step"
        norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
        opt.step()
        records = [r for r in comm.records if r.step == step]
        if name == "strategy_ddp":
            _ddp_bytes(step, n, psi, params, records, norm, ref["norms"][step], finding, stats)
        else:
            _zero1_bytes(step, n, psi, records, held_bytes(opt, mine | {
                p.grad.untyped_storage().data_ptr() for p in params}), finding, stats)
        diff = testing.first_difference({k: v.detach().float() for k, v in
                                         model.named_parameters()}, ref["history"][step], ATOL)
        if diff is not None:
            pname, index, expected, value, largest = diff
            where = f"{pname}[{', '.join(map(str, index))}]" if index else pname
            finding(step, "parameters", f"parameter {where} = {value:.7g}, expected "
                    f"{expected:.7g} (single-process torch AdamW on the same global batch); "
                    f"largest difference {largest:.2g} > {ATOL:g}")
        flag = torch.tensor([float(bool(found))])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
    return stats


def _ddp_bytes(step, n, psi, params, records, norm, want_norm, finding, stats):
    ars = [r for r in records if r.op == "all_reduce"]
    late = [r for r in ars if r.phase != "backward"]
    if abs(norm - want_norm) > 2e-6 * abs(want_norm):
        why = ("the gradients are summed, not averaged: divide by world_size"
               if abs(norm / want_norm - n) < 0.01 * n else
               "a gradient is lost, stale or counted twice")
        finding(step, "gradient norm", f"global gradient norm {norm:.7g}, expected "
                f"{want_norm:.7g} (torch's clip_grad_norm_ on the global batch): {why}")
    numel = sum(r.numel for r in ars)
    want = theory.traffic_bytes(psi, n, 0, "fp32")["all_reduce"]
    cap = max(CAP_MB * theory.MIB / 4, max(p.numel() for p in params))
    stats.update(all_reduces=len(ars), sent=sum(r.bytes for r in ars), want=want)
    if not ars:
        finding(step, "bytes sent", "no all_reduce in this step: the gradients must be averaged")
    elif late:
        finding(step, "overlap", f"{len(late)} of {len(ars)} all_reduces were issued after "
                f"loss.backward() returned (in finish()): start each bucket's all_reduce from "
                f"the hook of its last gradient, so that it runs during the rest of backward")
    elif not psi <= numel <= psi + n * len(ars):
        finding(step, "bytes sent", f"the all_reduces carried {numel:,} gradient elements; "
                f"every gradient once is Ψ = {psi:,}: 2(n-1)/n × 4Ψ = {want:,.0f} bytes "
                f"(theory.traffic_bytes), you sent {stats['sent']:,.0f}")
    elif len(ars) >= len(params):
        finding(step, "buckets", f"{len(ars)} all_reduces for {len(params)} parameters: merge "
                f"parameters into buckets of up to bucket_cap_mb = {CAP_MB} MiB")
    elif max(r.numel for r in ars) > cap + n:
        finding(step, "buckets", f"an all_reduce of {max(r.numel for r in ars):,} elements "
                f"({4 * max(r.numel for r in ars):,} bytes) exceeds bucket_cap_mb = {CAP_MB} "
                f"MiB ({CAP_MB * theory.MIB:,.0f} bytes) and holds more than one parameter")


def _zero1_bytes(step, n, psi, records, held, finding, stats):
    other = [r for r in records if r.op != "all_gather"]
    gathers = [r for r in records if r.op == "all_gather"]
    numel = sum(r.numel for r in gathers)
    want = theory.traffic_bytes(psi, n, 1, "fp32")["all_gather"]
    limit = sum(theory.model_state_bytes(psi, n, 1, "fp32")[s]
                for s in ("master_weights", "exp_avg", "exp_avg_sq"))
    slack = 12 * n * max(len(gathers), 2) + 4096     # padding, AdamW's step counters
    stats.update(all_gathers=len(gathers), sent=sum(r.bytes for r in gathers), want=want,
                 held=held, limit=limit)
    if other:
        finding(step, "bytes sent", f"{other[0].op} of {other[0].numel:,} elements in the step: "
                f"ZeRO-1's update needs only an all_gather of every rank's range")
    elif not psi <= numel <= psi + n * len(gathers):
        finding(step, "bytes sent", f"the all_gathers carried {numel:,} elements; every "
                f"parameter once is Ψ = {psi:,}: (n-1)/n × 4Ψ = {want:,.0f} bytes "
                f"(theory.traffic_bytes, stage 1)")
    if held > limit + slack:
        finding(step, "bytes held", f"your optimizer keeps {held:,} bytes of tensors between "
                f"steps; ZeRO-1 keeps master, exp_avg and exp_avg_sq of 1/N of Ψ: 12Ψ/N = "
                f"{limit:,.0f} (theory.model_state_bytes, Ψ = {psi:,}, N = {n}). Keep only "
                f"your range's state; full-size buffers are temporaries of step()")


def _timing(rank, n, name, cls):
    import torch.distributed as dist

    from .. import testing
    from ...comm import Comm
    from ...timing.linkemu import LinkEmulator
    comm = Comm()
    comm.all_reduce(torch.ones(1), what="metric")           # gloo connects on the first call
    times = []
    if name == "strategy_ddp":             # exposed = (backward + finish) - bare backward
        torch.manual_seed(0)
        model, bare = SleepNet(), SleepNet()
        comm.link = LinkEmulator(SLEEP_LINK, n)
        cap = 1.2 * 4 * (SLEEP_DIM + 1) * SLEEP_DIM / theory.MIB        # one block a bucket
        ddp = cls(model, comm, cap)
        x = torch.randn(2, SLEEP_DIM, generator=torch.Generator().manual_seed(rank))
        for _ in range(1 + TIMED):
            took = []
            for m in (bare, model):
                m.zero_grad(set_to_none=True)
                loss = m(x.clone().requires_grad_(), x.flip(1))
                dist.barrier()
                t0 = time.perf_counter()
                loss.backward()
                if m is model:
                    ddp.finish()
                took.append(time.perf_counter() - t0)
            times.append(took[1] - took[0])
        return {"time": statistics.median(times[1:])}
    model = testing.make_model("nano")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": testing.WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = cls(groups, comm, testing.LR, testing.BETAS, testing.EPS)
    comm.link = LinkEmulator(GATHER_LINK, n)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    for _ in range(1 + TIMED):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"time": statistics.median(times[1:]),
            "ideal": sum(costmodel.collective_time("all_gather", 4 * sum(p.numel() for p in
                                                                          g["params"]),
                                                   n, GATHER_LINK) for g in groups)}


def track_worker(rank, n, pairs):
    """For each (name, impl): load the learner's class, grade correctness and bytes, then time.
    Returns [{"findings", "stats", "time", "calls"}] in the order of `pairs` (calls: of the
    class's methods, sandbox.marked)."""
    import torch.distributed as dist

    from . import sandbox
    from .table import EXERCISES
    out = []
    for name, impl in pairs:
        ex, before = EXERCISES[name], sandbox.calls()
        cls = sandbox.marked(learner_functions(ex, impl))[ex.functions[0]]
        found = []
        stats = _correctness(rank, n, name, cls, found)
        timing = {} if found else _timing(rank, n, name, cls)
        calls = {k: v - before.get(k, 0) for k, v in sandbox.calls().items()}
        out.append({"findings": found, "stats": stats, "time": timing, "calls": calls})
        dist.barrier()
    return out


def _methods(name: str) -> list[str]:
    """"Class.method" of each method the skeleton's class defines: each must run on every rank."""
    import inspect

    from .table import EXERCISES
    from .checker import load_impl
    ex = EXERCISES[name]
    cls = getattr(load_impl(str(ex.skeleton), f"{name}_skeleton"), ex.functions[0])
    return [f"{ex.functions[0]}.{k}" for k, v in vars(cls).items() if inspect.isfunction(v)]


# --- in the parent ------------------------------------------------------------------------------
def _lines(name: str, n: int, per_rank: list[dict]) -> tuple[bool, list[str]]:
    found = [f for r in per_rank for f in r["findings"]]
    if found:
        first = min(f["step"] for f in found)
        lines = [f"step {first + 1} of {STEPS}, the first that differs:"]
        shown = set()
        for f in sorted((f for f in found if f["step"] == first), key=lambda f: f["rank"]):
            if f["kind"] not in shown:
                shown.add(f["kind"])
                ranks = sorted({g["rank"] for g in found if g["step"] == first
                                and g["kind"] == f["kind"]})
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                lines.append(f"{who}: {f['kind']}: {f['text']}")
        return False, lines
    missed = unrun(_methods(name), [r["calls"] for r in per_rank])
    if missed:                              # what did not run was not graded: no PASS
        return False, missed
    stats, t = per_rank[0]["stats"], max(r["time"]["time"] for r in per_rank)
    ok = [f"every parameter on every rank equals single-process torch AdamW after each of "
          f"{STEPS} steps (GPT nano, fp32, {n} ranks)"]
    if name == "strategy_ddp":
        with_, without, one = overlap_times(n)
        limit = (with_ + without) / 2
        ok.append(f"{stats['all_reduces']} gradient all_reduces a step, all issued during "
                  f"backward, {stats['sent']:,.0f} bytes sent = 2(n-1)/n × 4Ψ at Ψ = "
                  f"{stats['psi']:,} (theory.traffic_bytes)")
        timing = (f"on the emulated link ({SLEEP_LINK.gbps:g} Gb/s; {SLEEP_BLOCKS} blocks that "
                  f"sleep {BWD_S * 1e3:g} ms in backward, an all_reduce of a block "
                  f"{one * 1e3:.0f} ms) backward + finish() took {t * 1e3:.0f} ms longer than the "
                  f"same backward without DDP; the model says {with_ * 1e3:.0f} ms with overlap, "
                  f"{without * 1e3:.0f} ms without; the check asks <= {limit * 1e3:.0f} ms (half "
                  f"way)")
        if t > limit:
            return False, [timing, "the all_reduces do not overlap backward: does your hook "
                           "wait for its all_reduce (async_op=False, or handle.wait() in the "
                           "hook)? Wait only in finish()"]
        return True, [*ok, timing]
    ideal = max(r["time"]["ideal"] for r in per_rank)
    limit = MAX_GATHERS / 2 * ideal + 0.03
    ok.append(f"{stats['all_gathers']} all_gathers a step, {stats['sent']:,.0f} bytes sent = "
              f"(n-1)/n × 4Ψ at Ψ = {stats['psi']:,} up to the padding; the optimizer keeps "
              f"{stats['held']:,} bytes between steps, ZeRO-1's 12Ψ/N = {stats['limit']:,.0f}")
    timing = (f"on the emulated link (α = {GATHER_LINK.latency * 1e3:g} ms a ring step) step() "
              f"took {t * 1e3:.0f} ms; one all_gather per parameter group takes "
              f"{ideal * 1e3:.0f} ms; the check asks <= {limit * 1e3:.0f} ms "
              f"({MAX_GATHERS} all_gathers + 30 ms)")
    if t > limit:
        return False, [timing, "too many collectives: each pays (n-1)·α however small it is; "
                       "all_gather one flat buffer per parameter group, not parameter by parameter"]
    return True, [*ok, timing]


def grade_many(pairs, nproc: int = 3, timeout: float = 120.0,
               call_timeout: float = CALL_TIMEOUT) -> list[tuple[bool, list[str]]]:
    """(ok, lines) for each (name, impl) of the track, graded in ONE group of ranks (impls known
    to load; `checker.run_check` reports load errors and exceptions with the learner's line)."""
    from . import sandbox
    per_item = [r["result"] for r in sandbox.run_ranks(track_worker, nproc, list(pairs),
                                                       timeout=timeout, call_timeout=call_timeout)]
    return [_lines(name, nproc, [r[k] for r in per_item]) for k, (name, _) in enumerate(pairs)]


def grade(name: str, impl: str, nproc: int, timeout: float, call_timeout: float = CALL_TIMEOUT):
    """(ok, lines) for one track exercise, called by checker.run_check (its judge has loaded
    the file): failures in one line (`outcome.failure`)."""
    from .. import testing
    try:
        (result,) = grade_many([(name, impl)], nproc, timeout, call_timeout)
    except testing.RanksFailed as err:
        return False, failure(err, impl)[0]
    return result
