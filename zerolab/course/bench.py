"""zerolab against torch: the same GPT, the same data, the systems interleaved round by round.

Idea: a speed claim needs the same model, data, dtype and machine, and repeated runs whose spread
is shown. Every rank builds each system from the same seed: zerolab stages 0-3 with their defaults
(ZeRO-3 gathers one block ahead) and ZeRO-3 without prefetch,
torch DistributedDataParallel, DDP + ZeroRedundancyOptimizer (parameters_as_bucket_view=True) and
FSDP2 `fully_shard` with reshard_after_forward True (ZeRO-3-like) and False (ZeRO-2-like). Each
round runs one optimizer step of every system, in an order rotated each round so that no system
always follows the same neighbour; a barrier precedes each timed step; a step's time is the
slowest rank's. Reported: median step time, spread (min-max over rounds), ratios to torch DDP
and to FSDP2 by three estimators (the median and the minimum of the wall time, and the median of
the CPU seconds the rank's process spent in the step, gloo's threads included: less sensitive to
a neighbour's load on a shared machine), model-state bytes per rank between steps, the peak bytes per rank during a step
(MemTracker over one extra untimed step of every system, the same way for each: the states held
before it plus activations, gradients, buckets, gathered weights and temporaries; the largest
over ranks), and bytes and collectives per step (torch's systems counted by a TorchDispatchMode
that sees c10d ops, course/demos/fsdp.py's counter; zerolab's by its ledger, which names a gloo
reduce_scatter as one although it runs as an in-place all_reduce; one extra untimed step).
Then each system's step collectives are replayed alone, same sizes and order (course/commfloor.py):
the `comm` column is the CPU ratio to torch DDP if all but the collectives cost what torch
DDP's step does - the part of a ratio that communication sets on this machine.
The torchlike-* systems are zerolab's stages behind torch's interfaces (zerolab.torchlike:
DistributedDataParallel with torch's 25 MiB buckets, + ZeroRedundancyOptimizer, fully_shard with
layout dim0 and flat), run by the same loop as torch's systems; `--systems` picks them.
`zerolab bench --meter-cost` instead times `zerolab train`'s step of each zerolab stage with the
memory meter sampling, idle and absent (course/metercost.py, the same options).

    zerolab bench --nproc 2 --preset small --rounds 7
    zerolab bench --preset small --meter-cost --rounds 21

All systems run fp32 on CPU (torch DDP's bf16 mixed precision needs CUDA events). Model states
per rank ("states MB", and "B/Ψ" = states / Ψ) therefore differ by design: zerolab's stages keep
a separate fp32 master copy even in fp32 (`theory.bytes_per_param`: every stage runs the code
path of bf16 mixed precision), so zerolab DDP holds 20 bytes per parameter = weight 4 + gradient
4 + master 4 + exp_avg 4 + exp_avg_sq 4 (ZeRO-1/2/3 shard them: 8 + 12/N, 4 + 16/N, 20/N);
torch's AdamW updates the fp32 weights in place, no master copy: torch DDP 16 bytes (4 + 4 + 4 +
4), FSDP2 16/N; the torchlike-* systems step torch's AdamW too (no master copy). With
--link-gbps only zerolab's systems run: the emulator sits in zerolab's Comm, torch's collectives
do not pass through it. On a shared machine the figures are noisy: read the spread.
Gradient bucket size: `--bucket-mb MB` for every zerolab DDP / ZeRO-1 / ZeRO-2 system, or a
system named NAME@MB (e.g. `--systems zerolab-ddp,zerolab-ddp@4,zerolab-ddp@25,torch-ddp`) to
interleave several bucket sizes in one run (MiB, torch DDP's bucket_cap_mb unit; zerolab's own
default is one bucket per block). bench writes OUT/bench.json (or OUT/meter_cost.json) and a run
manifest, OUT/run.json; an earlier run's files move aside to OUT.1, ... (--overwrite deletes them
instead: run/folders.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import theory
from ..variants.compose import make_strategy
from ..timing import linkemu
from . import commfloor
from ..comm import Comm
from ..data import get_batch, load_tokens, rank_slice
from ..model import GPT, get_config, num_params
from ..run import options
from ..run.options import check_seed
from ..run.rank import rank_entry
from ..sharding import storage_bytes
from ..variants.prefetch import DEFAULT_PREFETCH

ZEROLAB = {"zerolab-ddp": (0, None), "zerolab-zero1": (1, None), "zerolab-zero2": (2, None),
           "zerolab-zero3": (3, DEFAULT_PREFETCH), "zerolab-zero3-noprefetch": (3, 0)}
TORCH = ("torch-ddp", "torch-ddp-zero", "fsdp2-reshard", "fsdp2-noreshard")
# zerolab's strategies behind torch's interfaces (zerolab.torchlike), the loop torch's systems run
TORCHLIKE = ("torchlike-ddp", "torchlike-ddp-zero", "torchlike-fsdp", "torchlike-fsdp-flat")
SYSTEMS = (*ZEROLAB, *TORCH, *TORCHLIKE)


def split_system(name: str) -> tuple[str, float | None]:
    """"zerolab-ddp@4" -> ("zerolab-ddp", 4.0): a zerolab stage 0-2 system with a 4 MiB bucket
    cap; "zerolab-ddp" -> ("zerolab-ddp", None). ValueError (one line) for a bad name or cap."""
    base, at, mb = name.partition("@")
    if base not in SYSTEMS:
        raise ValueError(f"system {name!r} is not one of {', '.join(SYSTEMS)} "
                         "(zerolab-ddp/zero1/zero2 may end in @MB, a bucket cap in MiB)")
    if not at:
        return base, None
    if base not in ZEROLAB or ZEROLAB[base][0] == 3:
        raise ValueError(f"system {name!r}: only zerolab-ddp, zerolab-zero1 and zerolab-zero2 "
                         "take a bucket cap @MB")
    return base, theory.check_finite(f"system {name!r}: bucket cap", mb, positive=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class System:
    """One way to train the GPT: `step(x, y)` runs forward, backward and the optimizer step."""

    def __init__(self, name, cfg, args, comm):
        self.name = name
        torch.manual_seed(args.seed)
        model = GPT(cfg)
        adamw = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
        self.strategy, self.optimizer, self.comm = None, None, None
        base, bucket_mb = split_system(name)
        if base in ZEROLAB:
            stage, prefetch = ZEROLAB[base]
            kwargs = {"prefetch": prefetch} if stage == 3 else {
                "bucket_mb": bucket_mb if bucket_mb is not None else args.bucket_mb}
            self.strategy = make_strategy(stage, model, comm, max_grad_norm=0.0, **kwargs, **adamw)
            self.model = model
            return
        if base in TORCHLIKE:
            self._torchlike(base, model, comm, adamw)
            return
        if name.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            reshard = name == "fsdp2-reshard"
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            self.model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            self.optimizer = torch.optim.AdamW(model.parameters(), **adamw)
            return
        from torch.nn.parallel import DistributedDataParallel
        self.model = DistributedDataParallel(model)
        if name == "torch-ddp-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                     parameters_as_bucket_view=True, **adamw)
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), **adamw)

    def _torchlike(self, base, model, comm, adamw):
        from .. import torchlike as tl
        self.comm = comm
        if base.startswith("torchlike-fsdp"):
            layout = "flat" if base.endswith("flat") else "dim0"
            for block in model.blocks:
                tl.fully_shard(block, layout=layout, comm=comm)
            self.model = tl.fully_shard(model, layout=layout, comm=comm)
            self.optimizer = torch.optim.AdamW(model.parameters(), **adamw)
            return
        self.model = tl.DistributedDataParallel(model, comm=comm)     # bucket_cap_mb 25, torch's
        self.optimizer = (tl.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                     comm=comm, **adamw)
                          if base == "torchlike-ddp-zero"
                          else torch.optim.AdamW(model.parameters(), **adamw))

    def step(self, x, y):
        if self.strategy is not None:
            self.strategy.backward(self.strategy.forward(x, y))
            self.strategy.step()
            return
        self.model(x, y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def state_bytes(self) -> int:
        """Model-state bytes this rank holds between steps (params, grads, optimizer state)."""
        if self.strategy is not None:
            held = self.strategy.state_tensors()
            return sum(storage_bytes(held.get(s, [])) for s in theory.STATES)
        params = [_local(p) for p in self.model.parameters()]
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        opt = getattr(self.optimizer, "optim", self.optimizer)       # ZeroRedundancyOptimizer
        states = [_local(v) for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        return storage_bytes(params) + storage_bytes(grads) + storage_bytes(states)

    def held(self) -> tuple:
        """What this system holds between steps, for MemTracker's `track_external`: the model,
        the optimizer (and ZeroRedundancyOptimizer's local one), zerolab's flat buffers."""
        if self.strategy is not None:
            held = self.strategy.state_tensors().values()
            return (self.model, self.strategy.optimizer,
                    *(t for ts in held for t in ts if t is not None))
        return (self.model, self.optimizer, getattr(self.optimizer, "optim", None))


def slowest_rank(per_rank: list[dict], key, rounds: int) -> list[float]:
    """Per timed round, the slowest rank's step time: per_rank[r][key] lists rank r's seconds."""
    return [max(times[key][i] for times in per_rank) for i in range(rounds)]


def peak_bytes(system, x, y) -> int:
    """Peak bytes this rank holds during one step of `system`, seen by MemTracker
    (memory.allocator_peak): the states held before the step plus every tensor the step allocates
    (activations, gradients, buckets, gathered weights, optimizer temporaries). The same
    measurement for zerolab and torch; CPU tensors only."""
    from ..memory import allocator_peak
    return allocator_peak(lambda: system.step(x, y), torch.device("cpu"),
                          external=system.held())["peak_absolute"]


MODULE = "zerolab.course.bench"             # what torchrun starts on every rank
# the systems `--meter-cost` times (zerolab.course.metercost): zerolab train's step of each stage
METER_STAGES = {"zerolab-ddp": 0, "zerolab-zero1": 1, "zerolab-zero2": 2, "zerolab-zero3": 3}
SHARED = ("preset", "batch_size", "lr", "seed", "bucket_mb", "link_gbps", "link_latency_us", "out")
DEFAULTS = {"preset": "small", "batch_size": 8, "lr": 1e-3, "seed": 0, "out": "runs/bench",
            "nproc": 2, "timeout": 1800}


def parser(p: argparse.ArgumentParser | None = None, launcher: bool = False):
    """The bench's options: the training options it shares (`zerolab.run.options`), then its own;
    with `launcher` also --nproc and --timeout (`zerolab bench`). Into `p` if given."""
    if p is None:
        p = argparse.ArgumentParser(prog=MODULE, description=__doc__.split("\n")[0])
    if launcher:
        options.add(p, ("nproc", "timeout"), DEFAULTS, {"nproc": "gloo ranks on this machine"})
    options.add(p, SHARED, DEFAULTS, {
        "bucket_mb": "gradient bucket cap in MiB of zerolab-ddp/zero1/zero2 (default: one bucket "
                     "per block); a system NAME@MB overrides it, e.g. zerolab-ddp@4",
        "link_gbps": "emulated link, Gb/s per rank (zerolab systems only)",
        "out": "writes OUT/bench.json (OUT/meter_cost.json with --meter-cost)"})
    p.add_argument("--systems", default=",".join((*ZEROLAB, *TORCH)),
                   help="comma list of systems (the torchlike ones run only when named)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (one step of every system each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    if launcher:
        p.add_argument("--meter-cost", action="store_true", help="instead: zerolab stages' train "
                       "step with and without the memory meter (course/metercost.py; "
                       "OUT/meter_cost.json)")
    return p


def rank_argv(args) -> list[str]:
    """What `zerolab bench` passes to its ranks (of this module, or of `metercost` with
    --meter-cost): the shared options, then the bench's own."""
    return options.to_argv(SHARED, vars(args)) + ["--systems", args.systems, "--rounds",
                                                  str(args.rounds), "--warmup", str(args.warmup)]


def parse_systems(text: str, link: bool) -> list[str]:
    """"zerolab-ddp,torch-ddp" -> list; ValueError names an unknown system."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names:
        split_system(s)
    if len(set(names)) < len(names):
        raise ValueError(f"--systems {text!r} names a system twice")
    if not names:
        raise ValueError("--systems is empty")
    return [s for s in names if split_system(s)[0] in (*ZEROLAB, *TORCHLIKE)] if link else names


def check_args(args, world_size: int) -> list[str]:
    """Raise ValueError (one line) for bad values; return the systems to run."""
    get_config(args.preset)
    check_seed(args.seed)
    theory.check_finite("--lr", args.lr, positive=True)
    for name in ("rounds", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.warmup < 1:
        raise ValueError(f"--warmup {args.warmup} must be >= 1 (the first step builds AdamW's state)")
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by world_size {world_size}")
    linkemu.from_args(args.link_gbps, args.link_latency_us, world_size)
    if getattr(args, "bucket_mb", None) is not None:
        theory.check_finite("--bucket-mb", args.bucket_mb, positive=True)
    systems = parse_systems(args.systems, args.link_gbps is not None)
    if getattr(args, "meter_cost", False) and not set(systems) & set(METER_STAGES):
        raise ValueError(f"--meter-cost times {', '.join(METER_STAGES)}: --systems "
                         f"{args.systems!r} names none of them")
    return systems


def run(args) -> dict | None:
    """Every rank: build the systems, run the rounds; rank 0 returns the summary."""
    torch.set_num_threads(1)
    comm = Comm()
    rank, n = comm.rank, comm.world_size
    comm.link = linkemu.from_args(args.link_gbps, args.link_latency_us, n)
    cfg = get_config(args.preset)
    systems = [System(name, cfg, args, comm) for name in check_args(args, n)]
    tokens, _ = load_tokens(None, cfg.block_size)
    times = {s.name: [] for s in systems}
    cpu = {s.name: [] for s in systems}             # process CPU seconds (gloo's threads too)
    for r in range(args.warmup + args.rounds):
        x, y = get_batch(tokens, r, args.batch_size, cfg.block_size, args.seed)
        x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
        k = r % len(systems)
        for s in systems[k:] + systems[:k]:             # rotate the order every round
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            s.step(x, y)
            if r >= args.warmup:
                times[s.name].append(time.perf_counter() - t0)
                cpu[s.name].append(time.process_time() - c0)
    x, y = get_batch(tokens, 0, args.batch_size, cfg.block_size, args.seed)
    x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
    traffic = {s.name: commfloor.count_traffic(s, x, y) for s in systems}
    comm_s = {s.name: (commfloor.replay(traffic[s.name][2]) if traffic[s.name][2] is not None
                       and comm.link is None else None) for s in systems}   # same on every rank
    memory = {s.name: s.state_bytes() for s in systems}
    peaks = {s.name: peak_bytes(s, x, y) for s in systems}
    gathered = [None] * n
    dist.all_gather_object(gathered, (times, peaks, cpu, comm_s))
    if rank != 0:
        return None
    rows = []
    for s in systems:
        slowest = slowest_rank([g[0] for g in gathered], s.name, args.rounds)
        cpu_s = slowest_rank([g[2] for g in gathered], s.name, args.rounds)
        rows.append({"system": s.name, "median_s": statistics.median(slowest),
                     "cpu_median_s": statistics.median(cpu_s), "cpu_s": cpu_s,
                     "min_s": min(slowest), "max_s": max(slowest), "times_s": slowest,
                     "state_bytes": memory[s.name],
                     "peak_bytes": max(g[1][s.name] for g in gathered),
                     "peak_bytes_by_rank": [g[1][s.name] for g in gathered],
                     "bytes_per_step": traffic[s.name][0],
                     "collectives_per_step": traffic[s.name][1],
                     "comm_alone": commfloor.slowest_replay([g[3][s.name] for g in gathered])})
    ref = {r["system"]: r for r in rows}
    for row in rows:
        for key, est in (("", "median_s"), ("_min", "min_s"), ("_cpu", "cpu_median_s")):
            row["vs_torch_ddp" + key] = (row[est] / ref["torch-ddp"][est] if "torch-ddp" in ref
                                         else None)
        row["comm_floor"] = commfloor.comm_floor(row, ref.get("torch-ddp"))
        row["vs_fsdp2"] = (row["median_s"] / ref["fsdp2-reshard"]["median_s"]
                           if "fsdp2-reshard" in ref else None)
    with torch.device("meta"):
        psi = num_params(GPT(cfg))
    return {"preset": args.preset, "world_size": n, "num_params": psi, "rounds": args.rounds,
            "warmup": args.warmup,
            "batch_size": args.batch_size, "precision": "fp32", "backend": dist.get_backend(),
            "bucket_mb": args.bucket_mb,
            "requested": [s.strip() for s in args.systems.split(",") if s.strip()],
            "link": ({"gbps": args.link_gbps, "latency_us": args.link_latency_us or 0.0}
                     if args.link_gbps else None), "rows": rows}


def format_table(summary: dict) -> str:
    """The bench table: median ms, spread, ratios, MB per rank, MB moved, collectives."""
    link = summary["link"]
    lines = [f"{summary['preset']} GPT, {summary['world_size']} ranks, {summary['backend']}, fp32, "
             f"{summary['rounds']} rounds (median, min-max of the slowest rank)"
             + (f", emulated link {link['gbps']} Gb/s + {link['latency_us']} us" if link else "")
             + (f", zerolab buckets {summary['bucket_mb']:g} MiB" if summary.get("bucket_mb")
                else ""),
             f"{'system':<24}{'median ms':>10}{'min-max ms':>16}{'x torch DDP':>12}{'min':>6}"
             f"{'cpu':>6}{'comm':>6}{'x FSDP2':>9}"
             f"{'states MB':>11}{'B/Ψ':>6}{'peak MB':>9}{'moved MB':>10}{'colls':>7}"]
    psi = summary.get("num_params")
    for r in summary["rows"]:
        ratio = (lambda v: f"{v:.2f}" if v is not None else "-")
        spread = f"{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}"
        per_param = f"{r['state_bytes'] / psi:.1f}" if psi else "-"
        lines.append(f"{r['system']:<24}{r['median_s'] * 1e3:>10.1f}{spread:>16}"
                     f"{ratio(r['vs_torch_ddp']):>12}{ratio(r.get('vs_torch_ddp_min')):>6}"
                     f"{ratio(r.get('vs_torch_ddp_cpu')):>6}{ratio(r.get('comm_floor')):>6}"
                     f"{ratio(r['vs_fsdp2']):>9}"
                     f"{r['state_bytes'] / 1e6:>11.2f}{per_param:>6}{r['peak_bytes'] / 1e6:>9.2f}"
                     f"{r['bytes_per_step'] / 1e6:>10.2f}"
                     f"{r['collectives_per_step']:>7}")
    names = [r["system"] for r in summary["rows"]]
    lines += textwrap.wrap(
        "x torch DDP / x FSDP2: median step time over torch-ddp's / fsdp2-reshard's; min, cpu: "
        "the same ratio of the fastest round, and of the median CPU seconds; comm: the CPU ratio "
        "if all but the collectives cost what torch DDP's step does (the step's collectives "
        "replayed alone, same sizes and order: zerolab/course/commfloor.py); on a CPU machine "
        "gloo's copies and sums share the cores with the model and no overlap hides them, so "
        "cpu - comm is what the rest of the step costs more (or less: a ZeRO stage's AdamW "
        "covers 1/N of the elements, about 0.03 on small with 2 ranks) than torch DDP's, up to "
        "the noise of the medians; - with --link-gbps "
        "or a collective on a subgroup (not replayed). states: "
        "model-state bytes per rank between steps; B/Ψ: states per parameter - fp32, so zerolab "
        "DDP holds 20 (weight, gradient, fp32 master copy, exp_avg, exp_avg_sq: 4 each; zerolab "
        "keeps the master copy in fp32 runs too) and torch DDP 16 (AdamW updates the weights in "
        "place: no master copy), the ZeRO stages and FSDP2 less by sharding; "
        "peak: MemTracker's peak during a step "
        "(activations and temporaries too); moved: per-rank ring bytes per step (nccl-tests "
        "convention; zerolab's from its ledger, torch's from a c10d counter); colls: "
        "collectives per step. MB = 1e6 bytes.", 100)
    if summary["preset"] != "small":
        lines += textwrap.wrap(
            f"The ratios in docs/measured.md are for --preset small. On {summary['preset']} each step has "
            "less compute, so costs paid once per step or per collective (Python hooks, the "
            "ledger, launching a collective) weigh more: zerolab's ratios to torch come out "
            "larger (zerolab DDP measured 1.3-3.9x torch DDP on nano, 1.04-1.05x on small).", 100)
    if link:
        skipped = [s for s in summary.get("requested", names) if s not in names]
        if skipped:
            lines.append(f"not run with the emulated link (torch's collectives do not pass "
                         f"through zerolab's Comm): {', '.join(skipped)}")
    return "\n".join(lines)


def rank_main(argv, measure, table, filename: str, prog: str = MODULE) -> int:
    """A bench rank: parse and check `argv`, then rank 0 writes OUT/`filename` from `measure(args)`
    (every rank runs it; rank 0's returns the summary) and prints `table(summary)`."""
    import datetime
    import os
    args = parser(argparse.ArgumentParser(prog=prog)).parse_args(argv)
    try:
        check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as err:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        summary = measure(args)
        if summary is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / filename).write_text(json.dumps(summary, indent=1))
            print(table(summary), flush=True)
            print(f"wrote {out.resolve() / filename}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    return rank_main(argv, run, format_table, "bench.json")


if __name__ == "__main__":
    rank_entry(main)
