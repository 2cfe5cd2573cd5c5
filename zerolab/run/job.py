"""A training job from the launcher's side: check everything, own the run folder, start the ranks.

Idea: whatever door a run comes through (`zerolab train`, `zerolab compare`, `nb.launch` in a
notebook), the launching process does the same three things, in this order, and never
initialises CUDA or runs a collective itself:

1. `check(args)`: every option (`options.check`), the backend and device for this node
   (`launch.resolve`), the process limits a rank needs (`ulimit -v`, `ulimit -n`: `resources`),
   a checkpoint to resume from (every file's sha256), the output folder, the rendezvous
   endpoint, the data file, and whether one step fits in this machine's memory (`fit.check_fits`) -
   before any process starts, each failure one line (ValueError).
2. `started(args, command)`: the run owns OUT while it lasts (a lock and a manifest,
   `folders.start_run`), so a second run into the same folder is refused.
3. `start_ranks(...)`: torchrun starts the ranks of `python -m zerolab.run.train` with
   `options.rank_argv(args)` and the run id; their output streams through, and a failure
   raises `launch.LaunchError` with the failing rank's one line (or its traceback when it
   could not say why; a rank that ran out of something is one line naming it, and what the
   run keeps). The manifest records how the run ended: status and reason.

    args = options.parser("train").parse_args(["--stage", "2", "--nproc", "4"])
    backend, device = check(args)
    with started(args, "train") as run_id:
        start_ranks(args, run_id, backend, device)
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import time

from ..data import load_tokens
from . import options
from .ckptio import kept_in
from .folders import check_out_dir, start_run
from .launch import LaunchError, auto_note, resolve, run_torchrun
from . import fit
from .preflight import (START_PER_RANK, check_cores, check_data_path, check_rdzv_endpoint,
                        usable_cores)
from .resources import ResourceError, check_address_space, check_open_files, describe


def check(args, given: set[str] | None = None) -> tuple[str, str]:
    """Validate everything a launch needs, before any process starts; return (backend, device).

    args: parsed options of `zerolab train` / `compare` (args.nproc, args.nnodes ... included).
    given: the options named on the command line (`options.given_options`), needed with
    --resume: the others are taken from the checkpoint. Raises ValueError (one line), also
    ResourceError when this process runs out of memory (or files) while checking."""
    try:
        return _check(args, given)
    except ValueError:
        raise
    except Exception as err:                # noqa: BLE001 - MemoryError, EMFILE: one line
        why = describe(err)
        if why is None:
            raise
        raise ResourceError(f"{why[0]}, while checking the run: nothing was started or "
                            f"written; {why[1]}") from None


def _check(args, given: set[str] | None) -> tuple[str, str]:
    check_address_space()                   # `ulimit -v` below what any rank needs: one line
    backend, device = resolve(args.nproc, args.backend, args.device, args.nnodes)
    check_cores(args.nproc, device)         # far more ranks than cores: refused, one line
    check_open_files(args.nproc)            # `ulimit -n` too (it would hang the rendezvous)
    world_size = args.nproc * args.nnodes
    if getattr(args, "resume", None):       # fills the options not given from the checkpoint
        options.check_resume(args, given or set(), world_size)
    cfg = options.check(args, world_size)
    if getattr(args, "ranks_per_node", None) is not None:   # --link-gbps: the ranks refuse it
        options.check_backend(args, backend)
    check_out_dir(args.out)
    if args.rdzv_endpoint is not None:
        check_rdzv_endpoint(args.rdzv_endpoint)
    if args.data is not None:
        check_data_path(args.data)
    load_tokens(args.data, cfg.block_size)
    fit.check_fits(args, world_size, device)   # the predicted peak (zerolab fit), with advice
    return backend, device


@contextlib.contextmanager
def started(args, command: str, overwrite: bool | None = None):
    """Start the run in --out (lock + manifest, `folders.start_run`) and yield its run id; the
    manifest records the end status. A node other than node 0 starts no run (node 0 owns it)
    and yields None. overwrite: replace a run OUT holds (default: args.overwrite)."""
    if getattr(args, "node_rank", 0):
        yield None
        return
    with start_run(args.out, command=command, args=vars(args),
                   overwrite=args.overwrite if overwrite is None else overwrite,
                   world_size=args.nproc * getattr(args, "nnodes", 1),
                   resume=getattr(args, "resume", None)) as run:
        yield run.run_id


def _say(line: str):
    print(line, flush=True)


def estimate(args, device: str) -> str:
    """The line said before a launch on CPU: what the run will cost (`estimate_seconds`:
    the cost model's FLOPs at this machine's measured speed) and, when that is longer than LONG
    seconds, how to make it shorter (fewer steps, a smaller preset); the cores warning
    (`preflight.check_cores`) before it when there is one. "" on CUDA, which is not measured
    here (the launcher never initialises CUDA): the first step's time tells (`Pace`)."""
    from ..model import PRESETS, get_config
    warning = check_cores(args.nproc, device)
    lines = [f"zerolab: {warning}"] if warning else []
    if device != "cpu":
        return "\n".join(lines)
    cfg, stages = options.model_config(args), len(options.parse_stages(args.stages))
    rows = args.batch_size // args.nnodes           # this node's share of the global batch
    est = estimate_seconds(cfg, steps=args.steps, stages=stages, batch_size=rows,
                           nproc=args.nproc, precision=args.precision)
    line = (f"zerolab: about {format_seconds(est['total'])} in all ({stages} stage(s) x "
            f"{args.steps} step(s) of ~{format_seconds(est['step'])}: {_si(est['flop'])}FLOP a "
            f"step at ~{_si(est['rate'])}FLOP/s, {args.nproc} rank(s) on "
            f"{usable_cores()} core(s) in {args.precision}, x{est['slow']:.2g} for this "
            f"machine's load, "
            f"measured now; the first step tells)")
    if est["total"] > LONG:
        per = (est["total"] - est["step"] * args.steps * stages) / max(stages, 1)
        steps = max(1, int((LONG / stages - per) / est["step"]))
        ideas = []
        if steps < args.steps:
            shorter = per * stages + steps * stages * est["step"]
            ideas.append(f"--steps {steps} (~{format_seconds(shorter)})")
        names = list(PRESETS)
        if args.preset in names and names.index(args.preset) > 0:
            smaller = names[names.index(args.preset) - 1]
            shape = {"block_size": args.block_size} if args.block_size else {}
            small = estimate_seconds(get_config(smaller, **shape), steps=args.steps,
                                     stages=stages, batch_size=rows, nproc=args.nproc,
                                     flops_per_core=est["per_core"], slow=est["slow"])
            ideas.append(f"--preset {smaller} (~{format_seconds(small['total'])})")
        if ideas:
            line = line[:-1] + f"; shorter: {' or '.join(ideas)})"
    return "\n".join(lines + [line])


def _si(x: float) -> str:
    """1.87e10 -> "18.7 G" (k, M, G, T, P)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.3g} "


_PROGRESS = re.compile(r"^\[stage (\d+)\] step (\d+)/(\d+) .* (\d+) ms$")


class Pace:
    """An echo that passes every line on and, after the first progress line of rank 0 in each
    stage (`[stage S] step K/N ... T ms`), says what the whole run will take at that step's
    pace: the steps left in this stage and in the stages after it, x T, plus the time so far
    (nothing when no step is left). Said again at each stage's first step: a later stage's
    steps are slower (ZeRO-3 gathers the weights), so the first line runs low for `compare`
    and each stage's line corrects it."""

    def __init__(self, echo, stages: list[int]):
        self.echo, self.stages, self.t0, self.said = echo, stages, time.monotonic(), set()

    def __call__(self, line: str):
        self.echo(line)
        m = _PROGRESS.match(line.strip())
        if m is None or int(m.group(1)) in self.said:
            return
        stage, k, n, ms = (int(g) for g in m.groups())
        self.said.add(stage)
        later = self.stages[self.stages.index(stage) + 1:] if stage in self.stages else []
        left = (n - k) + n * len(later)
        if left == 0:
            return
        rest = left * ms / 1e3
        self.echo(f"zerolab: step {k} took {format_seconds(ms / 1e3)}; at that pace the {left} "
                  f"step(s) left take ~{format_seconds(rest)}, the run ~"
                  f"{format_seconds(time.monotonic() - self.t0 + rest)} in all (Ctrl-C stops "
                  "every rank)")


def start_ranks(args, run_id: str | None, backend: str, device: str, *, echo=_say,
                announce: bool = True, argv: list[str] | None = None) -> str:
    """torchrun `zerolab.run.train` with args' options (`options.rank_argv`, or `argv` when
    given: a checkpoint then fills the options it leaves out) on args.nproc local ranks
    (args.nnodes nodes) with the checked `backend` and `device`, stopped after args.timeout
    seconds; returns the ranks' output, raises launch.LaunchError when the run fails. announce:
    first say in one line what runs (and in another why "auto" chose the CPU, when it did
    although GPUs are visible), what it will cost (`estimate`; a warning when the ranks
    outnumber the cores), and after the first step what the whole will take (`Pace`)."""
    if announce:
        echo(f"zerolab: {args.nproc * args.nnodes} rank(s), {backend} on {device}, stages "
             f"{args.stages}, preset {args.preset}" + (f", run {run_id}" if run_id else ""))
        note = auto_note(args.nproc, args.backend, args.device, backend, device)
        if note:
            echo(f"zerolab: {note}")
        cost = estimate(args, device)
        if cost:
            echo(cost)
        echo = Pace(echo, options.parse_stages(args.stages))
    if argv is None:
        argv = options.rank_argv(args, backend=backend, device=device)
    argv = argv + (["--run-id", run_id] if run_id else [])
    try:
        return run_torchrun(argv, args.nproc, timeout=args.timeout, nnodes=args.nnodes,
                            node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, echo=echo)
    except LaunchError as err:                  # ran out before a rank could say it: add what
        if err.ran_out is None:                 # the run keeps
            raise
        line, todo = str(err).split("\n")[0], err.ran_out[1]
        line = line[:-len(todo) - 2] if line.endswith(f"; {todo}") else line
        raise LaunchError(f"{line}: {kept_in(args.out)}; {todo}", ran_out=err.ran_out) from None


# --- what a run will cost -------------------------------------------------------------------
def core_flops(dtype: str = "bf16", seconds: float = 0.1, size: int = 512) -> float:
    """FLOP/s of one CPU core on `size` x `size` matrix products in `dtype` ("bf16", "fp32"),
    measured now for about `seconds` on one thread: the fastest product of the window, so the
    figure is the core's own speed and not how busy the machine happened to be
    (`probe` measures that)."""
    return probe(dtype, seconds=seconds, size=size, threads=1)["per_core"]


def probe(dtype: str = "bf16", seconds: float = 0.1, size: int = 512, threads: int = 1) -> dict:
    """This machine's speed and load now: `threads` threads (one per rank that will have a
    core) each time `size` x `size` products in `dtype` one thread each, for about `seconds`.

    Returns {"per_core": FLOP/s of the fastest product (the core's speed, unloaded),
    "slow": one over the mean share of a core the threads got, CPU time over wall time (>= 1:
    how much the other processes running now slow a rank down)}. The fastest product is the
    core's own speed; a load that takes the core for part of the time shows in the share only.
    Measured on 2 cores:
    a single 0.1 s mean read 31.5 and 328 GFLOP/s in two runs; see `estimate_seconds`."""
    import statistics
    import threading

    import torch
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    times: list[float] = []
    shares: list[float] = []                   # the share of a core each thread had

    def run():
        torch.set_num_threads(1)               # OpenMP's count is per thread: each sets its own
        a, b = torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt)
        a @ b                                  # warm-up
        mine, cpu0, wall0 = [], time.thread_time(), time.perf_counter()
        while True:
            t0 = time.perf_counter()
            a @ b
            t1 = time.perf_counter()
            mine.append(t1 - t0)
            if t1 - wall0 >= seconds and len(mine) >= 3:
                break
        shares.append((time.thread_time() - cpu0) / (t1 - wall0))
        times.extend(mine)

    try:
        workers = [threading.Thread(target=run) for _ in range(max(1, threads) - 1)]
        for w in workers:
            w.start()
        run()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(before)
    share = statistics.mean(shares)
    return {"per_core": 2 * size ** 3 / min(times), "slow": 1 / max(share, 0.05)}


def load_slow(nproc: int, cores: int) -> float:
    """How much the machine's load over the last minute slows `nproc` ranks on `cores` cores:
    the other runnable processes (the 1-minute load average, in this process's share of the
    machine's CPUs) and the ranks share the cores; >= 1. 1.0 where there is no load average."""
    try:
        load = os.getloadavg()[0] * cores / (os.cpu_count() or cores)
    except (AttributeError, OSError):
        return 1.0
    return max(1.0, (load + nproc) / max(cores, nproc))


#: the share of `core_flops` (a core's fastest 512 x 512 product) a rank's training step
#: reaches (attention, layer norms, the optimizer, Python around the matrix products):
#: preset small, 2 ranks on 2 cores, bf16: ~0.5 s a step at a load of 5 (x~3), 18.7 GFLOP,
#: cores at ~220 GFLOP/s: ~0.4 (docs/measured.md)
STEP_EFFICIENCY = 0.4
#: what a step costs beyond its FLOPs (collectives' latency, the loss's all_reduce, logging,
#: Python around small kernels), seconds on an unloaded core: nano's steps take 15-30 ms at
#: a load of 5 on 2 cores (x2-4), almost none of it FLOPs (docs/measured.md)
STEP_OVERHEAD = 0.01
#: starting the launcher, torchrun and the ranks (torch's import in each) and ending the run,
#: seconds on an unloaded core: fitted to 6 launches of nano, tiny and small (1, 2, 4 ranks;
#: 1 and 4 stages) on 2 cores at loads of 1 to 5, with `slow` measured before each
#: (docs/measured.md), then lowered a sixth (the test's launches took 0.56-1.14 times their
#: estimate, most 0.6-0.9); most of a short run
START = 5.0
#: seconds each stage adds on an unloaded core (building it, its first step's warm-up,
#: its last step's memory cross-check): fitted with START
PER_STAGE = 0.5
#: a run estimated longer than this (seconds) is told how to be shorter
LONG = 120.0


def format_seconds(seconds: float) -> str:
    """"45 s", "3 min 20 s", "2 h 05 min"."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m} min {s:02d} s"
    h, m = divmod(int(round(seconds / 60)), 60)
    return f"{h} h {m:02d} min"


def estimate_seconds(cfg, *, steps: int, stages: int, batch_size: int, nproc: int,
                     precision: str = "bf16", flops_per_core: float | None = None,
                     cores: int | None = None, slow: float | None = None) -> dict:
    """What a CPU run will cost, seconds: START (+ START_PER_RANK per rank beyond the cores)
    and, per stage, PER_STAGE + steps x (the step's FLOPs over the ranks' cores + STEP_OVERHEAD),
    all times `slow`, how much the other processes running now slow a rank down.

    The step's FLOPs: the cost model's 6Ψ + 12·L·d·s per token (`timing.flops.flops_per_token`),
    batch_size x block_size tokens, all ranks together, at `flops_per_core` x STEP_EFFICIENCY
    on each of the cores the ranks share (at most one each). flops_per_core and slow default to
    `probe(precision, threads=the ranks' cores)`, measured now (~0.1 s); slow is the geometric
    mean of the probe's reading (capped at twice the other) and `load_slow` (the last minute).
    A small preset's step is mostly STEP_OVERHEAD (Python around small kernels), a large one's
    mostly FLOPs; starting (torch's import in every process) is most of a short run.
    Measured figures: docs/measured.md.
    Returns {"step", "total", "flop", "rate", "per_core", "slow"}: seconds a step, seconds in
    all, FLOPs a step, FLOP/s of all ranks, the core's FLOP/s and the slow-down used (pass
    them on to price another shape without measuring again)."""
    import torch

    from ..model import GPT, num_params
    from ..timing.flops import flops_per_token
    cores = usable_cores() if cores is None else cores
    with torch.device("meta"):
        psi = num_params(GPT(cfg))
    flop = flops_per_token(psi, n_layer=cfg.n_layer, d_model=cfg.n_embd,
                           seq_len=cfg.block_size) * batch_size * cfg.block_size
    if flops_per_core is None:
        now = probe(precision, threads=min(nproc, cores))
        flops_per_core = now["per_core"]
        if slow is None:                    # the load now and over the last minute, together;
            minute = load_slow(nproc, cores)    # 0.1 s can catch a burst: at most 2x the minute's
            slow = math.sqrt(min(max(1.0, now["slow"]), 2 * minute) * minute)
    slow = 1.0 if slow is None else max(1.0, slow)
    rate = min(nproc, cores) * flops_per_core * STEP_EFFICIENCY
    step = slow * (flop / rate + STEP_OVERHEAD * max(1.0, nproc / cores))
    total = (slow * (START + START_PER_RANK * max(0, nproc - cores) + stages * PER_STAGE)
             + stages * steps * step)
    return {"step": step, "total": total, "flop": flop, "rate": rate / slow,
            "per_core": flops_per_core, "slow": slow}
