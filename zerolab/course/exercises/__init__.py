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

from .table import EXERCISES, SKELETONS, Exercise  # noqa: F401 (the table, for the door's users)


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
