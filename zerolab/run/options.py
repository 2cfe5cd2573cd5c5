"""Every option of a training run, defined once and checked once.

Idea: a training run's options reach the ranks through several doors - `zerolab train` and
`zerolab compare` on the command line, `nb.launch(...)` in a notebook, `zerolab bench`, and the
ranks' own parser when torchrun starts `python -m zerolab.run.train`. Every door builds its
parser from the one table below (`parser(program)` or `add(parser, program, names)`), every
door checks the parsed options with `check`, and a launcher hands the ranks exactly what it was
given with `rank_argv`, so a flag cannot mean one thing on the command line and another on the
ranks. What differs between the doors is listed here too: which options each program takes
(`PROGRAMS`) and its defaults (`DEFAULTS`).

    p = parser("train")                               # `zerolab train`'s options
    args = p.parse_args(["--stage", "3", "--nproc", "4", "--preset", "nano"])
    cfg = check(args, world_size=4)                   # ValueError (one line) for a bad value
    rank_argv(args)                                   # ["--stages", "3", "--preset", "nano", ...]

Errors: a value that no run can use raises ValueError with one line naming the option and what
is accepted (argparse's own errors for a value its type refuses: "argument --lr: 'nan' must be a
finite number").
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .. import theory
from ..variants import quant
from ..model import PRESETS, get_config
from ..variants.placement import DEFAULT_GATHER, GATHER_MODES
from ..variants.prefetch import DEFAULT_PREFETCH
from . import bounds, knobs
from .knobs import DTYPES  # noqa: F401 - the precisions' dtypes, where the options are
#: seeds accepted: the range every generator the package seeds takes (torch.manual_seed takes
#: < 2**64; zerolab.data seeds each batch with seed * 1_000_003 + step)
SEED_MAX = 2**32 - 1


def number(positive: bool = False):
    """An argparse type: a finite float (> 0 when `positive`); the error names the value."""
    def parse(text):
        try:
            return theory.check_finite("", text, positive=positive)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).strip()) from None
    parse.__name__ = "positive number" if positive else "number"
    return parse


positive_number = number(positive=True)


@dataclass(frozen=True)
class Option:
    """One option: its flags (the first names it in messages), argparse keywords, and whether a
    launcher passes it on to the ranks (`rank_argv`)."""
    flags: tuple[str, ...]
    help: str
    kw: dict = field(default_factory=dict)
    to_ranks: bool = True

    @property
    def dest(self) -> str:
        return self.kw.get("dest") or self.flags[0][2:].replace("-", "_")


_ON = {"action": "store_true"}
OPTIONS = {o.dest: o for o in (
    # --- what is trained ----------------------------------------------------------------------
    Option(("--stage", "--stages"), "stage 0-3, or a comma list such as 0,1,2,3",
           {"dest": "stages"}),
    Option(("--preset",), f"model size: {', '.join(PRESETS)} (nano, tiny, small fit a CPU)"),
    Option(("--block-size",), "context length in tokens (default: the preset's)", {"type": int}),
    Option(("--steps",), "optimizer steps per stage", {"type": int}),
    Option(("--batch-size",), "global batch in rows, all ranks together", {"type": int}),
    Option(("--grad-accum",), "micro-steps per optimizer step", {"type": int}),
    Option(("--precision",), "bf16: 2+2+4+4+4 bytes/param; fp32: exact equivalence runs",
           {"choices": sorted(DTYPES)}),
    Option(("--grad-dtype",), "gradient buffers' dtype (default: --precision); fp32 with bf16 "
           "weights is Megatron's / DeepSpeed's 18 bytes per parameter", {"choices": sorted(DTYPES)}),
    Option(("--data",), "a text file (default: Python stdlib sources)"),
    Option(("--seed",), "model init and batch sampling", {"type": int}),
    # --- the optimizer ---------------------------------------------------------------------------
    Option(("--lr",), "AdamW learning rate", {"type": positive_number}),
    Option(("--weight-decay",), "AdamW weight decay of 2-D weights (biases and LayerNorm: none; "
           "nanoGPT)", {"type": float}),
    Option(("--max-grad-norm",), "global gradient clipping; <= 0: none", {"type": number()}),
    Option(("--optimizer-states",), "AdamW's state dtypes (zerolab/optim.py), bytes per parameter "
           "with bf16 weights and grads: fp32 (the default: 2+2+4+4+4 = 16), bf16-moments (bf16 "
           "exp_avg / exp_avg_sq: 12), bf16-master (the bf16 weights are the master: 8; 10 with "
           "--master-rounding kahan)", {"choices": theory.OPTIMIZER_STATES}),
    Option(("--master-rounding",), "with --optimizer-states bf16-master: how the fp32 update is "
           "rounded into the bf16 weights: nearest (the default), stochastic (unbiased; seeded by "
           "--seed, step and rank), kahan (a bf16 compensation buffer, +2 bytes)",
           {"choices": theory.MASTER_ROUNDING}),
    # --- the strategies' knobs -----------------------------------------------------------------
    Option(("--zero1-grad-op",), "ZeRO-1 gradient path: the notes' all_reduce, or reduce_scatter",
           {"choices": theory.ZERO1_GRAD_OPS}),
    Option(("--zero12-gather",), "ZeRO-1/2: when the updated weights are all-gathered: "
           "after_step (the notes': every unit at the end of the step) or before_forward (FSDP's "
           "SHARD_GRAD_OP: each unit just before its next forward, one unit ahead, overlapping "
           f"the previous unit's compute); same bytes. Default {DEFAULT_GATHER} (measured: "
           "zerolab/variants/placement.py)", {"choices": GATHER_MODES}),
    Option(("--offload-optimizer",), "ZeRO-1/2: ZeRO-Offload (DeepSpeed's offload_optimizer): "
           "fp32 master, exp_avg, exp_avg_sq and AdamW on the host; gradients down and updated "
           "weights up each step (zerolab/variants/offload.py)", _ON),
    Option(("--offload-link",), "the host link of --offload-optimizer: a profile (pcie4, pcie5) "
           "or GBPS[@LATENCY_US]; emulated when the device is the CPU (default pcie4), the "
           "model's figure next to the real copies on CUDA", {"metavar": "SPEC"}),
    Option(("--find-unused-parameters",), "allow parameters that get no gradient in a step "
           "(torch DDP's flag)", _ON),
    Option(("--bucket-mb",), "DDP / ZeRO-1 / ZeRO-2: gradient bucket cap in MiB (torch DDP's "
           "bucket_cap_mb): consecutive blocks share one collective (default: one bucket per "
           "block; ZeRO-3 ignores it: it gathers one block at a time)", {"type": positive_number}),
    Option(("--zero3-prefetch",), "ZeRO-3: gather the next block while the current one computes "
           "(the default); --no-zero3-prefetch: one block at a time, the notes' picture",
           {"action": argparse.BooleanOptionalAction}),
    Option(("--zero3-prefetch-depth",), "ZeRO-3: blocks gathered ahead (0, 1, 2, ...; -1 all; "
           f"default {DEFAULT_PREFETCH}); overrides --zero3-prefetch", {"type": int}),
    Option(("--zero3-keep-root",), "ZeRO-3: keep the root unit gathered from forward into "
           "backward", _ON),
    Option(("--quantize-weights",), "ZeRO-3: ZeRO++'s qwZ, the forward / backward all_gathers "
           "carry int8 block-wise weights (about half the bytes; zerolab/variants/quant.py); default: bf16",
           {"choices": quant.WEIGHT_FORMATS}),
    Option(("--quantize-grads",), "ZeRO-3: ZeRO++'s qgZ, the gradient reduce_scatter is an "
           "all_to_all of int8 or int4 block-wise codes (about 1/2 or 1/4 of the bytes; with "
           "--hybrid hpz in ZeRO++'s two hops, inside the node then across); default: bf16", {"choices": quant.GRAD_FORMATS}),
    Option(("--quant-block",), "elements per fp32 scale of --quantize-weights / --quantize-grads "
           f"(default {quant.DEFAULT_BLOCK})", {"type": int, "metavar": "B"}),
    Option(("--hybrid",), "ZeRO-3 by node (zerolab.variants.hybrid): hsdp shards inside a node and "
           "all-reduces across nodes (FSDP's HYBRID_SHARD); hpz gathers the backward's weights "
           "inside the node (ZeRO++); a node: --ranks-per-node K, else the ranks torchrun starts "
           "on it", {"choices": ("hsdp", "hpz")}),
    Option(("--activation-checkpointing",), "recompute each block's forward in backward "
           "(torch.utils.checkpoint)", _ON),
    # --- where it runs ---------------------------------------------------------------------------
    Option(("--backend",), "auto (NCCL if enough GPUs, else gloo), gloo, nccl",
           {"choices": ("auto", "gloo", "nccl")}),
    Option(("--device",), "auto, cpu, cuda (gloo on cuda shares GPUs)",
           {"choices": ("auto", "cpu", "cuda")}),
    Option(("--timeout",), "seconds: the launcher stops the run after this long, and a rank's "
           "collective waits at most this long", {"type": positive_number}),
    Option(("--link-gbps",), "emulate a network link of this many Gb/s per rank (gloo only; "
           "zerolab/timing/linkemu.py): collectives end no sooner than the cost model says",
           {"type": float}),
    Option(("--link-latency-us",), "emulated link latency α, microseconds per ring step (with "
           "--link-gbps)", {"type": float}),
    Option(("--ranks-per-node",), "emulate nodes of K consecutive ranks with two links, --intra "
           "inside a node and --inter between nodes (gloo only; zerolab/timing/linkemu.py): each "
           "collective is timed by the tiers its ranks cross", {"type": int, "metavar": "K"}),
    Option(("--intra",), "with --ranks-per-node: the link inside a node, a profile (nvlink4, "
           "pcie4, ...; zerolab/timing/hardware.py) or GBPS[@LATENCY_US], e.g. 1@20",
           {"metavar": "SPEC"}),
    Option(("--inter",), "with --ranks-per-node: the link between nodes, a profile (ib-ndr, "
           "100gbe, ...) or GBPS[@LATENCY_US], e.g. 0.1@200", {"metavar": "SPEC"}),
    Option(("--nics-per-node",), "with --ranks-per-node: network cards in each node, --inter "
           "being one NIC's link; a flat ring runs one ring per NIC, at the node's NICs together "
           "(default: one per GPU, C = K; 1: the whole node on one NIC)",
           {"type": int, "metavar": "C"}),
    # --- what it writes --------------------------------------------------------------------------
    Option(("--out",), "output folder: OUT/stage{S}/rank{r}.json for every stage and rank"),
    Option(("--overwrite",), "replace the run OUT already holds (default: keep it, moved to "
           "the first free OUT.1, OUT.2, ...)", _ON, to_ranks=False),
    Option(("--timeline",), "record memory over the last step", _ON),
    Option(("--trace",), "Chrome / Perfetto trace of the last step but one per rank: "
           "OUT/stage{S}/trace_rank{r}.json (zerolab/timing/trace.py)", _ON),
    Option(("--save-params",), "save each stage's final fp32 weights (every key of "
           "GPT.state_dict(), from the master weights) to OUT/stage{S}/params.pt", _ON),
    Option(("--save-every",), "sharded checkpoint every K steps and at the end into "
           "OUT/stage{S}/checkpoints (0: only at the end)", {"type": int, "metavar": "K"}),
    Option(("--resume",), "continue from a checkpoint (a step_* folder or its checkpoints/ "
           "folder); options not given are taken from it", {"metavar": "DIR"}),
    # --- the ranks only: set by a launcher, or for tests --------------------------------------
    Option(("--cuda-snapshot",), "CUDA only: record the allocator's history over the last step "
           "into OUT/stage{S}/rank{r}_snapshot.json", _ON),
    Option(("--no-allocator",), "skip the allocator / MemTracker cross-check on the last step", _ON),
    Option(("--run-id",), "the run id the launcher recorded in OUT/run.json (default: rank 0 "
           "starts a run of its own there)"),
    Option(("--crash-in-save",), argparse.SUPPRESS, {"type": int}),    # tests: a rank dies saving
    Option(("--crash-rank",), argparse.SUPPRESS, {"type": int}),       # tests: this rank raises
    # --- the launcher only -----------------------------------------------------------------------
    Option(("--nproc",), "ranks on this node", {"type": int}, to_ranks=False),
    Option(("--nnodes",), "torchrun: number of nodes", {"type": int}, to_ranks=False),
    Option(("--node-rank",), "torchrun: this node's rank", {"type": int}, to_ranks=False),
    Option(("--rdzv-endpoint",), "torchrun: HOST:PORT of the first node", to_ranks=False),
)}

TRAINING = ("stages", "preset", "block_size", "steps", "batch_size", "grad_accum", "precision",
            "grad_dtype", "data", "seed", "lr", "weight_decay", "max_grad_norm",
            "optimizer_states", "master_rounding", "zero1_grad_op",
            "zero12_gather", "offload_optimizer", "offload_link", "find_unused_parameters",
            "bucket_mb", "zero3_prefetch",
            "zero3_prefetch_depth", "zero3_keep_root", "quantize_weights", "quantize_grads",
            "quant_block", "hybrid", "activation_checkpointing", "backend",
            "device", "timeout", "link_gbps", "link_latency_us", "ranks_per_node", "intra",
            "inter", "nics_per_node", "out", "overwrite", "timeline", "trace", "save_params")
CHECKPOINTS = ("save_every", "resume")
LAUNCHER = ("nproc", "nnodes", "node_rank", "rdzv_endpoint")
RANKS_ONLY = ("cuda_snapshot", "no_allocator", "run_id", "crash_in_save", "crash_rank")
#: which options each program takes: the ranks (`python -m zerolab.run.train`), `zerolab train`
#: and `zerolab compare`
PROGRAMS = {"ranks": TRAINING + CHECKPOINTS + RANKS_ONLY, "train": TRAINING + CHECKPOINTS + LAUNCHER,
            "compare": TRAINING + LAUNCHER}
_COMMON = {"preset": "tiny", "batch_size": 8, "grad_accum": 1, "precision": "bf16", "seed": 0,
           "lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 1.0, "zero1_grad_op": "all_reduce",
           "zero12_gather": DEFAULT_GATHER,
           "backend": "auto", "device": "auto", "timeout": 900, "nnodes": 1, "node_rank": 0}
#: each program's defaults (an option not named here defaults to None, or off)
DEFAULTS = {
    "ranks": {**_COMMON, "stages": "0", "steps": 5, "out": "runs/train", "backend": "gloo",
              "device": "cpu", "timeout": 300},
    "train": {**_COMMON, "stages": "0", "steps": 5, "out": "runs/train", "nproc": 2},
    "compare": {**_COMMON, "stages": "0,1,2,3", "steps": 10, "out": "runs/compare", "nproc": 4},
}
NAMES = {"ranks": "zerolab.run.train", "train": "zerolab train", "compare": "zerolab compare"}


# --- parsers ----------------------------------------------------------------------------------
def add(parser: argparse.ArgumentParser, names, defaults: dict | None = None,
        helps: dict | None = None):
    """Add the options `names` (OPTIONS keys) to `parser`, with `defaults` {name: value} and,
    where a program says more, `helps` {name: text}. Returns `parser`."""
    defaults, helps = defaults or {}, helps or {}
    for name in names:
        o = OPTIONS[name]
        kw = dict(o.kw)
        if kw.get("action") != "store_true":
            kw["default"] = defaults.get(name)
        parser.add_argument(*o.flags, help=helps.get(name, o.help), **kw)
    return bounds.guard(parser)         # each number checked against its range as it is read


def parser(program: str, p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """A parser holding `program`'s options (a key of PROGRAMS) with its defaults; into `p` if
    given (a `zerolab` subcommand's parser)."""
    if p is None:
        p = argparse.ArgumentParser(prog=NAMES[program], description=__doc__.split("\n")[0])
    return add(p, PROGRAMS[program], DEFAULTS[program])


def parse(program: str, argv: list[str]) -> argparse.Namespace:
    """`program`'s options from `argv`; ValueError (one line) for an unknown option or a value
    its type refuses, instead of argparse's usage block and exit."""
    p = parser(program)
    p.exit_on_error = False
    try:
        args, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise ValueError(str(err)) from None
    if unknown:
        raise ValueError(f"unknown {NAMES[program]} option(s): {' '.join(unknown)}")
    return args


def given_options(p: argparse.ArgumentParser, argv) -> set[str]:
    """dest names of the options present in `argv` for `p` (a fresh parser: it is modified),
    sub-commands included; what is absent was left at its default."""
    def suppress(q):
        for action in q._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    suppress(sub)
            elif action.dest != "help":
                action.default = argparse.SUPPRESS
    suppress(p)
    return set(vars(p.parse_args(argv)))


# --- from one door to the ranks ---------------------------------------------------------------
def argv_for(program: str, **values) -> list[str]:
    """The command line that gives `program` these option values (None and False: absent; an
    on/off option's False: --no-NAME). ValueError names an option `program` does not take."""
    unknown = sorted(set(values) - set(PROGRAMS[program]))
    if unknown:
        raise ValueError(f"unknown {NAMES[program]} option(s): "
                         f"{', '.join('--' + u.replace('_', '-') for u in unknown)}")
    return to_argv(PROGRAMS[program], values)


def to_argv(names, values: dict) -> list[str]:
    """The flags that set the options `names` (in this order) to `values` {name: value}; a name
    that `values` lacks, or holds as None, is left out."""
    argv = []
    for name in names:
        if name not in values or values[name] is None:
            continue
        o, value = OPTIONS[name], values[name]
        flag = o.flags[0]
        if o.kw.get("action") is argparse.BooleanOptionalAction:
            argv.append(flag if value else "--no-" + flag[2:])
        elif o.kw.get("action") == "store_true":
            argv += [flag] if value else []
        elif value is not False:
            argv += [flag, str(value)]
    return argv


def rank_argv(args, **resolved) -> list[str]:
    """What a launcher passes to the ranks: every option of `args` that goes to them (not the
    launcher's own, e.g. --nproc), as `python -m zerolab.run.train` takes it; `resolved`
    replaces values the launcher decided (backend="gloo", device="cpu" for "auto")."""
    values = {name: getattr(args, name) for name in PROGRAMS["ranks"]
              if OPTIONS[name].to_ranks and hasattr(args, name)}
    return argv_for("ranks", **{**values, **resolved})


# --- checks -----------------------------------------------------------------------------------
def parse_stages(text: str) -> list[int]:
    """"0,1,2,3" -> [0, 1, 2, 3]; ValueError names a bad stage."""
    try:
        stages = [int(s) for s in str(text).split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(f"stages {text!r} must be a comma-separated list of 0, 1, 2, 3") from None
    if not stages:
        raise ValueError(f"stages {text!r} is empty: give one or more of 0, 1, 2, 3")
    return [theory.check_stage(s) for s in stages]


def check_seed(seed) -> int:
    """`seed` unless it is outside 0 .. SEED_MAX."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"--seed {seed!r} is outside the accepted range 0 .. {SEED_MAX}")
    return seed


def model_config(args):
    """The GPTConfig of --preset with --block-size (and --activation-checkpointing) applied."""
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size {args.block_size} must be >= 1 (tokens of context)")
    overrides = {"block_size": args.block_size} if args.block_size is not None else {}
    if getattr(args, "activation_checkpointing", False):
        overrides["activation_checkpointing"] = True
    return get_config(args.preset, **overrides)


def check(args, world_size: int):
    """Raise ValueError (one line) for values no run could use; set args.stage_list; return the
    model config."""
    args.stage_list = parse_stages(args.stages)
    cfg = model_config(args)
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("lr", "timeout"):
        theory.check_finite(f"--{name}", getattr(args, name), positive=True)
    theory.check_finite("--max-grad-norm", args.max_grad_norm)
    knobs.check(args, world_size, args.stage_list)  # the strategies' knobs (zerolab/run/knobs.py)
    theory.check_finite("--weight-decay", getattr(args, "weight_decay", 0.0), minimum=0)
    check_seed(args.seed)
    if getattr(args, "bucket_mb", None) is not None:
        theory.check_finite("--bucket-mb", args.bucket_mb, positive=True)
    if args.batch_size % (world_size * args.grad_accum):
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by world_size "
                         f"{world_size} x --grad-accum {args.grad_accum}")
    save_every = getattr(args, "save_every", None)          # `zerolab compare` has none
    if save_every is not None and save_every < 0:
        raise ValueError(f"--save-every {save_every} must be >= 0 (0: only at the end)")
    return cfg


def check_backend(args, backend: str):
    """ValueError (one line) when an emulated link (--link-gbps, --ranks-per-node) meets a
    backend other than gloo: NCCL's kernels would not wait for the emulator's host-side sleep."""
    if backend == "gloo":
        return
    if getattr(args, "ranks_per_node", None) is not None and (getattr(args, "intra", None)
                                                              or getattr(args, "inter", None)):
        raise ValueError(f"--ranks-per-node emulates two tiers of links for gloo only, not "
                         f"--backend {backend} (add --backend gloo)")
    if getattr(args, "link_gbps", None) is not None:
        raise ValueError(f"--link-gbps emulates a link for gloo only, not --backend {backend}")


def check_resume(args, given: set[str], world_size: int):
    """Open --resume's checkpoint, take the options not `given` on the command line from it and
    check that it fits this run (one stage, same model, batch divisible by the new world size,
    steps left). Returns (checkpoint, notes); ValueError (one line) otherwise."""
    from . import checkpoint
    ckpt = checkpoint.open_checkpoint(args.resume)
    notes = checkpoint.apply_resume_args(args, given, ckpt)
    if len(parse_stages(args.stages)) != 1:
        raise ValueError(f"--resume continues one stage: give one --stage, not {args.stages!r}")
    try:
        cfg = check(args, world_size)
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

