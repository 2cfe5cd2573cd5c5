"""The `zerolab` command: memory | time | whatif | fit | train | compare | bench | labs | checkpoint |
check | doctor | papers | slurm.

    zerolab memory --params 7.5e9 --world-size 64     # the ZeRO paper's table, from the formulas
    zerolab train --stage 2 --nproc 4                  # one stage under torchrun
    zerolab compare                                    # stages 0-3 on this machine: the main job
    zerolab labs                                       # execute every lab notebook, write a report
    zerolab check ddp --impl my_ddp.py                 # grade an exercise (course/exercises/)
    zerolab doctor                                     # is this machine ready for the course?
    zerolab checkpoint consolidate DIR OUT             # sharded checkpoint -> plain GPT state dict
    srun zerolab slurm train --nproc 8                 # one launcher per node (scripts/slurm/)

Each subcommand is a few lines that hand over to the package: the training options and their
checks are `zerolab.run.options`, a launch is `zerolab.run.job`. Every subcommand checks its
arguments before any process starts and exits 2 with one line naming the bad value; a failed
launch exits 1 with the failing rank's traceback; an interrupted one 130.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import theory
from ..variants import offload
from ..run import bounds, job, options
from ..run.folders import atomic_json, check_out_dir, start_run
from ..run.launch import LaunchError, LaunchInterrupted, run_torchrun
from ..run.preflight import check_cores
from .parser import HELP, OneLineParser
from .types import count, nics, ranks

number, positive_number = options.number(), options.positive_number


# the formula commands' options (memory, time, whatif), each defined once: flags, keywords
FORMULA = {
    "params": (("--params",), dict(type=count, default=7.5e9, help="Ψ, e.g. 7.5e9, 7.5B, 125M")),
    "world_size": (("--world-size",), dict(type=ranks, default=64, help="data-parallel ranks N")),
    "precision": (("--precision",), dict(default="bf16", choices=("bf16", "fp32"),
                                         help="bytes per gradient and weight")),
    "grad_dtype": (("--grad-dtype",), dict(default=None, choices=("bf16", "fp32"), help=(
        "gradient dtype (default: --precision); fp32: 18 bytes/param"))),
    "tokens": (("--tokens-per-rank",), dict(type=positive_number, default=4096,
                                            help="tokens per rank per step")),
    "link": (("--link",), dict(default="ib-ndr", help="a named link profile "
                                                      "(timing/hardware.py; a wrong name lists them)")),
    "device": (("--device",), dict(default="h100", help="a named device profile "
                                                        "(timing/hardware.py)")),
    "mfu": (("--mfu", "--efficiency"), dict(type=float, default=0.4, help=(
        "model FLOPs utilization: the fraction of the device's peak FLOP/s training reaches, "
        "in (0, 1] (default 0.4: Llama 3 reports 0.38-0.43 on H100s, PaLM 0.462 on TPU v4; "
        "1 = the datasheet peak)"))),
    "algo": (("--algo",), dict(default="ring", choices=("ring", "tree", "auto"), help=(
        "how all_reduce is modelled: ring, 2(n-1)α latency; tree, 2·⌈log2 n⌉α (NCCL's tree); "
        "auto, the cheaper of the two per collective. reduce_scatter / all_gather are always "
        "rings (NCCL has no tree for them)"))),
    "ranks_per_node": (("--ranks-per-node",), dict(type=int, default=None, metavar="K", help=(
        "two tiers: nodes of K ranks, --intra inside a node, --inter between nodes; a flat ring "
        "runs one ring per NIC, at the node's NICs together (default: one link, --link)"))),
    "intra": (("--intra",), dict(default=None, metavar="SPEC", help=(
        "with --ranks-per-node: the link inside a node, a profile (nvlink4, pcie5, ...) or "
        "GBPS[@LATENCY_US] (default: nvlink4)"))),
    "inter": (("--inter",), dict(default=None, metavar="SPEC", help=(
        "with --ranks-per-node: the link between nodes, a profile (ib-ndr, 400gbe, ...) or "
        "GBPS[@LATENCY_US] (default: --link)"))),
    "nics_per_node": (("--nics-per-node",), dict(type=nics, default=None, metavar="C", help=(
        "with --ranks-per-node: network cards in each node, --inter being one NIC's link "
        "(default: one per GPU, C = K; 1: the whole node on one NIC)"))),
}


def _formula(p, *names, **defaults):
    for name in names:
        flags, kw = FORMULA[name]
        p.add_argument(*flags, **{**kw, **({"default": defaults[name]} if name in defaults else {})})


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="zerolab", description="Hand-written DDP and ZeRO-1/2/3, measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, text):
        return sub.add_parser(name, formatter_class=HELP, help=text)

    mem = command("memory", "per-rank model-state bytes and traffic from the formulas")
    _formula(mem, "params", "world_size", "precision")
    mem.add_argument("--optimizer-bytes", type=positive_number, default=None, help="K (default 12)")
    _formula(mem, "grad_dtype")

    tm = command("time", "per-stage step time from the cost model (timing/costmodel.py)")
    _formula(tm, "params", "world_size", "tokens")
    tm.add_argument("--blocks", type=int, default=32, help="equal blocks (ZeRO-3 gathers one at a time)")
    _formula(tm, "link")
    tm.add_argument("--link-gbps", type=positive_number, default=None, help="custom bandwidth, Gb/s per rank per direction")
    tm.add_argument("--link-latency-us", type=float, default=None,
                    help="custom α, us per ring step (default: the named link's)")
    _formula(tm, "device")
    tm.add_argument("--device-tflops", type=positive_number, default=None, help="custom peak, TFLOP/s")
    _formula(tm, "mfu")
    tm.add_argument("--d-model", type=int, default=None, help=(
        "width d of each block for attention's 12·L·d·s FLOPs per token (default: from "
        "Ψ ≈ 12·L·d², L = --blocks)"))
    tm.add_argument("--seq-len", type=number, default=2048, help=(
        "tokens per sequence T for attention's FLOPs, at most --tokens-per-rank; 0: the 6Ψ rule "
        "alone"))
    _formula(tm, "algo", "precision", "ranks_per_node", "intra", "inter", "nics_per_node")
    tm.add_argument("--muon", action="store_true", help=(
        "also distributed Muon's three layouts (bytes, FLOPs of the orthogonalisation, memory, "
        "optimizer time) for a GPT of --blocks blocks of width --d-model (course/muontable.py)"))
    tm.description = ("Step time of DDP and ZeRO-1/2/3 from the α-β cost model: compute (6Ψ + "
                      "12·L·d·s) FLOPs per token at peak x MFU, collectives on one in-order link "
                      "(or two tiers: --ranks-per-node K --intra SPEC --inter SPEC [--nics-per-node C]).")

    wi = command("whatif", "one rank of a large world on a fake process group (timing/whatif.py)")
    wi.add_argument("--preset", default="1b", help="nano, tiny, small, gpt2, medium, 1b")
    _formula(wi, "world_size", world_size=1024)
    wi.add_argument("--rank", type=int, default=0, help="which rank to run")
    wi.add_argument("--stage", "--stages", dest="stages", default="0,1,2,3", help="stage or comma list")
    _formula(wi, "precision", "tokens", "link", "device", "mfu", "algo", "ranks_per_node", "intra",
             "inter", "nics_per_node")
    wi.description = ("One training step of each stage for one rank of a fake world: per-rank "
                      "bytes by state from the code (formula in brackets) and 'peak', the "
                      "largest total the memory meter saw during the step: the model states plus "
                      "the transients (ZeRO-3's gathered blocks, gradient buckets in flight, "
                      "reduce_scatter outputs, fp32 gradient copies in the optimizer step; no "
                      "activations). Time from the cost model at the preset's shape.")

    from ..course import bench
    bn = bench.parser(command("bench", "zerolab stages vs torch DDP / ZeRO optimizer / FSDP2, "
                                       "interleaved (course/bench.py)"), launcher=True)
    bn.add_argument("--overwrite", action="store_true", help=options.OPTIONS["overwrite"].help)

    train = command("train", "train one or more stages under torchrun")
    options.parser("train", train)
    from ..run import fitreport
    fitreport.add_arguments(command("fit", "will it fit? one step's per-rank peak, predicted on the "
                                     "meta device before launch (run/fit.py)"))
    compare = command("compare", "stages 0-3, same seed and data: table + JSON + PNG")
    options.parser("compare", compare)

    labs = command("labs", "execute every lab notebook with papermill, write a report")
    labs.add_argument("--out", default="runs/labs", help="executed labs and report.md")
    labs.add_argument("--only", default=None, help="comma list of lab name fragments")
    labs.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                      help="papermill parameter override for every lab (repeatable)")
    labs.add_argument("--timeout", type=positive_number, default=900, help="seconds per lab")
    labs.add_argument("--overwrite", action="store_true",
                      help=options.OPTIONS["overwrite"].help.replace("the run", "the labs run"))
    labs.add_argument("--reference", action="store_true",
                      help="plot the committed CPU reference run instead of launching ranks")

    chk = command("check", "grade your code for an exercise on gloo ranks (course/exercises/)")
    chk.add_argument("exercise", nargs="?", default=None,
                     help="shard_range, ddp, zero1, zero2, zero3; groups, buckets_prefetch, "
                          "timing; strategy_ddp, strategy_zero1 (--list)")
    chk.add_argument("--impl", default=None, help="your .py file (or a dotted module)")
    chk.add_argument("--nproc", type=int, default=3, help="gloo ranks, 2-4")
    chk.add_argument("--timeout", type=positive_number, default=90,
                     help="seconds the whole check may take before every process is stopped")
    chk.add_argument("--call-timeout", type=positive_number, default=20, metavar="S", help=(
        "seconds one call of your function may take: longer is a hang, stopped and named"))
    chk.add_argument("--list", action="store_true", help="list the exercises and their skeletons")
    chk.add_argument("--hint", nargs="?", const="1", default=None, metavar="K",
                     help="print hint K (default 1) for EXERCISE instead of checking: 1 is a "
                          "nudge, the last almost the code")

    command("doctor", "check this machine for the course (each line OK or the fix; < 30 s)")

    pp = command("papers", "published numbers next to zerolab's prediction and this laptop's "
                           "measurement, with a computed verdict (course/papers.py; < 1 min)")
    fmt = pp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="every row as JSON")
    fmt.add_argument("--markdown", action="store_true", help="the site's page (site/papers.md)")
    pp.add_argument("--out", default=None, metavar="FILE", help="write to FILE (default: print)")

    from ..run import slurm
    sl = sub.add_parser("slurm", formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="a zerolab command on a Slurm cluster: train / compare across the "
                             "job's nodes (--print-script writes the batch script)",
                        description=slurm.HELP, epilog=slurm.help_epilog())
    sl.add_argument("--print-script", action="store_true", help=(
        "print a batch script that runs COMMAND on the job's nodes, and exit (nothing runs): "
        "zerolab slurm --print-script train --nproc 8 > job.sbatch; sbatch job.sbatch"))
    sl.add_argument("--nodes", type=int, default=2, help=(
        "with --print-script: the script's #SBATCH --nodes (default: 2; sbatch --nodes=N "
        "overrides it)"))
    sl.add_argument("zerolab", nargs=argparse.REMAINDER, metavar="COMMAND ...", help=(
        "a zerolab command line, e.g. train --stages 0,1,2,3 --preset gpt2 --nproc 8 --out "
        "runs/slurm; train and compare form one world over the job's nodes (--nproc: ranks per "
        "node), labs and any other command run on the first node only"))

    ck = sub.add_parser("checkpoint", help="work with saved checkpoints (zerolab train --save-every)")
    actions = ck.add_subparsers(dest="action", required=True)
    c = actions.add_parser("consolidate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           help="offline: full fp32 state dict for a plain GPT (like zero_to_fp32.py)")
    c.add_argument("dir", help="a step_* folder, OUT/stage{S}/checkpoints (its latest) or OUT/stage{S}")
    c.add_argument("out", help="output file: torch.save'd state dict (weights_only-loadable)")
    c.add_argument("--safetensors", action="store_true", help="write OUT with safetensors instead")
    c.add_argument("--optimizer", default=None, metavar="PATH",
                   help="also write the AdamW state in torch's optimizer.state_dict() layout")
    c.add_argument("--dcp", default=None, metavar="DIR",
                   help="also write the model as a torch.distributed.checkpoint folder (FSDP2)")
    return bounds.guard(parser)         # every numeric option checked as it is read


# --- the formulas ------------------------------------------------------------------------------
def cmd_memory(args) -> int:
    theory.check_world_size(args.world_size)
    print(theory.format_memory_table(args.params, args.world_size, args.precision, args.optimizer_bytes,
                                     grad_dtype=args.grad_dtype))
    print("\nalive inside the optimizer step (resident + fp32 gradient copies), GB")
    print(theory.format_step_peaks(args.params, args.world_size, args.precision, args.grad_dtype))
    print("\nthe low-precision state ladder (bf16 weights and grads; zerolab train "
          "--optimizer-states, --master-rounding): bytes per parameter, then GB per rank")
    from ..course.ladder import format_state_ladder
    print(format_state_ladder(args.params, args.world_size))
    print("\nZeRO-Offload (zerolab train --offload-optimizer; zerolab/variants/offload.py): optimizer "
          "states and AdamW on the host, GB per rank")
    print(offload.format_table(args.params, args.world_size, args.precision, args.grad_dtype))
    print(f"\nbytes sent per rank per step (ring algorithm, {args.precision} grads/params), GB")
    for stage in theory.STAGES:
        variants = ("all_reduce", "reduce_scatter") if stage == 1 else ("all_reduce",)
        for op in variants:
            t = theory.traffic_bytes(args.params, args.world_size, stage, args.precision, op,
                                     grad_dtype=args.grad_dtype)
            label = theory.STAGE_NAMES[stage] + (f" ({op})" if stage == 1 else "")
            parts = ", ".join(f"{k} {v / 1e9:.4g}" for k, v in t.items() if v)
            print(f"  {label:<26} {sum(t.values()) / 1e9:>9.4g}   = {parts or 'none'}")
    for label, w, g in (("ZeRO-3 + qwZ int8", "int8", None), ("ZeRO-3 + qwZ + qgZ int4", "int8", "int4")):
        t = theory.quantized_traffic_bytes([args.params / args.world_size], args.world_size, w, g,
                                           precision=args.precision, grad_dtype=args.grad_dtype)
        parts = ", ".join(f"{k} {v / 1e9:.4g}" for k, v in t.items() if v)      # zerolab/variants/quant.py
        print(f"  {label:<26} {sum(t.values()) / 1e9:>9.4g}   = {parts} (block 256, fp32 scales)")
    return 0


def _network(args, link):
    """`link`, or the two tiers of --ranks-per-node K --intra SPEC --inter SPEC --nics-per-node C
    (defaults: nvlink4 inside, `link` between, a NIC per GPU); ValueError (one line) for a bad
    value."""
    from ..timing import hardware
    if args.ranks_per_node is None:
        given = [f for f, v in (("--intra", args.intra), ("--inter", args.inter),
                                ("--nics-per-node", args.nics_per_node)) if v is not None]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{' and '.join(given)} {verb} --ranks-per-node (ranks in each node)")
        return link
    return hardware.get_topology(args.ranks_per_node, args.intra or "nvlink4", args.inter or link,
                                 args.world_size, args.nics_per_node)


def cmd_time(args) -> int:
    from ..timing import costmodel, hardware, timetable
    theory.check_world_size(args.world_size)
    costmodel.check_mfu(args.mfu, "--mfu")
    if args.d_model is not None and args.d_model < 1:
        raise ValueError(f"--d-model {args.d_model} must be >= 1")
    if args.seq_len < 0:
        raise ValueError(f"--seq-len {args.seq_len:g} must be >= 0")
    link = _network(args, hardware.get_link(args.link, args.link_gbps, args.link_latency_us))
    device = hardware.get_device(args.device, args.device_tflops)
    print(timetable.format_time_table(args.params, args.world_size, args.tokens_per_rank, link, device,
                                      args.blocks, args.precision, args.mfu, d_model=args.d_model,
                                      seq_len=args.seq_len, algorithm=args.algo))
    if args.muon:
        from ..course import muontable
        print("\n" + muontable.time_table(args.params, args.world_size, args.blocks,
                                          args.d_model, link, device, args.mfu))
    return 0


def cmd_whatif(args) -> int:
    from ..timing import costmodel, hardware, whatif
    theory.check_world_size(args.world_size)
    costmodel.check_mfu(args.mfu, "--mfu")
    link, device = _network(args, hardware.get_link(args.link)), hardware.get_device(args.device)
    reports = whatif.whatif(args.preset, args.world_size, options.parse_stages(args.stages),
                            rank=args.rank, precision=args.precision)
    print(whatif.format_whatif(reports, link, device, args.tokens_per_rank, args.precision,
                               args.mfu, args.algo))
    return 0


# --- launches ----------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from ..course import bench
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be >= 1")
    bench.check_args(args, args.nproc)
    warning = check_cores(args.nproc, "cpu", flag="--nproc")
    check_out_dir(args.out)
    print(f"zerolab bench: {args.nproc} gloo rank(s), preset {args.preset}", flush=True)
    if warning:
        print(f"zerolab bench: {warning}", flush=True)
    module = "zerolab.course.metercost" if args.meter_cost else bench.MODULE
    with start_run(args.out, command="bench", args=vars(args), world_size=args.nproc,
                   overwrite=args.overwrite):
        run_torchrun(bench.rank_argv(args), args.nproc, timeout=args.timeout, module=module)
    return 0


def _launch(args, command: str) -> None:
    """Check, own --out, start the ranks (zerolab.run.job)."""
    given = options.given_options(build_parser(), args.argv) if getattr(args, "resume", None) else None
    backend, device = job.check(args, given)
    with job.started(args, command) as run_id:
        job.start_ranks(args, run_id, backend, device)


def cmd_train(args) -> int:
    _launch(args, "train")
    return 0


def cmd_fit(args) -> int:
    from ..run import fitreport
    return fitreport.main(args)


def cmd_compare(args) -> int:
    from ..course.plots import plot_compare
    from ..course.results import load_run
    from ..run.result import compare_rows, format_rows
    backend, device = job.check(args)       # compare has no --resume
    with job.started(args, "compare") as run_id:
        job.start_ranks(args, run_id, backend, device)      # rank 0 prints its own numbers
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


# --- the course's tools ------------------------------------------------------------------------
def cmd_checkpoint(args) -> int:
    from ..run.consolidate import consolidate_command
    return consolidate_command(args)          # the only action so far: consolidate


def cmd_labs(args) -> int:
    from ..course.labs import run_labs
    if args.reference:                       # papermill's kernels inherit the environment
        os.environ["ZEROLAB_REFERENCE"] = "1"
    return run_labs(args)


def cmd_check(args) -> int:
    from ..course.exercises import cli_check
    return cli_check(args)


def cmd_papers(args) -> int:
    from ..course import papertable
    return papertable.main(args)


def cmd_slurm(args) -> int:
    from ..run import slurm
    if args.print_script:
        print(slurm.sbatch_script(args.zerolab, nodes=args.nodes), end="")
        return 0
    cmd = slurm.command(args.zerolab, os.environ)           # ValueError: outside a job step
    print(slurm.announce(args.zerolab, cmd, os.environ), flush=True)
    return 0 if cmd is None else main(cmd)


def cmd_doctor(args) -> int:
    from ..course.doctor import main as doctor_main
    return doctor_main()


COMMANDS = {"memory": cmd_memory, "time": cmd_time, "whatif": cmd_whatif, "bench": cmd_bench,
            "train": cmd_train, "fit": cmd_fit, "compare": cmd_compare, "labs": cmd_labs,
            "checkpoint": cmd_checkpoint, "check": cmd_check, "doctor": cmd_doctor,
            "papers": cmd_papers, "slurm": cmd_slurm}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return COMMANDS[args.command](args)
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
