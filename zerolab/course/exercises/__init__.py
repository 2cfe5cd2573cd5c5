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

    zerolab check ddp --impl my_ddp.py             # or, in a notebook: check.exercise("ddp", "my_ddp.py")
    zerolab check --list                           # the exercises and their skeleton files

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


def exercise(name: str, impl: str, nproc: int = 3, timeout: float = 90.0, quiet: bool = False):
    """Check `impl` (a .py file, or a dotted module such as "zerolab.ddp") for exercise `name` on
    `nproc` gloo ranks; print the verdict and return a `checker.Result` (`.ok`, `.lines`).
    Never raises for a wrong or blank solution (the notebook cell shows the message)."""
    from .checker import run_check
    result = run_check(name, impl, nproc=nproc, timeout=timeout)
    if not quiet:
        print(result.text())
    return result


def answer(question: str, value: float) -> bool:
    """Grade a numeric "predict, then measure" answer; see zerolab.course.exercises.answers."""
    from .answers import answer as _answer
    return _answer(question, value)


def reveal(question: str):
    """Print the answer to a numeric question, with how it is computed."""
    from .answers import reveal as _reveal
    return _reveal(question)


def cli_check(args) -> int:
    """`zerolab check [EXERCISE] --impl FILE [--nproc N] [--timeout S] [--list]`: 0 pass, 1 fail."""
    if args.list or args.exercise is None:
        for ex in EXERCISES.values():
            print(f"{ex.name:<12} ({ex.letter}) {ex.title}; write {', '.join(ex.functions)}; "
                  f"skeleton {ex.skeleton}")
        return 0
    if args.exercise not in EXERCISES:
        raise ValueError(f"exercise {args.exercise!r} is not one of {', '.join(EXERCISES)}")
    if args.impl is None:
        raise ValueError(f"--impl FILE is required: your .py file (start from "
                         f"{EXERCISES[args.exercise].skeleton})")
    return 0 if exercise(args.exercise, args.impl, nproc=args.nproc, timeout=args.timeout).ok else 1
