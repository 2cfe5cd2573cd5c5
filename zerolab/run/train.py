"""torchrun entry point: train the GPT with one or more stages and write OUT/stage{S}/rank{r}.json.

Idea: every rank builds the same model from the same seed, wraps it in the stage's strategy,
trains `--steps` optimizer steps on its own rows of each global batch, and writes what it held
(memory, measured and theory) and what it moved (the comm ledger) to its own JSON file
(`stage.run_stage`, phase by phase). Several stages can run one after another in one launch
(`--stages 0,1,2,3`), which is what `zerolab compare` does: same seed, same data, one process
start-up. `--save-every K` writes a sharded checkpoint every K steps and at the end, `--resume
DIR` continues from one, at any world size and stage (zerolab/run/checkpoint.py). The options
are `options.PROGRAMS["ranks"]`; a launcher (`zerolab train`, `nb.launch`) checks them first.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m zerolab.run.train \\
        --stages 0,1,2,3 --preset tiny --steps 5 --out runs/compare
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import load_tokens
from ..timing import linkemu
from . import ckptio, knobs, options
from .folders import atomic_json, begin_run
from .launch import RANK_ERROR, resolve
from .rank import check_device, free_port, port_is_free, rank_entry, setup
from .resources import describe
from .result import compare_rows, format_rows
from .stage import NonFinite, run_stage

PROG = RANK_ERROR.split(":")[0]             # "zerolab.run.train": how its error lines start


def agree_on_run(args, world_size: int, comm, device) -> str:
    """The run id every rank tags its files with: --run-id from a launcher (with several nodes
    only node 0's launcher passes one, and torchrun's c10d rendezvous may give rank 0 to another
    node, so the lowest rank that has one broadcasts it), else rank 0 starts a run of its own in
    --out (manifest and lock, `folders.begin_run`). Raises ValueError (on every rank) when rank 0
    could not start the run."""
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


def ran_out(err: BaseException, args, rank: int) -> str | None:
    """The one line for a rank that ran out of something (disk, memory, open files, processes,
    ports): what, on which rank, what the run keeps, what to do; None for any other error."""
    why = describe(err)
    if why is None:
        return None
    return f"{why[0]} on rank {rank}: {ckptio.kept_in(args.out)}; {why[1]}"


def main(argv=None) -> int:
    args = options.parser("ranks").parse_args(argv)
    given = options.given_options(options.parser("ranks"), argv)
    if "RANK" not in os.environ:     # plain `python -m zerolab.run.train`: a world of one
        port = os.environ.get("MASTER_PORT")
        if port and not port_is_free(port):
            print(f"{PROG}: error: MASTER_PORT {port} is taken; set another or unset "
                  "MASTER_PORT to let zerolab pick a free one", file=sys.stderr)
            return 2
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port or str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    ckpt = None
    try:
        if args.resume:
            ckpt, notes = options.check_resume(args, given, world_size)
            if notes and int(os.environ["RANK"]) == 0:
                print(f"{PROG}: resuming with {', '.join(notes)}", flush=True)
        cfg = options.check(args, world_size)
        if args.bucket_mb is not None and 3 in args.stage_list and int(os.environ["RANK"]) == 0:
            print(f"{PROG}: --bucket-mb applies to stages 0-2; ZeRO-3 keeps one unit per "
                  "block (it gathers one block at a time)", flush=True)
        if "auto" in (args.backend, args.device):      # a launcher passes both resolved
            args.backend, args.device = resolve(int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                                args.backend, args.device)
        check_device(args)
        train_tokens, val_tokens = load_tokens(args.data, cfg.block_size)
        link = linkemu.emulator(args.link_gbps, args.link_latency_us, world_size,
                                knobs.tiers(args, world_size))
        options.check_backend(args, args.backend)
    except ValueError as err:
        if int(os.environ["RANK"]) == 0:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:                # noqa: BLE001 - running out: one line, any rank
        line = ran_out(err, args, int(os.environ["RANK"]))
        if line is None:
            raise
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
        return 4
    comm, device = setup(args)
    comm.link = link
    status, reason = "failed", None
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
        reason = str(err)
        if comm.rank == 0:                  # every rank raised the same one-line error
            print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, ValueError) else 3
    except Exception as err:                # noqa: BLE001 - running out: one line, this rank's
        reason = ran_out(err, args, comm.rank)
        if reason is None:
            raise
        print(f"{PROG}: error: {reason}", file=sys.stderr, flush=True)
        return 4
    finally:
        if getattr(args, "_run", None) is not None:
            args._run.finish(status, **({"reason": reason} if reason else {}))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rank_entry(main)
