"""One stage on one rank, phase by phase: build, train, evaluate and save, report.

Idea: `zerolab.run.train` runs `run_stage` once per stage of a launch. Each phase is one function
that reads and fills one `Stage` record, so that the training loop reads as the notes tell it:

1. `build`: the model from the seed, the stage's strategy around it (zerolab.variants.compose), and a
   checkpoint's state when resuming;
2. `train`: `--steps` optimizer steps on this rank's rows of each global batch; the last step is
   the measured one (memory meter on, allocator cross-check, CUDA snapshot), the one before it
   is traced with `--trace`; checkpoints every `--save-every` steps;
3. `finish`: the held-out loss and `--save-params`, outside the measured steps;
4. `result.stage_result`: the JSON the rank writes (OUT/stage{S}/rank{r}.json).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zerolab.run.train \\
        --stage 2 --preset nano --steps 3
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import STRATEGIES, theory
from ..data import get_batch, rank_slice
from ..variants.compose import make_strategy as compose_strategy
from ..memory import (MemoryMeter, allocator_peak, cuda_memory_figures, cuda_memory_history,
                      transient_peak)
from ..model import GPT, num_params
from ..timing import trace
from . import checkpoint
from .folders import atomic_json, atomic_path
from . import knobs
from .options import DTYPES, model_config
from .result import stage_result


@dataclass
class Stage:
    """What one stage holds on this rank while it runs, filled phase by phase."""
    stage: int
    args: object
    comm: object
    device: torch.device
    leftover: dict = field(default_factory=dict)   # before_stage()
    cfg: object = None
    model: object = None
    strategy: object = None
    meter: object = None
    unit_ranges: object = None                      # trace.UnitRanges with --trace
    psi: int = 0                                    # Ψ, parameters
    start: int = 0                                  # first step (a checkpoint's step)
    history: list = field(default_factory=list)     # a checkpoint's losses before `start`
    resumed_from: str | None = None                 # the checkpoint's folder
    losses: list = field(default_factory=list)
    norms: list = field(default_factory=list)
    times: list = field(default_factory=list)       # seconds per step
    allocator: dict | None = None
    saved: list = field(default_factory=list)       # checkpoint folders written
    save_peak: dict | None = None
    memory: dict | None = None                      # the meter's figures of the last step
    val_loss: float = math.nan
    params_sha256: str | None = None
    checkpoint_memory: dict = field(default_factory=dict)


def run_stage(stage, args, comm, device, train_tokens, val_tokens, ckpt=None) -> dict:
    """Train one stage on this rank (from checkpoint `ckpt` if given); return the JSON result."""
    st = Stage(stage, args, comm, device, leftover=before_stage(device))
    build(st, ckpt)
    train(st, train_tokens)
    finish(st, val_tokens)
    ledger = comm.to_json()
    close = getattr(st.strategy, "close", None)     # let the stage be freed: its hooks go
    if close is not None:
        close()
    if st.unit_ranges is not None:
        st.unit_ranges.remove()
    return stage_result(st, ledger)


def before_stage(device) -> dict:
    """What earlier stages left behind, measured just before a stage builds its model: after
    gc.collect() (and empty_cache on CUDA), the strategies still alive (0 when every stage freed
    its model, strategy and buffers) and, on CUDA, memory.cuda_memory_figures (bytes) plus
    "library_workspaces": the bytes freed by dropping cuBLAS's workspaces first. cuBLAS keeps one
    per (handle, stream) in torch's caching allocator for the life of the process - on an H200
    with torch 2.11, 2 x 32 MiB + 1 MiB from the first matmuls on (two handles: most likely
    the forward's thread and autograd's) - which no strategy owns; the next matmul allocates them
    again."""
    gc.collect()
    kinds = tuple(STRATEGIES.values())      # type(o), not isinstance: isinstance also reads
    alive = sum(1 for o in gc.get_objects() if issubclass(type(o), kinds))  # o.__class__, which
    # warns for deprecated objects such as torch.distributed.reduce_op
    cuda = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)     # torch >= 2.1
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        cuda = cuda_memory_figures(device)
        cuda["library_workspaces"] = held - cuda["allocated"]
    return {"strategies_alive": alive, "cuda": cuda}


# --- 1. build ---------------------------------------------------------------------------------
def make_strategy(stage, model, comm, args, meter):
    """The stage's strategy around `model` with the options' knobs (`knobs.strategy_kwargs`,
    --hybrid's HSDP / HpZ included), built by zerolab.variants.compose: the stage's class with each
    variant the options ask for."""
    kwargs = knobs.strategy_kwargs(stage, args, meter)
    hybrid = knobs.hybrid(args, comm.world_size) if stage == 3 else None
    if hybrid is not None:
        kwargs.update(hybrid=hybrid[0], ranks_per_node=hybrid[1])
    return compose_strategy(stage, model, comm, **kwargs)


def build(st: Stage, ckpt=None):
    """The model from the seed, the stage's strategy, the checkpoint's state when resuming."""
    args = st.args
    st.cfg = model_config(args)
    torch.manual_seed(args.seed)
    st.model = GPT(st.cfg).to(device=st.device, dtype=DTYPES[args.precision])
    st.psi = num_params(st.model)
    st.meter = MemoryMeter()
    st.strategy = make_strategy(st.stage, st.model, st.comm, args, st.meter)
    st.comm.records.clear()                 # the ledger holds the steps (not rank 0's broadcast)
    if args.trace:                          # after the strategy: its hooks run first
        st.unit_ranges = trace.UnitRanges(st.model.zero_units())
    if ckpt is not None:
        checkpoint.load(st.strategy, st.model, ckpt, DTYPES[args.precision])
        st.start, st.history = ckpt.step, list(ckpt.meta.get("losses", []))[:ckpt.step]
        st.resumed_from = str(ckpt.folder)


def held_tensors(model, strategy) -> tuple:
    """What training holds (model, optimizer, every state tensor): MemTracker's `external`."""
    return (model, strategy.optimizer, *(t for ts in strategy.state_tensors().values()
                                         for t in ts if t is not None))


# --- 2. train ---------------------------------------------------------------------------------
def one_step(st: Stage, tokens, step: int, next_forward=None):
    """One optimizer step (--grad-accum micro-steps); (summed loss on the device, grad norm).
    next_forward: called before each further forward (the allocator cross-check, memory.py)."""
    args, A, comm = st.args, st.args.grad_accum, st.comm
    x, y = get_batch(tokens, step, args.batch_size, st.cfg.block_size, args.seed)
    sync_every = theory.is_sharded("grads", st.stage)    # no local full-gradient accumulation
    total = torch.zeros((), dtype=torch.float32, device=st.device)    # stays on the device:
    for micro in range(A):                                             # no host sync per micro-step
        if micro and next_forward is not None:
            next_forward()
        xm, ym = (rank_slice(t, comm.rank, comm.world_size, micro, A).to(st.device) for t in (x, y))
        with trace.phase("forward"):
            loss = st.strategy.forward(xm, ym)
        with trace.phase("backward"):           # the notes' ZeRO-2/3 keep gradients sharded:
            st.strategy.backward(loss / A, sync=micro == A - 1 or sync_every)   # reduce each time
        total += loss.detach().float() / A
    with trace.phase("step"):
        norm = st.strategy.step()
    return total, norm


def train(st: Stage, tokens):
    """Steps start .. --steps - 1; the last one measured, the one before traced (--trace)."""
    args, comm, rank = st.args, st.comm, st.comm.rank
    folder = Path(args.out) / f"stage{st.stage}"
    trace_step = max(st.start, args.steps - 2)  # not the last: it runs the allocator cross-check
    for step in range(st.start, args.steps):
        comm.step = step
        if args.crash_rank == rank and step == args.steps - 1:
            raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank) at step {step}")
        last = step == args.steps - 1
        st.meter.enabled = last             # the last step's memory is reported: sample only it
        st.meter.record_timeline = last and args.timeline
        st.meter.reset_peaks()
        st.meter.sample(st.strategy, "step start")
        t0 = time.perf_counter()
        snapshot = (cuda_memory_history() if last and args.cuda_snapshot and st.device.type == "cuda"
                    else contextlib.nullcontext())
        profiler = trace.chrome_trace(folder / f"trace_rank{rank}.json", st.device,
                                      enabled=args.trace and step == trace_step, comm=comm,
                                      run_id=args.run_id, stage=st.stage, rank=rank, step=step)
        with snapshot as recorded, profiler:
            local, norm = measured_step(st, tokens, step) if last else one_step(st, tokens, step)
            if st.device.type == "cuda":
                torch.cuda.synchronize(st.device)
        if recorded is not None:
            atomic_json(folder / f"rank{rank}_snapshot.json", {
                "run_id": args.run_id, "stage": st.stage, "rank": rank, **recorded}, default=str)
        st.times.append(time.perf_counter() - t0)
        comm.settle()                       # the step's collective durations (one sync at most)
        log_step(st, step, local, norm)
        if args.save_every is not None and (step + 1 == args.steps or (
                args.save_every and (step + 1) % args.save_every == 0)):
            save(st, step + 1)


def measured_step(st: Stage, tokens, step: int):
    """The last step, with the allocator / MemTracker cross-check unless --no-allocator."""
    if st.args.no_allocator:
        return one_step(st, tokens, step)
    out = {}
    held = [t for cat, ts in st.strategy.state_tensors().items()        # the optimizer states
            if cat not in ("exp_avg", "exp_avg_sq") for t in ts if t is not None]
    st.allocator = allocator_peak(lambda nxt: out.update(step=one_step(st, tokens, step, nxt)),
                                  st.device, external=(st.model, st.strategy.optimizer, *held),
                                  micro_steps=True)
    return out["step"]


def log_step(st: Stage, step: int, local, norm):
    """The mean loss over ranks reaches the host once per step; rank 0 prints a progress line;
    a non-finite loss or norm stops every rank (`stop_non_finite`)."""
    comm, n = st.comm, st.comm.world_size
    mean = local
    with comm.phase("step"):
        comm.all_reduce(mean, what="metric", unit="loss")
    st.losses.append(mean.item() / n)
    st.norms.append(float(norm))
    if not (math.isfinite(st.losses[-1]) and math.isfinite(st.norms[-1])):
        stop_non_finite(st.stage, step, local, st.losses[-1], st.norms[-1], comm)
    if comm.rank == 0:
        print(f"[stage {st.stage}] step {step + 1}/{st.args.steps}  loss {st.losses[-1]:.4f}  "
              f"grad_norm {st.norms[-1]:.4f}  {st.times[-1] * 1e3:.0f} ms", flush=True)


def save(st: Stage, steps_done: int):
    """A sharded checkpoint after `steps_done` steps (every rank writes its own file)."""
    args = st.args
    meta = {"args": {k: getattr(args, k) for k in checkpoint.RESUMED_ARGS},
            "model_config": st.cfg.__dict__, "precision": args.precision,
            "losses": st.history + st.losses}
    meta["args"]["stages"] = str(st.stage)
    crash = args.crash_in_save if steps_done == args.steps else None
    folder, st.save_peak = transient_peak(lambda: checkpoint.save(
        st.strategy, st.model, Path(args.out) / f"stage{st.stage}" / "checkpoints", steps_done,
        meta, crash_rank=crash), st.device, held_tensors(st.model, st.strategy))
    st.saved.append(str(folder))
    if st.comm.rank == 0:
        print(f"[stage {st.stage}] saved {st.saved[-1]}", flush=True)


class NonFinite(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message is one line."""


def stop_non_finite(stage, step, local, mean, norm, comm):
    """Every rank calls this at the same step (the mean loss and the global norm are the same on
    every rank); it finds the first rank whose own loss is non-finite and raises NonFinite."""
    n = comm.world_size
    locals_ = torch.zeros(n, dtype=torch.float32, device=local.device)
    mine = local.reshape(1).float().to(local.device)
    comm.all_gather(locals_, mine, what="metric", unit="loss")
    bad = [r for r, v in enumerate(locals_.tolist()) if not math.isfinite(v)]
    if bad:
        what = f"rank {bad[0]}'s loss is {locals_[bad[0]].item()}"
    elif not math.isfinite(mean):
        what = f"the mean loss over ranks is {mean} (rank 0)"
    else:
        what = f"the global gradient norm is {norm} (rank 0)"
    raise NonFinite(f"{theory.STAGE_NAMES[stage]} step {step + 1}: {what}; the run stopped there "
                    "(lower --lr, or use --precision fp32)")


# --- 3. finish: held-out loss and saved parameters, outside the measured steps ---------------
def finish(st: Stage, val_tokens):
    """The held-out loss, and --save-params (with the memory that gathering costs)."""
    args, comm, n = st.args, st.comm, st.comm.world_size
    st.memory = st.meter.to_json()          # what the last step held, before eval touches it
    st.meter.enabled = st.meter.record_timeline = False
    comm.step = -1
    with torch.no_grad():
        x, y = get_batch(val_tokens, 0, args.batch_size, st.cfg.block_size, args.seed + 1)
        xm, ym = (rank_slice(t, comm.rank, n).to(st.device) for t in (x, y))
        val = st.strategy.forward(xm, ym).detach().float().reshape(())
        with comm.phase("eval"):
            comm.all_reduce(val, what="metric", unit="val_loss")
    st.val_loss = val.item() / n
    gather_peak = full_peak = None
    if args.save_params:            # every rank gathers the fp32 masters, rank 0 writes
        held = held_tensors(st.model, st.strategy)
        params, gather_peak = transient_peak(
            lambda: checkpoint.gather_state_dict(st.strategy, st.model, comm), st.device, held)
        if comm.rank == 0:
            with atomic_path(Path(args.out) / f"stage{st.stage}" / "params.pt") as tmp:
                with open(tmp, "wb") as f:  # a plain state dict; its sha256 goes in rank0.json
                    torch.save(params, f)   # (through a file object: the archive's name inside
                                            # is "archive", not the temp file's, so the bytes repeat)
                st.params_sha256 = hashlib.sha256(tmp.read_bytes()).hexdigest()
        del params              # for comparison: gathering the whole training state to save it
        _, full_peak = transient_peak(lambda: {k: checkpoint.gather_flat(st.strategy, comm, k)
                                               for k in checkpoint.KEYS}, st.device, held)
    st.checkpoint_memory = {"sharded_save_peak": st.save_peak if st.saved else None,
                            "gather_weights_peak": gather_peak, "gather_all_states_peak": full_peak}
