"""torchrun entry point: train the GPT with one or more stages and write OUT/stage{S}/rank{r}.json.

Idea: every rank builds the same model from the same seed, wraps it in the stage's strategy,
trains `--steps` optimizer steps on its own rows of each global batch, and writes what it held
(memory, measured and theory) and what it moved (the comm ledger) to its own JSON file. Several
stages can run one after another in one launch (`--stages 0,1,2,3`), which is what
`zerolab compare` does: same seed, same data, one process start-up.
`--save-every K` writes a sharded checkpoint every K steps and at the end, `--resume DIR`
continues from one, at any world size and stage (zerolab/checkpoint.py).

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m zerolab.train \\
        --stages 0,1,2,3 --preset tiny --steps 5 --out runs/compare
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import STRATEGIES, checkpoint, linkemu, theory, trace
from .comm import Comm
from .data import get_batch, load_tokens, rank_slice
from .memory import (MemoryMeter, allocator_peak, cuda_memory_figures, cuda_memory_history,
                     padding_bytes, transient_peak)
from .model import GPT, PRESETS, get_config, num_params
from .preflight import check_finite, check_seed
from .report import compare_rows, format_rows
from .zero3 import DEFAULT_PREFETCH
from .runs import atomic_json, atomic_path

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_stages(text: str) -> list[int]:
    """"0,1,2,3" -> [0, 1, 2, 3]; ValueError names a bad stage."""
    try:
        stages = [int(s) for s in str(text).split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(f"stages {text!r} must be a comma-separated list of 0, 1, 2, 3") from None
    if not stages:
        raise ValueError(f"stages {text!r} is empty: give one or more of 0, 1, 2, 3")
    return [theory.check_stage(s) for s in stages]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerolab.train", description=__doc__.split("\n")[0])
    p.add_argument("--stages", "--stage", default="0", help="stage or comma list, e.g. 0,1,2,3")
    p.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)}")
    p.add_argument("--block-size", type=int, default=None, help="override the preset's context")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows), all ranks")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--grad-dtype", default=None, choices=sorted(DTYPES),
                   help="gradient buffers' dtype (default: --precision); fp32 with bf16 weights "
                        "is Megatron's / DeepSpeed's 18 bytes per parameter")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="allow parameters that get no gradient in a step (torch DDP's flag)")
    p.add_argument("--zero1-grad-op", default="all_reduce", choices=theory.ZERO1_GRAD_OPS)
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP / ZeRO-1 / ZeRO-2: gradient bucket cap in MiB (torch DDP's "
                   "bucket_cap_mb); consecutive blocks share a bucket (default: one per block; "
                   "ZeRO-3 ignores it: it gathers one block at a time)")
    p.add_argument("--zero3-prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="ZeRO-3: gather the next block while the current one computes (the "
                   "default); --no-zero3-prefetch: one block at a time, the notes' picture")
    p.add_argument("--zero3-prefetch-depth", type=int, default=None,
                   help="ZeRO-3: blocks gathered ahead (0, 1, 2, ...; -1 all; default "
                   f"{DEFAULT_PREFETCH}); overrides --zero3-prefetch")
    p.add_argument("--zero3-keep-root", action="store_true",
                   help="ZeRO-3: keep the root unit gathered from forward into backward")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's forward in backward (torch.utils.checkpoint)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of 2-D weights (biases and LayerNorm: none)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0: no clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file (default: Python stdlib sources)")
    p.add_argument("--out", default="runs/train")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeline", action="store_true", help="record memory over the last step")
    p.add_argument("--cuda-snapshot", action="store_true", help="CUDA only: record the allocator's "
                   "history over the last step into OUT/stage{S}/rank{r}_snapshot.json")
    p.add_argument("--save-params", action="store_true",
                   help="rank 0 saves the final fp32 state dict (every key of GPT.state_dict(), "
                   "from the master weights) to OUT/stage{S}/params.pt")
    p.add_argument("--save-every", type=int, default=None, metavar="K",
                   help="sharded checkpoint every K steps and at the end into "
                   "OUT/stage{S}/checkpoints (0: only at the end)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint (step_* folder or its checkpoints/ folder); "
                   "options not given are taken from it")
    p.add_argument("--crash-in-save", type=int, default=None, help=argparse.SUPPRESS)  # tests
    p.add_argument("--no-allocator", action="store_true",
                   help="skip the allocator / MemTracker cross-check on the last step")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    p.add_argument("--run-id", default=None, help="the run id the launcher recorded in OUT/run.json "
                   "(default: rank 0 starts a run of its own there)")
    p.add_argument("--overwrite", action="store_true",
                   help="without --run-id: replace the run OUT holds instead of refusing")
    p.add_argument("--link-gbps", type=float, default=None, help="emulate a link of this many "
                   "Gb/s per rank (linkemu.py; gloo only): collectives end no sooner than the model")
    p.add_argument("--link-latency-us", type=float, default=None,
                   help="emulated link latency α, microseconds per ring step (with --link-gbps)")
    p.add_argument("--trace", action="store_true", help="torch.profiler Chrome trace of the last "
                   "step but one per rank: OUT/stage{S}/trace_rank{r}.json (trace.py)")
    p.add_argument("--crash-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests: this
    return p                                                                         # rank raises


def model_config(args):
    """The GPTConfig of --preset with --block-size applied (ValueError names a bad one)."""
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size {args.block_size} must be >= 1 (tokens of context)")
    overrides = {"block_size": args.block_size} if args.block_size is not None else {}
    if getattr(args, "activation_checkpointing", False):
        overrides["activation_checkpointing"] = True
    return get_config(args.preset, **overrides)


def check_args(args, world_size: int):
    """Raise ValueError (one line) for values no run could use; return the model config."""
    args.stage_list = parse_stages(args.stages)
    cfg = model_config(args)
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("lr", "timeout"):
        check_finite(f"--{name}", getattr(args, name), positive=True)
    check_finite("--max-grad-norm", args.max_grad_norm)
    check_finite("--weight-decay", getattr(args, "weight_decay", 0.0), minimum=0)
    check_seed(args.seed)
    if getattr(args, "bucket_mb", None) is not None:
        check_finite("--bucket-mb", args.bucket_mb, positive=True)
    depth = getattr(args, "zero3_prefetch_depth", None)
    if depth is not None and depth < -1:
        raise ValueError(f"--zero3-prefetch-depth {depth} must be >= 0, or -1 (all blocks)")
    linkemu.from_args(getattr(args, "link_gbps", None), getattr(args, "link_latency_us", None),
                      world_size)          # ValueError for a bad emulated link
    if args.batch_size % (world_size * args.grad_accum):
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by world_size "
                         f"{world_size} x --grad-accum {args.grad_accum}")
    save_every = getattr(args, "save_every", None)          # `zerolab compare` has none
    if save_every is not None and save_every < 0:
        raise ValueError(f"--save-every {save_every} must be >= 0 (0: only at the end)")
    return cfg


def check_resume(args, given: set[str], world_size: int):
    """Open --resume's checkpoint, take the options not `given` on the command line from it and
    check that it fits this run (one stage, same model, batch divisible by the new world size,
    steps left). Returns (checkpoint, notes); ValueError (one line) otherwise."""
    ckpt = checkpoint.open_checkpoint(args.resume)
    notes = checkpoint.apply_resume_args(args, given, ckpt)
    if len(parse_stages(args.stages)) != 1:
        raise ValueError(f"--resume continues one stage: give one --stage, not {args.stages!r}")
    try:
        cfg = check_args(args, world_size)
    except ValueError as err:
        if "--batch-size" in str(err) and "batch_size" not in given:
            raise ValueError(f"{err} (the checkpoint's global batch: pass a --batch-size that "
                             f"world_size {world_size} divides, or resume on another world size)"
                             ) from None
        raise
    checkpoint.check_compatible(ckpt, cfg)
    if args.steps <= ckpt.step:
        raise ValueError(f"--steps {args.steps} leaves nothing to train after the checkpoint's "
                         f"step {ckpt.step}: give --steps > {ckpt.step}")
    return ckpt, notes


def held_tensors(model, strategy) -> tuple:
    """What training holds (model, optimizer, every state tensor): MemTracker's `external`."""
    return (model, strategy.optimizer, *(t for ts in strategy.state_tensors().values()
                                         for t in ts if t is not None))


def zero3_prefetch_depth(args) -> int:
    """ZeRO-3's blocks gathered ahead: --zero3-prefetch-depth if given, else 1 for
    --zero3-prefetch, 0 for --no-zero3-prefetch, else zero3.DEFAULT_PREFETCH."""
    depth = getattr(args, "zero3_prefetch_depth", None)
    if depth is not None:
        return depth
    flag = getattr(args, "zero3_prefetch", None)
    return DEFAULT_PREFETCH if flag is None else int(flag)


def make_strategy(stage, model, comm, args, meter):
    kwargs = dict(max_grad_norm=args.max_grad_norm, meter=meter, lr=args.lr,
                  weight_decay=args.weight_decay,
                  find_unused_parameters=getattr(args, "find_unused_parameters", False),
                  grad_dtype=DTYPES[args.grad_dtype] if getattr(args, "grad_dtype", None) else None)
    if stage in (0, 1, 2):
        kwargs["bucket_mb"] = getattr(args, "bucket_mb", None)
    if stage == 1:
        kwargs["grad_op"] = args.zero1_grad_op
    if stage == 3:
        kwargs["prefetch"] = zero3_prefetch_depth(args)
        kwargs["keep_root"] = getattr(args, "zero3_keep_root", False)
    return STRATEGIES[stage](model, comm, **kwargs)


def before_stage(device) -> dict:
    """What earlier stages left behind, measured just before a stage builds its model: after
    gc.collect() (and empty_cache on CUDA), the strategies still alive (0 when every stage freed
    its model, strategy and buffers) and, on CUDA, memory.cuda_memory_figures (bytes)."""
    gc.collect()
    kinds = tuple(STRATEGIES.values())      # type(o), not isinstance: isinstance also reads
    alive = sum(1 for o in gc.get_objects() if issubclass(type(o), kinds))  # o.__class__, which
    # warns for deprecated objects such as torch.distributed.reduce_op
    cuda = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        cuda = cuda_memory_figures(device)
    return {"strategies_alive": alive, "cuda": cuda}


def finish_stage(strategy):
    """Let a finished stage be freed: the strategy's close() (removes its hooks) when it has one."""
    close = getattr(strategy, "close", None)
    if close is not None:
        close()


def run_stage(stage, args, comm, device, train_tokens, val_tokens, ckpt=None) -> dict:
    """Train one stage on this rank (from checkpoint `ckpt` if given); return the JSON result."""
    rank, n, A = comm.rank, comm.world_size, args.grad_accum
    leftover = before_stage(device)
    cfg = model_config(args)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device=device, dtype=DTYPES[args.precision])
    psi = num_params(model)
    meter = MemoryMeter()
    comm.records.clear()
    strategy = make_strategy(stage, model, comm, args, meter)
    unit_ranges = trace.UnitRanges(model.zero_units()) if args.trace else None   # after the strategy
    psi_padded = sum(u.padded_numel for u in strategy.units)
    start, history, saved = 0, [], []
    if ckpt is not None:
        checkpoint.load(strategy, model, ckpt, DTYPES[args.precision])
        start, history = ckpt.step, list(ckpt.meta.get("losses", []))[:ckpt.step]

    def one_step(step, next_forward=None):
        x, y = get_batch(train_tokens, step, args.batch_size, cfg.block_size, args.seed)
        total = torch.zeros((), dtype=torch.float32, device=device)   # stays on the device:
        for micro in range(A):                                           # no host sync per micro-step
            if micro and next_forward is not None:
                next_forward()              # the allocator cross-check: a new forward (memory.py)
            xm, ym = (rank_slice(t, rank, n, micro, A).to(device) for t in (x, y))
            with trace.phase("forward"):
                loss = strategy.forward(xm, ym)
            with trace.phase("backward"):
                strategy.backward(loss / A, sync=micro == A - 1)
            total += loss.detach().float() / A
        with trace.phase("step"):
            norm = strategy.step()
        return total, norm

    losses, norms, times, allocator = [], [], [], None
    trace_step = max(start, args.steps - 2)     # not the last: it runs the allocator cross-check
    for step in range(start, args.steps):
        comm.step = step
        if args.crash_rank == rank and step == args.steps - 1:
            raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank) at step {step}")
        last = step == args.steps - 1
        meter.enabled = last                # the last step's memory is reported: sample only it
        meter.record_timeline = last and args.timeline
        meter.reset_peaks()
        meter.sample(strategy, "step start")
        t0 = time.perf_counter()
        snapshot = (cuda_memory_history(Path(args.out) / f"stage{stage}" / f"rank{rank}_snapshot.json",
                                        tag={"run_id": args.run_id, "stage": stage, "rank": rank})
                    if last and args.cuda_snapshot and device.type == "cuda" else contextlib.nullcontext())
        profiler = trace.chrome_trace(Path(args.out) / f"stage{stage}" / f"trace_rank{rank}.json",
                                      device, enabled=args.trace and step == trace_step, comm=comm,
                                      run_id=args.run_id, stage=stage, rank=rank, step=step)
        with snapshot, profiler:
            if last and not args.no_allocator:
                result = {}
                held = [t for cat, ts in strategy.state_tensors().items()     # the optimizer
                        if cat not in ("exp_avg", "exp_avg_sq") for t in ts if t is not None]
                allocator = allocator_peak(lambda nxt: result.update(out=one_step(step, nxt)),
                                           device, external=(model, strategy.optimizer, *held),
                                           micro_steps=True)
                local, norm = result["out"]
            else:
                local, norm = one_step(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        comm.settle()                       # the step's collective durations (one sync at most)
        mean = local
        with comm.phase("step"):
            comm.all_reduce(mean, what="metric", unit="loss")
        losses.append(mean.item() / n)      # the loss reaches the host once per step
        norms.append(float(norm))
        if not (math.isfinite(losses[-1]) and math.isfinite(norms[-1])):
            stop_non_finite(stage, step, local, losses[-1], norms[-1], comm)
        if rank == 0:
            print(f"[stage {stage}] step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"grad_norm {norms[-1]:.4f}  {times[-1] * 1e3:.0f} ms", flush=True)
        if args.save_every is not None and (step + 1 == args.steps or (
                args.save_every and (step + 1) % args.save_every == 0)):
            meta = {"args": {k: getattr(args, k) for k in checkpoint.RESUMED_ARGS},
                    "model_config": cfg.__dict__, "precision": args.precision,
                    "losses": history + losses}
            meta["args"]["stages"] = str(stage)
            crash = args.crash_in_save if step + 1 == args.steps else None
            folder, save_peak = transient_peak(lambda: checkpoint.save(
                strategy, model, Path(args.out) / f"stage{stage}" / "checkpoints", step + 1, meta,
                crash_rank=crash), device, held_tensors(model, strategy))
            saved.append(str(folder))
            if rank == 0:
                print(f"[stage {stage}] saved {saved[-1]}", flush=True)

    # --- held-out loss and saved parameters: outside the measured steps ------------------------
    memory = meter.to_json()                # what the last step held, before eval touches it
    meter.enabled = meter.record_timeline = False
    comm.step = -1
    with torch.no_grad():
        x, y = get_batch(val_tokens, 0, args.batch_size, cfg.block_size, args.seed + 1)
        xm, ym = (rank_slice(t, rank, n).to(device) for t in (x, y))
        val = strategy.forward(xm, ym).detach().float().reshape(())
        with comm.phase("eval"):
            comm.all_reduce(val, what="metric", unit="val_loss")
    params_sha256 = None
    if args.save_params:            # every rank gathers the fp32 masters, rank 0 writes
        params, gather_peak = transient_peak(
            lambda: checkpoint.gather_state_dict(strategy, model, comm), device,
            held_tensors(model, strategy))
        if rank == 0:
            with atomic_path(Path(args.out) / f"stage{stage}" / "params.pt") as tmp:
                torch.save(params, tmp)     # a plain state dict; its sha256 goes in rank0.json
                params_sha256 = hashlib.sha256(tmp.read_bytes()).hexdigest()
        del params              # for comparison: gathering the whole training state to save it
        _, full_peak = transient_peak(lambda: {k: checkpoint.gather_flat(strategy, comm, k)
                                               for k in checkpoint.KEYS}, device,
                                      held_tensors(model, strategy))
    last = args.steps - 1
    gd = getattr(args, "grad_dtype", None)
    checkpoint_memory = {"sharded_save_peak": save_peak if saved else None,
                         "gather_weights_peak": gather_peak if args.save_params else None,
                         "gather_all_states_peak": full_peak if args.save_params else None}
    measured_state = {s: memory["current"].get(s, 0) for s in theory.STATES}
    ledger = comm.to_json()
    finish_stage(strategy)
    if unit_ranges is not None:
        unit_ranges.remove()
    return {
        "run_id": args.run_id, "stage": stage, "name": theory.STAGE_NAMES[stage], "rank": rank,
        "world_size": n, "params_sha256": params_sha256,
        "backend": dist.get_backend(), "device": str(device), "precision": args.precision,
        "preset": args.preset, "model_config": cfg.__dict__, "num_params": psi,
        "num_params_padded": psi_padded, "steps": args.steps, "batch_size": args.batch_size,
        "grad_accum": A, "grad_dtype": gd or args.precision,
        "zero1_grad_op": args.zero1_grad_op if stage == 1 else None,
        "bucket_mb": getattr(args, "bucket_mb", None) if stage in (0, 1, 2) else None,
        "zero3_prefetch": zero3_prefetch_depth(args) if stage == 3 else None,
        "zero3_keep_root": args.zero3_keep_root if stage == 3 else None,
        "link": ({"gbps": args.link_gbps, "latency_us": args.link_latency_us or 0.0}
                 if args.link_gbps is not None else None),
        "seed": args.seed, "start_step": start, "resumed_from": ckpt and str(ckpt.folder),
        "checkpoints": saved, "losses": losses, "val_loss": val.item() / n, "grad_norms": norms,
        "step_times_s": times,
        "units": [{"name": u.name, "numel": u.numel, "padded_numel": u.padded_numel,
                   "shard_numel": u.shard_numel, "padding_in_shard": u.padding_in_shard()}
                  for u in strategy.units],
        "memory": {"model_states": measured_state, "model_states_total": sum(measured_state.values()),
                   "padding": padding_bytes(strategy.units, stage, args.precision, gd),
                   **memory, "allocator": allocator, "checkpoint": checkpoint_memory},
        "theory": {
            "model_states": theory.model_state_bytes(psi, n, stage, args.precision, grad_dtype=gd),
            "model_states_padded": theory.model_state_bytes(psi_padded, n, stage, args.precision,
                                                            grad_dtype=gd),
            "peak_in_step_padded": theory.peak_step_bytes(psi_padded, n, stage, args.precision, gd),
            "traffic_per_step": theory.traffic_bytes(psi, n, stage, args.precision,
                                                     args.zero1_grad_op, A, gd),
            "traffic_per_step_padded": theory.traffic_bytes(psi_padded, n, stage, args.precision,
                                                            args.zero1_grad_op, A, gd),
        },
        "comm": {"bytes_per_step": comm.bytes_by_op(step=last), "records": ledger,
                 "time_sources": comm.time_sources()},
        "before_stage": leftover,
    }


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


def agree_on_run(args, world_size: int, comm, device) -> str:
    """The run id every rank tags its files with: --run-id from a launcher (with several nodes
    only node 0's launcher passes one, and torchrun's c10d rendezvous may give rank 0 to another
    node, so the lowest rank that has one broadcasts it), else rank 0 starts a run of its own in
    --out (manifest and lock, `zerolab.runs`). Raises ValueError (on every rank) when rank 0
    could not start the run."""
    from .runs import begin_run
    n = comm.world_size
    has = torch.zeros(n, dtype=torch.int64, device=device)
    comm.all_gather(has, torch.tensor([int(args.run_id is not None)], device=device),
                    what="metric", unit="run_id")
    src = next((r for r, h in enumerate(has.tolist()) if h), 0)
    payload, error = torch.zeros(256, dtype=torch.uint8), None
    if comm.rank == src:
        run_id = args.run_id
        if run_id is None:
            try:
                args._run = begin_run(args.out, command="train", args=vars(args).copy(),
                                      world_size=world_size, overwrite=args.overwrite,
                                      resume=getattr(args, "resume", None))
                run_id = args._run.run_id
            except ValueError as err:
                error = str(err)
        text = ("E" + error if error else "R" + run_id).encode()[:256]
        payload[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    payload = payload.to(device)
    comm.broadcast(payload, src, what="metric", unit="run_id")
    text = bytes(payload.cpu().tolist()).rstrip(b"\0").decode()
    if text[0] == "E":
        raise ValueError(text[1:])
    return text[1:]


def check_device(args):
    """Raise ValueError (one line) when --device / --backend cannot run on this machine."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (use --device cpu)")
    if args.backend == "nccl" and args.device != "cuda":
        raise ValueError("--backend nccl needs --device cuda (use gloo on CPU)")


def setup(args):
    """Initialise the process group from torchrun's environment; return (comm, device)."""
    check_device(args)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.backend == "nccl":              # per-op durations from NCCL's own events (comm.py)
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    kwargs = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout), **kwargs)
    return Comm(), device


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it: bind to port 0)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port) -> bool:
    """True when `port` (a number or its text) can be bound on 127.0.0.1 now."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", int(port)))
        except (OSError, ValueError, OverflowError):
            return False
    return True


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    given = checkpoint.given_options(build_parser(), argv)
    if "RANK" not in os.environ:     # plain `python -m zerolab.train`: a world of one
        port = os.environ.get("MASTER_PORT")
        if port and not port_is_free(port):
            print(f"zerolab.train: error: MASTER_PORT {port} is taken; set another or unset "
                  "MASTER_PORT to let zerolab pick a free one", file=sys.stderr)
            return 2
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port or str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    ckpt = None
    try:
        if args.resume:
            ckpt, notes = check_resume(args, given, world_size)
            if notes and int(os.environ["RANK"]) == 0:
                print(f"zerolab.train: resuming with {', '.join(notes)}", flush=True)
        cfg = check_args(args, world_size)
        if args.bucket_mb is not None and 3 in args.stage_list and int(os.environ["RANK"]) == 0:
            print("zerolab.train: --bucket-mb applies to stages 0-2; ZeRO-3 keeps one unit per "
                  "block (it gathers one block at a time)", flush=True)
        check_device(args)
        train_tokens, val_tokens = load_tokens(args.data, cfg.block_size)
        link = linkemu.from_args(args.link_gbps, args.link_latency_us, world_size)
        if link is not None and args.backend != "gloo":
            raise ValueError(f"--link-gbps emulates a link for gloo only, not --backend {args.backend}")
    except ValueError as err:
        if int(os.environ["RANK"]) == 0:
            print(f"zerolab.train: error: {err}", file=sys.stderr)
        return 2
    comm, device = setup(args)
    comm.link = link
    status = "failed"
    try:
        args.run_id = agree_on_run(args, world_size, comm, device)
        results = []
        for stage in args.stage_list:
            result = run_stage(stage, args, comm, device, train_tokens, val_tokens, ckpt)
            atomic_json(Path(args.out) / f"stage{stage}" / f"rank{comm.rank}.json", result)
            results.append(result)
            dist.barrier()
        if comm.rank == 0:
            print("\nrank 0, bytes after the last step (formula at the padded Ψ):")
            print(format_rows(compare_rows({r["stage"]: [r] for r in results})), flush=True)
            print(f"wrote {Path(args.out).resolve()}/stage*/rank*.json (run {args.run_id})", flush=True)
            if args.trace:
                print(f"traces (one step per rank): {Path(args.out).resolve()}/stage*/"
                      "trace_rank*.json; open one in https://ui.perfetto.dev or chrome://tracing",
                      flush=True)
        status = "ok"
    except (ValueError, NonFinite) as err:
        if comm.rank == 0:                  # every rank raised the same one-line error
            print(f"zerolab.train: error: {err}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, ValueError) else 3
    finally:
        if getattr(args, "_run", None) is not None:
            args._run.finish(status)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from .launch import rank_entry
    rank_entry(main)
