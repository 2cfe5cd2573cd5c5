"""A training job from the launcher's side: check everything, own the run folder, start the ranks.

Idea: whatever door a run comes through (`zerolab train`, `zerolab compare`, `nb.launch` in a
notebook), the launching process does the same three things, in this order, and never
initialises CUDA or runs a collective itself:

1. `check(args)`: every option (`options.check`), the backend and device for this node
   (`launch.resolve`), the process limits a rank needs (`ulimit -v`, `ulimit -n`: `resources`),
   a checkpoint to resume from (every file's sha256), the output folder, the rendezvous
   endpoint, the data file, and whether one step fits in this machine's memory (`preflight`) -
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

from ..data import load_tokens
from . import options
from .ckptio import kept_in
from .folders import check_out_dir, start_run
from .launch import LaunchError, auto_note, resolve, run_torchrun
from .preflight import check_data_path, check_fits_memory, check_rdzv_endpoint
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
    check_fits_memory(cfg, batch_size=args.batch_size, nproc=args.nproc, world_size=world_size,
                      grad_accum=args.grad_accum, stages=args.stage_list, precision=args.precision,
                      device=device)
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


def start_ranks(args, run_id: str | None, backend: str, device: str, *, echo=_say,
                announce: bool = True, argv: list[str] | None = None) -> str:
    """torchrun `zerolab.run.train` with args' options (`options.rank_argv`, or `argv` when
    given: a checkpoint then fills the options it leaves out) on args.nproc local ranks
    (args.nnodes nodes) with the checked `backend` and `device`, stopped after args.timeout
    seconds; returns the ranks' output, raises launch.LaunchError when the run fails. announce:
    first say in one line what runs (and in another why "auto" chose the CPU, when it did
    although GPUs are visible)."""
    if announce:
        echo(f"zerolab: {args.nproc * args.nnodes} rank(s), {backend} on {device}, stages "
             f"{args.stages}, preset {args.preset}" + (f", run {run_id}" if run_id else ""))
        note = auto_note(args.nproc, args.backend, args.device, backend, device)
        if note:
            echo(f"zerolab: {note}")
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
