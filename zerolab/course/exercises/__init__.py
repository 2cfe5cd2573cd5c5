"""Coding exercises, auto-checked: the learner writes one piece of DDP / ZeRO, a checker grades it.

Idea (CS336 assignment 2's adapters, made small): each exercise is one or two module-level
functions that zerolab's own strategy calls (`zerolab.sharding.shard_range`,
`zerolab.ddp.all_reduce_bucket`, `zerolab.zero1.own_gradient` / `publish_update`,
`zerolab.zero2.reduce_scatter_bucket`, `zerolab.zero3.gather_params` / `free_params`). The
checker starts 2-4 gloo ranks, puts the learner's functions in place of the package's in every
rank, trains a small GPT with the strategy and runs the SAME checks as zerolab's own tests
(`zerolab.course.testing`): parameters equal to the single-process torch AdamW reference after every
step, bytes held and bytes sent equal to `zerolab.theory`'s formulas. It prints what a learner can
act on: which rank, which parameter, which step first differed, expected vs got bytes.
Exercises (f)-(h) ask for predictions - the mesh's process groups, DDP's buckets and ZeRO-3's
gathered peak, the α-β time of a collective - graded against zerolab and a measured run
(.more); the optional track (i)-(j) asks for a whole DDP class and a sharded optimizer, graded
for correctness, bytes and time on an emulated link (.track). `Exercise.grader` names the module.

    zerolab check ddp --impl my_ddp.py             # or, in a notebook: check.exercise("ddp", "my_ddp.py")
    zerolab check --list                           # the exercises and their skeleton files
    zerolab check ddp --hint 2                     # hint 2 (1: a nudge ... last: almost the code);
                                                   # notebook: hint("ddp", 2) (.hints)

Skeletons: zerolab/course/exercises/skeletons/{name}.py (the notebooks in notebooks/exercises/ start
from them). Numeric "predict, then measure" questions: `answer("02.3", value)`, `reveal("02.3")`
(zerolab.course.exercises.answers).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SKELETONS = Path(__file__).parent / "skeletons"


@dataclass(frozen=True)
class Exercise:
    """One exercise: the package module whose functions the learner replaces, and the check."""
    name: str
    letter: str
    title: str
    module: str                 # e.g. "zerolab.ddp"
    functions: tuple[str, ...]  # the learner writes these, with these names
    stage: int                  # the strategy trained in the check
    model: str                  # zerolab.course.testing.make_model name
    hints: tuple[str, ...]      # the usual mistakes, shown when the check fails
    grader: str = ""            # (f)-(j): the module whose grade() checks it (checker.run_check)

    @property
    def skeleton(self) -> Path:
        return SKELETONS / f"{self.name}.py"


EXERCISES = {e.name: e for e in (
    Exercise("shard_range", "a", "shard ranges with padding", "zerolab.sharding", ("shard_range",),
             3, "odd", ("every rank's range has the same length ceil(numel / world_size), "
                        "also the last rank's (it reaches into the padding)",
                        "ranges are contiguous and in rank order: rank r starts where r-1 stops")),
    Exercise("ddp", "b", "DDP: bucketed all_reduce in a gradient hook", "zerolab.ddp",
             ("all_reduce_bucket",), 0, "nano",
             ("all_reduce sums: divide by world_size (in handle.on_done, after the sum arrived)",
              "all_reduce the bucket unit.grad_flat itself (in place), not a copy",
              "return the handle, so that backward can wait for it")),
    Exercise("zero1", "c", "ZeRO-1: update your own range, then all_gather", "zerolab.zero1",
             ("own_gradient", "publish_update"), 1, "nano",
             ("own_gradient: unit.own(unit.grad_flat), converted to fp32 (.float() makes a copy)",
              "publish_update: copy unit.master into unit.own(unit.param_flat) BEFORE the "
              "all_gather, and gather into unit.param_flat from unit.own(unit.param_flat)")),
    Exercise("zero2", "d", "ZeRO-2: reduce_scatter each bucket when ready, free it",
             "zerolab.zero2", ("reduce_scatter_bucket",), 2, "nano",
             ("reduce_scatter into a new chunk (torch.empty_like(unit.grad_shard)), then ADD "
              "chunk / world_size to unit.grad_shard: micro-steps accumulate",
              "free in handle.on_done: unit.bucket = None and p.grad = None for p in unit.params "
              "(the .grad views keep the bucket alive)")),
    Exercise("zero3", "e", "ZeRO-3: gather before, free after", "zerolab.zero3",
             ("gather_params", "free_params"), 3, "nano",
             ("gather_params: alloc_storage(unit.param_flat) first, then all_gather "
              "unit.param_shard into unit.param_flat",
              "free_params: free_storage(unit.param_flat): the views stay, the bytes go")),
)}

# (f)-(h): predict the layout and the knobs, graded against zerolab and a measured run (.more);
# (i)-(j), the optional track: a whole strategy class, graded on gloo ranks (.track)
EXERCISES.update((e.name, e) for e in (
    Exercise("groups", "f", "TP/DP and HSDP process groups of a device mesh",
             "zerolab.course.exercises.more", ("tp_dp_groups", "hsdp_groups"), -1, "",
             ("TP groups are tp_size neighbouring ranks (they talk in every layer: one node); a "
              "DP group takes the rank at the same position of every TP group",
              "HSDP is the same grid: a shard group is one node (ranks_per_node consecutive "
              "ranks), a replicate group the ranks at the same position on every node",
              "raise ValueError when the group size does not divide world_size",
              "rows = [list(range(s, s + size)) for s in range(0, world_size, size)]; "
              "columns = [list(range(c, world_size, size)) for c in range(size)]"),
             grader="zerolab.course.exercises.more"),
    Exercise("buckets_prefetch", "g", "predict DDP's buckets and ZeRO-3's gathered peak, measured",
             "zerolab.course.exercises.more", ("ddp_buckets", "zero3_gathered_peak"), -1, "",
             ("a bucket takes the next block while its gradients stay within the cap; a block "
              "larger than the cap gets a bucket of its own; None: one bucket per block",
              "the cap counts MiB: bucket_cap_mb * 2**20 bytes, // grad_bytes elements (>= 1)",
              "ZeRO-3 holds the root unit for the whole pass, the block that runs and `prefetch` "
              "blocks gathered ahead of it (-1: all of them; never more than n_blocks)",
              "peak = (root_numel + min(1 + prefetch, n_blocks) * block_numel) * param_bytes, "
              "n_blocks blocks for prefetch = -1"),
             grader="zerolab.course.exercises.more"),
    Exercise("timing", "h", "α-β time of a ring collective, measured on the emulated link",
             "zerolab.course.exercises.more", ("ring_time",), -1, "",
             ("a ring collective on n ranks: α per ring step, plus the bytes each rank sends / β",
              "steps: 2(n-1) for all_reduce, n-1 for the others; bytes per rank: 2(n-1)/n·S for "
              "all_reduce, (n-1)/n·S for reduce_scatter and all_gather, S for broadcast",
              "n = 1 moves nothing: 0.0 seconds",
              "steps * link.latency + theory.RING_FACTOR[op](n) * size_bytes / link.bandwidth"),
             grader="zerolab.course.exercises.more"),
    Exercise("strategy_ddp", "i", "track: a whole DDP, bucketed all_reduces overlapping backward",
             "zerolab.ddp", ("BucketedDDP",), 0, "nano",
             ("in __init__, register p.register_post_accumulate_grad_hook on every trainable "
              "parameter and count, per bucket, the gradients still to come",
              "when a bucket's last gradient arrives: flatten its grads into one buffer, start "
              "comm.all_reduce(buf, what='grads', async_op=True) and keep the handle: no wait",
              "finish(): wait for every handle, divide by comm.world_size, copy each slice back "
              "into p.grad, reset the counters for the next backward",
              "buckets: walk reversed(trainable params), open a new bucket when p would take it "
              "past bucket_cap_mb * 2**20 bytes"),
             grader="zerolab.course.exercises.track"),
    Exercise("strategy_zero1", "j", "track: a whole sharded optimizer (ZeRO-1)",
             "zerolab.zero1", ("ShardedAdamW",), 1, "nano",
             ("per group: the parameters flattened into one vector padded to a multiple of N; "
              "rank r owns [r·S, (r+1)·S) with S = padded / N",
              "keep a leaf tensor `shard` (a copy of your range) and a torch.optim.AdamW([shard], "
              "lr, betas, eps, weight_decay=the group's): its state is then 1/N",
              "step(): shard.grad = your range of the flat gradient; AdamW step; all_gather the "
              "shards into a new padded buffer; copy each parameter's slice back (no_grad)",
              "keep no full-size buffer in self between steps, and gather one flat buffer per "
              "group, not parameter by parameter (each collective pays (n-1)·α)"),
             grader="zerolab.course.exercises.track"),
))


def exercise(name: str, impl: str, nproc: int = 3, timeout: float = 90.0, quiet: bool = False,
             call_timeout: float = 20.0):
    """Check `impl` (a .py file, or a dotted module such as "zerolab.ddp") for exercise `name` on
    `nproc` gloo ranks; print the verdict and return a `checker.Result` (`.ok`, `.lines`).
    Never raises for a wrong or blank solution (the notebook cell shows the message). timeout:
    seconds for the whole check; call_timeout: for one call of your function (a hang)."""
    from .checker import run_check
    result = run_check(name, impl, nproc=nproc, timeout=timeout, call_timeout=call_timeout)
    if not quiet:
        print(result.text())
    return result


def hint(name: str, k: int = 1):
    """Print hint `k` of exercise `name` (1: a nudge; the last: almost the code; the solution
    itself stays in the notebook's last cell). ValueError naming the range for another k."""
    from .hints import text
    print(text(name, k))


def answer(question: str, value: float) -> bool:
    """Grade a numeric "predict, then measure" answer; see zerolab.course.exercises.answers."""
    from .answers import answer as _answer
    return _answer(question, value)


def reveal(question: str):
    """Print the answer to a numeric question, with how it is computed."""
    from .answers import reveal as _reveal
    return _reveal(question)


def cli_check(args) -> int:
    """`zerolab check [EXERCISE] --impl FILE [--nproc N] [--timeout S] [--call-timeout S] [--list]
    [--hint [K]]`: 0 pass (or a hint printed), 1 fail."""
    if getattr(args, "hint", None) is not None:
        if args.exercise is None:
            raise ValueError("--hint needs an exercise: zerolab check ddp --hint (zerolab check "
                             "--list names them)")
        hint(args.exercise, args.hint)
        return 0
    if args.list or args.exercise is None:
        for ex in EXERCISES.values():
            print(f"{ex.name:<16} ({ex.letter}) {ex.title}; write {', '.join(ex.functions)}; "
                  f"skeleton {ex.skeleton}")
        return 0
    if args.exercise not in EXERCISES:
        raise ValueError(f"exercise {args.exercise!r} is not one of {', '.join(EXERCISES)}")
    if args.impl is None:
        raise ValueError(f"--impl FILE is required: your .py file (start from "
                         f"{EXERCISES[args.exercise].skeleton})")
    return 0 if exercise(args.exercise, args.impl, nproc=args.nproc, timeout=args.timeout,
                         call_timeout=getattr(args, "call_timeout", 20.0)).ok else 1
