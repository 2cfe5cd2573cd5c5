"""Will it fit? The per-rank peak of one training step, predicted before anything is launched.

Idea: the formulas (`theory.model_state_bytes`) give the model states, but a rank's peak also
holds the activations that the forward keeps for backward, the stage's transients (ZeRO-3's
gathered blocks, gradient buckets, reduce_scatter outputs, fp32 gradient copies) and the
backward's temporaries. This module runs the very step `zerolab train` runs - the same model,
the same strategy (`stage.make_strategy`), the same micro-steps - on the meta device (shapes
and dtypes, no storage) in one process, rank `rank` of torch's fake process group of N ranks
(`timing.whatif.fake_world`). Torch's own `MemTracker` follows every tensor the step creates and
frees, as it does in the real run (`memory.allocator_peak`), so a 70B model costs nothing to ask
about. From that one simulated step it reports, per stage:

- model states: the formula at the padded Ψ (`theory.model_state_bytes`);
- activations: the bytes one micro-batch's forward leaves alive for backward, counted at the
  real shapes (not a fixed formula);
- transients: the memory meter's peak of each transient category during the step;
- peak: MemTracker's largest total over the step; the rest of it (backward's temporaries:
  activation gradients, the loss's fp32 logits) is peak minus the three parts above.

Then: fits or not on `--device-memory`, the largest micro-batch that fits (`largest_rows`:
simulations at widening, then halving, rows per rank), the smallest N at which each stage fits
(`smallest_world`: the formula proposes N, simulations confirm it), and the options that would
make a refused run fit (`advice`, also what `zerolab train` says when it refuses: `check_fits`).

    zerolab fit --preset 1b --stages 0,1,2,3 --world-size 8 --batch-size 8 --device-memory h100
    zerolab fit --model mypkg.nets:build --stage 3 --world-size 64 --device-memory 24 --json

Attention runs the kernel the CPU would run (`cpu_attention`): on the meta device torch would
pick the math kernel, which keeps the s x s scores.
What it cannot know is listed in `UNKNOWN`, said as such. Errors: ValueError, one line naming
the bad value and what is accepted (`zerolab fit` exits 2).
"""
from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.nn.functional as F

from .. import theory
from ..comm import Comm
from ..data import rank_slice
from ..model import GPT, PRESETS
from ..timing.whatif import MAX_WORLD, _MetaMeter, fake_world
from . import options
from .fittarget import GB, Target, gpt_target, target_of  # noqa: F401 - Target: fit's own name
from .options import DTYPES

#: what the prediction cannot know, one line each (printed under every table)
UNKNOWN = (
    "GPU runtime: the CUDA context, cuBLAS workspaces and NCCL buffers are outside the step's "
    "tensors; on one H200 (torch 2.11) cuBLAS alone kept 2 x 32 MiB + 1 MiB "
    "(zerolab/run/stage.py, before_stage)",
    "GPU allocator: the caching allocator rounds blocks up and keeps freed ones, so "
    "memory_reserved sits above this peak by an amount that depends on the order of frees",
    "GPU attention: flash or memory-efficient kernels on CUDA save other tensors than the "
    "CPU's flash kernel simulated here",
    "the data: the simulated batch is the global batch of token ids, as zerolab train builds it; "
    "a data loader's own buffers are not seen",
    "other processes on the device, and this machine's free memory when the run starts",
)


# --- attention as the target device runs it --------------------------------------------------
@contextlib.contextmanager
def cpu_attention():
    """Inside the block, F.scaled_dot_product_attention on meta tensors runs the CPU's flash
    kernel, as a real CPU run does (`torch._fused_sdp_choice` picks it there; on the meta device
    torch falls back to the math kernel, which keeps the B x H x s x s scores for backward).
    The function itself is replaced for the block, not a torch-function mode: activation
    checkpointing recomputes the forward inside backward, where such a mode is not active."""
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if q.device.type == "meta" and attn_mask is None and not kw.get("enable_gqa"):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, scale=scale)[0]
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def checkpoint_blocks(model, every: int):
    """Activation checkpointing of every `every`-th block (blocks 0, k, 2k, ...): the course's
    GPT by its own flag per block; another model by wrapping each `zero_units()` module's
    forward in torch.utils.checkpoint (non-reentrant), so the strategies' module hooks still fire
    once per pass."""
    from torch.utils.checkpoint import checkpoint
    blocks = model.zero_units() if hasattr(model, "zero_units") else []
    for i, (_, block) in enumerate(blocks):
        if i % every:
            continue
        if hasattr(block, "activation_checkpointing"):
            block.activation_checkpointing = True
        else:
            inner = block.forward

            def forward(*a, _inner=inner, **kw):
                if torch.is_grad_enabled():
                    return checkpoint(_inner, *a, use_reentrant=False, **kw)
                return _inner(*a, **kw)
            block.forward = forward


# --- one simulated step ------------------------------------------------------------------------
def mem_tracker(model, *external):
    """torch's MemTracker with `model` and `external` registered as held before the step.
    Frozen parameters are marked as already hooked: MemTracker puts a gradient hook on every
    parameter a module holds, and torch refuses a hook on a tensor that needs no gradient
    ("cannot register a hook on a tensor that doesn't require gradient")."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, *external)
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if handles is not None:
        for p in model.parameters():
            if not p.requires_grad:
                handles[p] = (_NoHook(), _NoHook())
    return tracker


class _NoHook:
    """Stands for a hook handle where none was installed (`mem_tracker`)."""

    def remove(self):
        pass


def _total(tracker, kind: str) -> int:
    snap = tracker.get_tracker_snapshot(kind)
    return sum(int(v) for stats in snap.values() for k, v in stats.items()
               if str(k).split(".")[-1].lower() == "total")


def simulate(args, stage: int, world_size: int, rows: int, target: Target | None = None,
             rank: int = 0, every: int | None = None) -> dict:
    """One training step of `stage` for rank `rank` of a fake world of `world_size`, `rows`
    rows per micro-step, --grad-accum micro-steps, on the meta device. After a first step when
    --steps > 1 (AdamW's states then exist, as in the step zerolab train measures).

    every: activation checkpointing of every k-th block (None: --activation-checkpointing's
    every block, or none). Returns bytes: {"model_states": {state: formula}, "held": what the
    rank holds at the step's start, "activations", "transients": {category: peak},
    "peak", "meter_peak" (the memory meter's peak: states and transients), "rest",
    "num_params", "num_params_padded"}."""
    from .stage import make_strategy
    target = target or target_of(args)
    A = args.grad_accum
    with fake_world(world_size, rank):
        comm = Comm()
        with torch.device("meta"):
            model = target.build()
            model = model.to(DTYPES[args.precision])
        if every:
            checkpoint_blocks(model, every)
        meter = _MetaMeter()
        strategy = make_strategy(stage, model, comm, args, meter)
        acts = []

        def step(next_forward=None, tracker=None):
            if target.cfg is not None:      # the global batch, as zerolab.data builds it
                x, y = target.batch(rows * world_size * A)
                micro = [tuple(rank_slice(t, rank, world_size, m, A) for t in (x, y))
                         for m in range(A)]
            else:
                micro = [target.batch(rows) for _ in range(A)]
            for m, (xm, ym) in enumerate(micro):
                if m and next_forward is not None:
                    next_forward()
                before = _total(tracker, "current") if tracker else 0
                held = sum(meter.current.get(c, 0) for c in ("gathered_params",))
                loss = strategy.forward(xm, ym)
                if tracker is not None and m == 0:
                    meter.sample(strategy, "forward done")
                    now = _total(tracker, "current")
                    gathered = meter.current.get("gathered_params", 0) - held
                    acts.append(now - before - max(gathered, 0))
                strategy.backward(loss / A, sync=m == A - 1 or theory.is_sharded("grads", stage))
            strategy.step()

        with cpu_attention():
            if args.steps > 1:
                step()
            meter.reset_peaks()
            meter.sample(strategy, "step start")
            held_at_start = meter.peak_total
            tensors = [t for cat, ts in strategy.state_tensors().items()
                       if cat not in ("exp_avg", "exp_avg_sq") for t in ts if t is not None]
            tracker = mem_tracker(model, strategy.optimizer, *tensors)
            with tracker:
                step(tracker.reset_mod_stats, tracker)
            peak = _total(tracker, "peak")
            meter_peak = meter.peak_total
        psi = sum(u.numel for u in strategy.units)
        padded = sum(u.padded_numel for u in strategy.units)
        transients = {c: meter.peak.get(c, 0) for c in ("gathered_params", "grad_buckets",
                                                        "reduce_scatter_out", "grad_fp32")}
        close = getattr(strategy, "close", None)
        if close is not None:
            close()
    from .knobs import optimizer_ladder
    formula = theory.model_state_bytes(padded, world_size, stage, args.precision,
                                       grad_dtype=getattr(args, "grad_dtype", None),
                                       **optimizer_ladder(args))
    states = sum(formula.values())
    activations = acts[0] if acts else 0
    return {"stage": stage, "name": theory.STAGE_NAMES[stage], "world_size": world_size,
            "rows": rows, "num_params": psi, "num_params_padded": padded,
            "model_states": formula, "model_states_total": int(states), "held": held_at_start,
            "activations": activations, "transients": transients, "peak": peak,
            "meter_peak": meter_peak,
            "rest": peak - states - activations - sum(transients.values())}


# --- the questions: fits? largest micro-batch? smallest N? ----------------------------------
def per_rank_budget(memory: float, ranks_here: int, device: str) -> float:
    """Bytes one rank may use: a GPU's memory is its own rank's; on the CPU the ranks on this
    node share the host's memory."""
    return memory / ranks_here if device == "cpu" else memory


def largest_rows(args, stage: int, world_size: int, budget: float, target: Target,
                 every=None, limit: int = 1 << 20) -> tuple[int, dict | None]:
    """(largest rows per rank, up to `limit`, whose simulated peak fits `budget` bytes, its
    report); (0, None) when one row does not fit. The peak is the larger of the optimizer
    step's (no rows in it) and the backward's (affine in the rows), so the search widens by 4x
    until a simulation does not fit, then halves the interval: about 2·log2(B) simulations."""
    def peak(rows):
        return simulate(args, stage, world_size, rows, target, every=every)
    best = peak(1)
    if best["peak"] > budget:
        return 0, None
    lo, hi = 1, None
    while hi is None:
        nxt = min(lo * 4, limit)
        if nxt == lo:
            return lo, best
        got = peak(nxt)
        if got["peak"] <= budget:
            lo, best = nxt, got
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = peak(mid)
        if got["peak"] <= budget:
            lo, best = mid, got
        else:
            hi = mid
    return lo, best


def smallest_world(args, stage: int, rows: int, budget_of, target: Target, start: int,
                   every=None) -> int | None:
    """The smallest N >= `start` at which `stage` fits with `rows` rows per rank (budget_of(N):
    bytes a rank may use), or None below MAX_SEARCH. DDP's peak does not fall with N: None
    unless it fits at `start`. The model states fall as 1/N: the formula proposes N, a
    simulation confirms it, doubling while it does not fit, then steps back (at most 8 ranks)
    while one rank fewer fits too."""
    first = simulate(args, stage, start, rows, target, every=every)
    if first["peak"] <= budget_of(start):
        return start
    if stage == 0:
        return None
    sharded = first["model_states_total"] - theory.model_state_total(
        first["num_params_padded"], 10 ** 12, stage, args.precision)   # the part that shrinks
    fixed = first["peak"] - sharded
    n = start
    if fixed < budget_of(start):
        n = max(start + 1, math.ceil(sharded * start / (budget_of(start) - fixed)))
    while n <= MAX_SEARCH:
        if simulate(args, stage, n, rows, target, every=every)["peak"] <= budget_of(n):
            lower = n
            while lower > start + 1:                # step back while the smaller N fits too
                if simulate(args, stage, lower - 1, rows, target, every=every)["peak"] > budget_of(lower - 1):
                    break
                lower -= 1
                if n - lower > 8:
                    break
            return lower
        n *= 2
    return None


#: the largest world `smallest_world` searches (a fake world keeps a table of every rank)
MAX_SEARCH = min(MAX_WORLD, 1 << 16)


# --- advice ---------------------------------------------------------------------------------
def advice(args, stage: int, world_size: int, rows: int, budget_of, target: Target,
           every=None, ranks_here: int | None = None) -> list[str]:
    """What would make `stage` fit, from the same simulation; only the options that do, cheapest
    first: a smaller micro-batch with more micro-steps (the same global batch and result, a
    little slower), activation checkpointing (about 1/3 more compute), a later stage (more
    traffic), more ranks (more hardware), a smaller preset (another model). [] when none would.
    ranks_here: the ranks of one node sharing a CPU's memory (more ranks then means more nodes)."""
    out = []
    budget = budget_of(world_size)
    A = args.grad_accum
    if rows > 1:
        best, _ = largest_rows(args, stage, world_size, budget, target, every=every, limit=rows - 1)
        if best:
            per = rows // math.ceil(rows / best)
            while rows % per:
                per -= 1
            out.append(f"--grad-accum {A * rows // per} ({per} row(s) per rank per micro-step, "
                       f"the same --batch-size {args.batch_size})")
    if not every and simulate(args, stage, world_size, rows, target, every=1)["peak"] <= budget:
        out.append("--activation-checkpointing (every block; about 1/3 more compute)")
    later = next((s for s in range(stage + 1, 4) if simulate(
        args, s, world_size, rows, target, every=every)["peak"] <= budget), None)
    if later is not None:
        out.append(f"--stage {later} ({theory.STAGE_NAMES[later]})")
    more = stage if stage > 0 else 3 if later is None else None    # DDP: only with sharding
    if more is not None:
        n = smallest_world(args, more, rows, budget_of, target, world_size + 1, every=every)
        if n is not None:
            also = f"--stage {more} on " if more != stage else ""
            if ranks_here:                  # this node's ranks share its memory: more nodes
                nodes = math.ceil(n / ranks_here)
                n = nodes * ranks_here
                where = f" ({nodes} nodes of {ranks_here}: --nnodes {nodes})"
            else:
                where = ""
            out.append(f"{also}{n} ranks{where} with {rows} row(s) each (--batch-size "
                       f"{rows * n * A})")
    if target.cfg is not None and not getattr(args, "model", None):
        names = list(PRESETS)
        if args.preset in names:
            for smaller in reversed(names[:names.index(args.preset)]):
                small = argparse.Namespace(**{**vars(args), "preset": smaller})
                try:
                    t = target_of(small)
                except ValueError:
                    continue
                if simulate(small, stage, world_size, rows, t, every=every)["peak"] <= budget:
                    out.append(f"--preset {smaller}")
                    break
    return out


def check_fits(args, world_size: int, device: str = "cpu", available: float | None = None):
    """Before a launch (`zerolab train`, `compare`, and the labs through `job.check`): raise
    ValueError, one line, when a stage's predicted peak times the ranks on this node exceeds
    the memory `available` (bytes; default: this machine's MemAvailable), naming what would
    make it fit (`advice`). CPU only: asking CUDA would initialise it in the launcher. A run far
    below the memory (the formulas and Korthikanti's activations, x 2) is not simulated."""
    from ..model import num_params
    from .preflight import activation_bytes, available_bytes
    if device != "cpu":
        return
    available = available_bytes() if available is None else available
    if not available:
        return
    stages = options.parse_stages(args.stages)
    rows = args.batch_size // (world_size * args.grad_accum)
    cfg = options.model_config(args)
    with torch.device("meta"):
        psi = num_params(GPT(cfg))
    quick = (max(theory.model_state_total(psi, world_size, s, args.precision) for s in stages)
             + activation_bytes(cfg, rows, args.precision))
    if 2 * quick * args.nproc < available:
        return
    target = gpt_target(cfg, args.preset)
    every = 1 if args.activation_checkpointing else None
    here = max(1, min(world_size, args.nproc))

    def budget_of(n):
        return available / max(1, min(n, here))
    for s in stages:
        r = simulate(args, s, world_size, rows, target)
        if r["peak"] <= budget_of(world_size):
            continue
        ideas = advice(args, s, world_size, rows, budget_of, target, every=every,
                       ranks_here=here)
        raise ValueError(
            f"{theory.STAGE_NAMES[s]} needs about {r['peak'] / GB:,.3g} GB per rank "
            f"({r['model_states_total'] / GB:,.3g} GB of model states, "
            f"{r['activations'] / GB:,.3g} GB of activations for {rows} row(s) of "
            f"{cfg.block_size} tokens, the rest transients and temporaries; zerolab fit), x "
            f"{here} rank(s) = {r['peak'] * here / GB:,.3g} GB, but {available / GB:,.3g} GB is "
            "available; " + ("it would fit with " + "; or ".join(ideas) if ideas else
                             "no option of zerolab train makes it fit on this machine"))
