"""The `zerolab` command: memory | train | compare | labs | checkpoint | check | doctor.

    zerolab memory --params 7.5e9 --world-size 64     # the ZeRO paper's table, from the formulas
    zerolab train --stage 2 --nproc 4                  # one stage under torchrun
    zerolab compare                                    # stages 0-3 on this machine: the main job
    zerolab labs                                       # execute every lab notebook, write a report
    zerolab check ddp --impl my_ddp.py                 # grade an exercise (zerolab.exercises)
    zerolab doctor                                     # is this machine ready for the course?
    zerolab checkpoint consolidate DIR OUT             # sharded checkpoint -> plain GPT state dict

Every subcommand checks its arguments before any process starts and exits 2 with one line
naming the bad value; a failed launch exits 1 with the failing rank's traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from . import theory
from .launch import LaunchError, LaunchInterrupted, auto_note, resolve, run_torchrun
from .preflight import check_data_path, check_finite, check_fits_memory, check_rdzv_endpoint
from .runs import atomic_json, check_out_dir, start_run

class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" once: not when the help text already names its default, and not
    for on/off flags (their default is always off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or isinstance(action, argparse._StoreTrueAction):
            return text
        return super()._get_help_string(action)
TRAIN_FLAGS = ("preset", "block_size", "steps", "batch_size", "grad_accum", "precision",
               "zero1_grad_op", "lr", "max_grad_norm", "seed", "data", "timeout", "link_gbps",
               "link_latency_us", "zero3_prefetch_depth", "weight_decay", "grad_dtype", "bucket_mb")


def _number(positive: bool = False):
    """An argparse type: a finite float (> 0 when `positive`); the error names the value."""
    def parse(text):
        try:
            return check_finite("", text, positive=positive)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).strip()) from None
    parse.__name__ = "positive number" if positive else "number"
    return parse


_positive_float = _number(positive=True)


def _add_launch_args(p, stages_default, nproc_default, preset_default, steps_default):
    p.add_argument("--stage", "--stages", dest="stages", default=stages_default,
                   help="stage 0-3, or a comma list such as 0,1,2,3")
    p.add_argument("--nproc", type=int, default=nproc_default, help="ranks on this node")
    p.add_argument("--backend", default="auto", help="auto (NCCL if enough GPUs, else gloo), gloo, nccl")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (gloo on cuda shares GPUs)")
    p.add_argument("--preset", default=preset_default,
                   help="model size: nano, tiny, small (CPU); gpt2, medium, 1b (GPU)")
    p.add_argument("--block-size", type=int, default=None, help="context length (preset's if unset)")
    p.add_argument("--steps", type=int, default=steps_default, help="optimizer steps per stage")
    p.add_argument("--batch-size", type=int, default=8, help="global batch in rows")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="bf16: 2+2+4+4+4 bytes/param; fp32: exact equivalence runs")
    p.add_argument("--zero1-grad-op", default="all_reduce", choices=theory.ZERO1_GRAD_OPS,
                   help="ZeRO-1 gradient path: the notes' all_reduce, or reduce_scatter")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of 2-D weights (biases, LayerNorm: none; nanoGPT)")
    p.add_argument("--grad-dtype", default=None, choices=("bf16", "fp32"),
                   help="gradient dtype (default: --precision); fp32: 18 bytes/param")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="allow parameters that get no gradient in a step (torch DDP's flag)")
    p.add_argument("--max-grad-norm", type=_number(), default=1.0, help="global clipping; <= 0: none")
    p.add_argument("--seed", type=int, default=0, help="model init and batch sampling")
    p.add_argument("--data", default=None, help="a text file (default: Python stdlib sources)")
    p.add_argument("--timeline", action="store_true", help="record memory over the last step")
    p.add_argument("--zero3-prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="ZeRO-3: gather the next block while the current one computes (the "
                   "default); --no-zero3-prefetch: one block at a time, the notes' picture")
    p.add_argument("--save-params", action="store_true",
                   help="save each stage's final fp32 weights (every key of GPT.state_dict()) "
                   "to OUT/stage{S}/params.pt")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's forward in backward (torch.utils.checkpoint)")
    p.add_argument("--timeout", type=_positive_float, default=900,
                   help="seconds before the run is killed")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run OUT already holds (default: refuse)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulate a link of this many Gb/s per rank (gloo): see zerolab/linkemu.py")
    p.add_argument("--link-latency-us", type=float, default=None, help="emulated α, us per ring step")
    p.add_argument("--bucket-mb", type=_positive_float, default=None,
                   help="DDP / ZeRO-1 / ZeRO-2: gradient bucket cap in MiB (torch DDP's "
                   "bucket_cap_mb): consecutive blocks share one collective (default: one "
                   "bucket per block; ZeRO-3 ignores it)")
    p.add_argument("--zero3-prefetch-depth", type=int, default=None,
                   help="ZeRO-3: blocks gathered ahead (0, 1, 2, ...; -1 all; default 1)")
    p.add_argument("--zero3-keep-root", action="store_true",
                   help="ZeRO-3: keep the root unit gathered from forward into backward")
    p.add_argument("--trace", action="store_true",
                   help="Chrome/Perfetto trace of the last step but one: OUT/stage{S}/trace_rank{r}.json")
    p.add_argument("--nnodes", type=int, default=1, help="torchrun: number of nodes")
    p.add_argument("--node-rank", type=int, default=0, help="torchrun: this node's rank")
    p.add_argument("--rdzv-endpoint", default=None, help="torchrun: HOST:PORT of the first node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerolab", description="Hand-written DDP and ZeRO-1/2/3, measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    mem = sub.add_parser("memory", formatter_class=HELP, help="per-rank model-state bytes and traffic from the formulas")
    mem.add_argument("--params", type=_positive_float, default=7.5e9, help="Ψ, e.g. 7.5e9")
    mem.add_argument("--world-size", type=int, default=64, help="data-parallel ranks N")
    mem.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    mem.add_argument("--optimizer-bytes", type=_positive_float, default=None, help="K (default 12)")
    mem.add_argument("--grad-dtype", default=None, choices=("bf16", "fp32"),
                     help="gradient dtype (default: --precision); fp32: 18 bytes/param")

    tm = sub.add_parser("time", formatter_class=HELP, help="per-stage step time from the cost model (costmodel.py)")
    tm.add_argument("--params", type=_positive_float, default=7.5e9, help="Ψ, e.g. 7.5e9")
    tm.add_argument("--world-size", type=int, default=64, help="data-parallel ranks N")
    tm.add_argument("--tokens-per-rank", type=_positive_float, default=4096, help="tokens per rank per step")
    tm.add_argument("--blocks", type=int, default=32, help="equal blocks (ZeRO-3 gathers one at a time)")
    tm.add_argument("--link", default="ib-ndr", help="a named link profile (costmodel.LINKS; a wrong name lists them)")
    tm.add_argument("--link-gbps", type=_positive_float, default=None, help="custom bandwidth, Gb/s per rank per direction")
    tm.add_argument("--link-latency-us", type=float, default=None,
                    help="custom α, us per ring step (default: the named link's)")
    tm.add_argument("--device", default="h100", help="a named device profile (costmodel.DEVICES)")
    tm.add_argument("--device-tflops", type=_positive_float, default=None, help="custom peak, TFLOP/s")
    tm.add_argument("--efficiency", type=float, default=1.0, help="fraction of peak reached (MFU)")
    tm.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                    help="bytes per gradient and weight on the wire")

    wi = sub.add_parser("whatif", formatter_class=HELP, help="one rank of a large world on a fake process group (whatif.py)")
    wi.add_argument("--preset", default="1b", help="nano, tiny, small, gpt2, medium, 1b")
    wi.add_argument("--world-size", type=int, default=1024, help="data-parallel ranks N")
    wi.add_argument("--rank", type=int, default=0, help="which rank to run")
    wi.add_argument("--stage", "--stages", dest="stages", default="0,1,2,3", help="stage or comma list")
    wi.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    wi.add_argument("--tokens-per-rank", type=_positive_float, default=4096, help="for the time model")
    wi.add_argument("--link", default="ib-ndr", help="a named link profile (costmodel.LINKS)")
    wi.add_argument("--device", default="h100", help="a named device profile (costmodel.DEVICES)")

    from .bench import SYSTEMS
    be = sub.add_parser("bench", formatter_class=HELP, help="zerolab stages vs torch DDP / ZeRO optimizer / FSDP2, interleaved (bench.py)")
    be.add_argument("--nproc", type=int, default=2, help="gloo ranks on this machine")
    be.add_argument("--preset", default="small", help="nano, tiny, small, ...")
    be.add_argument("--systems", default=",".join(SYSTEMS), help="comma list")
    be.add_argument("--rounds", type=int, default=7, help="timed rounds (one step of every system each)")
    be.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    be.add_argument("--batch-size", type=int, default=8, help="global batch in rows")
    be.add_argument("--bucket-mb", type=_positive_float, default=None,
                    help="gradient bucket cap in MiB of zerolab-ddp/zero1/zero2 (default: one "
                    "bucket per block); a system NAME@MB overrides it, e.g. zerolab-ddp@4")
    be.add_argument("--link-gbps", type=float, default=None, help="emulated link (zerolab systems only)")
    be.add_argument("--link-latency-us", type=float, default=None, help="emulated α, us per ring step")
    be.add_argument("--out", default="runs/bench", help="writes OUT/bench.json")
    be.add_argument("--meter-cost", action="store_true", help="instead: zerolab stages' train step "
                    "with and without the memory meter (OUT/meter_cost.json)")
    be.add_argument("--timeout", type=float, default=1800, help="seconds before the run is killed")

    train = sub.add_parser("train", formatter_class=HELP, help="train one or more stages under torchrun")
    _add_launch_args(train, "0", 2, "tiny", 5)
    train.add_argument("--out", default="runs/train", help="writes OUT/stage{S}/rank{r}.json")
    train.add_argument("--save-every", type=int, default=None, metavar="K",
                       help="sharded checkpoint every K steps and at the end (0: only at the end)")
    train.add_argument("--resume", default=None, metavar="DIR",
                       help="continue from a checkpoint; options not given come from it")

    cmp = sub.add_parser("compare", formatter_class=HELP, help="stages 0-3, same seed and data: table + JSON + PNG")
    _add_launch_args(cmp, "0,1,2,3", 4, "tiny", 10)
    cmp.add_argument("--out", default="runs/compare", help="also compare.json and compare.png")

    labs = sub.add_parser("labs", formatter_class=HELP, help="execute every lab notebook with papermill, write a report")
    labs.add_argument("--out", default="runs/labs", help="executed labs and report.md")
    labs.add_argument("--only", default=None, help="comma list of lab name fragments")
    labs.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                      help="papermill parameter override for every lab (repeatable)")
    labs.add_argument("--timeout", type=_positive_float, default=900, help="seconds per lab")
    labs.add_argument("--overwrite", action="store_true",
                      help="replace the labs run OUT already holds (default: refuse)")
    labs.add_argument("--reference", action="store_true",
                      help="plot the committed CPU reference run instead of launching ranks")

    chk = sub.add_parser("check", formatter_class=HELP,
                         help="grade your code for an exercise on gloo ranks (zerolab.exercises)")
    chk.add_argument("exercise", nargs="?", default=None,
                     help="shard_range, ddp, zero1, zero2 or zero3")
    chk.add_argument("--impl", default=None, help="your .py file (or a dotted module)")
    chk.add_argument("--nproc", type=int, default=3, help="gloo ranks, 2-4")
    chk.add_argument("--timeout", type=float, default=90, help="seconds before the ranks are killed")
    chk.add_argument("--list", action="store_true", help="list the exercises and their skeletons")

    sub.add_parser("doctor", formatter_class=HELP,
                   help="check this machine for the course (each line OK or the fix; < 30 s)")

    from .checkpoint import add_parser
    add_parser(sub)
    return parser


def cmd_memory(args) -> int:
    theory.check_world_size(args.world_size)
    print(theory.format_memory_table(args.params, args.world_size, args.precision, args.optimizer_bytes,
                                     grad_dtype=args.grad_dtype))
    print("\nalive inside the optimizer step (resident + fp32 gradient copies), GB")
    print(theory.format_step_peaks(args.params, args.world_size, args.precision, args.grad_dtype))
    print(f"\nbytes sent per rank per step (ring algorithm, {args.precision} grads/params), GB")
    for stage in theory.STAGES:
        variants = ("all_reduce", "reduce_scatter") if stage == 1 else ("all_reduce",)
        for op in variants:
            t = theory.traffic_bytes(args.params, args.world_size, stage, args.precision, op,
                                     grad_dtype=args.grad_dtype)
            label = theory.STAGE_NAMES[stage] + (f" ({op})" if stage == 1 else "")
            parts = ", ".join(f"{k} {v / 1e9:.4g}" for k, v in t.items() if v)
            print(f"  {label:<26} {sum(t.values()) / 1e9:>9.4g}   = {parts or 'none'}")
    return 0


def cmd_time(args) -> int:
    from . import costmodel
    theory.check_world_size(args.world_size)
    link = costmodel.get_link(args.link, args.link_gbps, args.link_latency_us)
    device = costmodel.get_device(args.device, args.device_tflops)
    print(costmodel.format_time_table(args.params, args.world_size, args.tokens_per_rank, link, device,
                                      args.blocks, args.precision, args.efficiency))
    return 0


def cmd_whatif(args) -> int:
    from . import costmodel, whatif
    from .train import parse_stages
    theory.check_world_size(args.world_size)
    link, device = costmodel.get_link(args.link), costmodel.get_device(args.device)
    reports = whatif.whatif(args.preset, args.world_size, parse_stages(args.stages), rank=args.rank,
                            precision=args.precision)
    print(whatif.format_whatif(reports, link, device, args.tokens_per_rank, args.precision))
    return 0


def cmd_bench(args) -> int:
    from .bench import check_args
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be >= 1")
    args.lr, args.seed = 1e-3, 0
    check_args(args, args.nproc)
    argv = ["--preset", args.preset, "--systems", args.systems, "--rounds", str(args.rounds),
            "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--out", args.out]
    argv += ["--meter-cost"] if args.meter_cost else []
    for flag in ("link_gbps", "link_latency_us", "bucket_mb"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    print(f"zerolab bench: {args.nproc} gloo rank(s), preset {args.preset}", flush=True)
    run_torchrun(argv, args.nproc, timeout=args.timeout, module="zerolab.bench")
    return 0


def _train_argv(args, stages: str, out: str, backend: str, device: str) -> list[str]:
    argv = ["--stages", stages, "--out", out, "--backend", backend, "--device", device]
    for name in TRAIN_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "zero3_prefetch", None) is not None:    # on / off; absent: the default
        argv.append("--zero3-prefetch" if args.zero3_prefetch else "--no-zero3-prefetch")
    argv += [f"--{flag.replace('_', '-')}" for flag in ("timeline", "save_params",
                                                        "find_unused_parameters",
                                                        "trace", "zero3_keep_root",
                                                        "activation_checkpointing")
             if getattr(args, flag)]
    for flag in ("save_every", "resume"):                   # train only
        if getattr(args, flag, None) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv


def check_launch(args) -> tuple[str, str]:
    """Validate everything a launch needs, before any process starts; return (backend, device)."""
    from .data import load_tokens
    from .train import check_args
    backend, device = resolve(args.nproc, args.backend, args.device, args.nnodes)
    world_size = args.nproc * args.nnodes
    if getattr(args, "resume", None):       # fills the options not given from the checkpoint
        from .checkpoint import given_options
        from .train import check_resume     # (rank 0 prints what differs from the checkpoint)
        check_resume(args, given_options(build_parser(), args.argv), world_size)
    cfg = check_args(args, world_size)
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
def started(args, command: str):
    """Check the arguments, then start the run in --out (lock + manifest, `zerolab.runs`); yield
    (run id, backend, device). A node other than node 0 starts no run: node 0 owns it."""
    backend, device = check_launch(args)
    if args.node_rank:
        yield None, backend, device
        return
    with start_run(args.out, command=command, args=vars(args), overwrite=args.overwrite,
                   world_size=args.nproc * args.nnodes,
                   resume=getattr(args, "resume", None)) as run:
        yield run.run_id, backend, device


def launch(args, stages: str, run_id: str | None, backend: str, device: str) -> None:
    if getattr(args, "resume", None):
        stages = args.stages                # check_launch took it from the checkpoint if not given
    print(f"zerolab: {args.nproc * args.nnodes} rank(s), {backend} on {device}, stages {stages}, "
          f"preset {args.preset}" + (f", run {run_id}" if run_id else ""), flush=True)
    note = auto_note(args.nproc, args.backend, args.device, backend, device)
    if note:
        print(f"zerolab: {note}", flush=True)
    argv = _train_argv(args, stages, args.out, backend, device)
    run_torchrun(argv + (["--run-id", run_id] if run_id else []), args.nproc,
                 timeout=args.timeout, nnodes=args.nnodes, node_rank=args.node_rank,
                 rdzv_endpoint=args.rdzv_endpoint)


def cmd_train(args) -> int:
    with started(args, "train") as (run_id, backend, device):
        launch(args, args.stages, run_id, backend, device)
    return 0


def cmd_compare(args) -> int:
    from .report import compare_rows, format_rows, load_run, plot_compare
    with started(args, "compare") as (run_id, backend, device):
        launch(args, args.stages, run_id, backend, device)   # rank 0 prints its own numbers
        runs = load_run(args.out)
        rows = compare_rows(runs)                # every rank's: the maxima over ranks
        if any(r["model_states"] != r["theory_states"] or r["traffic"] != r["theory_traffic"]
               for r in rows):
            print("\nsome rank differs from the formula; maxima over all ranks:")
            print(format_rows(rows))
        out = Path(args.out)
        atomic_json(out / "compare.json", {"run_id": run_id, "rows": rows})
        png = plot_compare(runs, out / "compare.png")
    print(f"\nwrote {out / 'compare.json'} and {png}")
    return 0


def cmd_checkpoint(args) -> int:
    from .checkpoint import consolidate_command
    return consolidate_command(args)          # the only action so far: consolidate


def cmd_labs(args) -> int:
    from .labs import run_labs
    if args.reference:                       # papermill's kernels inherit the environment
        os.environ["ZEROLAB_REFERENCE"] = "1"
    return run_labs(args)


def cmd_check(args) -> int:
    from .exercises import cli_check
    return cli_check(args)


def cmd_doctor(args) -> int:
    from .doctor import main as doctor_main
    return doctor_main()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return {"memory": cmd_memory, "train": cmd_train, "compare": cmd_compare, "time": cmd_time,
                "whatif": cmd_whatif, "bench": cmd_bench, "labs": cmd_labs,
                "checkpoint": cmd_checkpoint, "check": cmd_check, "doctor": cmd_doctor}[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"zerolab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except LaunchInterrupted as err:
        print(f"zerolab {args.command}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"zerolab {args.command}: interrupted", file=sys.stderr)
        return 130
    except LaunchError as err:
        print(f"zerolab {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
