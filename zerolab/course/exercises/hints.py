"""Hints a learner asks for before (or instead of) failing a check, one at a time, from a nudge
to almost the code; the full solution stays in the notebook's last cell.

    zerolab check ddp --hint          # hint 1;  --hint 2: the next one, ...
    exercises.hint("ddp", 2)          # the same in a notebook

`STEPS` holds them for exercises (a)-(e); an exercise without an entry uses its `hints` (the
tuple the checker shows after a failure), which for (f)-(j) already run from idea to formula.
"""
from __future__ import annotations

from .table import EXERCISES

STEPS = {
    "shard_range": (
        "Every rank owns the same number of elements, the last rank too. How many must that be "
        "so that world_size equal ranges cover all numel elements?",
        "That number is ceil(numel / world_size) - with ints, -(-numel // world_size). The "
        "padded buffer holds world_size times as many, so the last range may reach past numel "
        "(into the padding), or lie in it entirely.",
        "Rank r's range starts where rank r - 1's stops: start = rank x that number. stop is "
        "exclusive (the range is [start, stop)) and is not clipped to numel.",
    ),
    "ddp": (
        "One collective does the work: an all_reduce of the whole bucket, started without "
        "waiting for it (async_op=True): backward is still running on the earlier layers.",
        "all_reduce works in place on the tensor you give it: give it unit.grad_flat itself "
        "(every p.grad is a view of it), not a copy.",
        "all_reduce SUMS. The average is the sum / world_size, and you may divide only once the "
        "sum has arrived: a function you put in handle.on_done runs then (backward's "
        "handle.wait() calls it).",
        "handle = comm.all_reduce(unit.grad_flat, what=\"grads\", unit=unit.name, "
        "async_op=True); set handle.on_done to a function that divides unit.grad_flat by "
        "world_size in place (div_); return the handle.",
    ),
    "zero1": (
        "Two halves: own_gradient picks what this rank updates, publish_update shares the "
        "result. Each rank owns one contiguous range of every flat buffer; unit.own(t) is that "
        "range of t.",
        "own_gradient: this rank's range of the averaged gradient unit.grad_flat, as fp32 - the "
        "master and AdamW's states are fp32, and with bf16 weights the gradient is bf16.",
        "publish_update, in this order: write the updated unit.master into this rank's range of "
        "the weights unit.param_flat (copy_ converts fp32 to the weights' dtype), THEN start the "
        "all_gather: a collective sends what your range holds when it starts.",
        "own_gradient: unit.own(unit.grad_flat).float(). publish_update: "
        "unit.own(unit.param_flat).copy_(unit.master), then comm.all_gather with output "
        "unit.param_flat and input unit.own(unit.param_flat), async_op=True; return its handle.",
    ),
    "zero2": (
        "Three things, in order: start the reduce_scatter of unit.bucket; once it is done, add "
        "this rank's averaged chunk to unit.grad_shard; then free the bucket. \"Once it is "
        "done\" is handle.on_done.",
        "reduce_scatter writes this rank's chunk (the SUM over the ranks of your range) into an "
        "output of your range's size: make a new one, torch.empty_like(unit.grad_shard), and "
        "read it only in on_done - before that it holds garbage.",
        "unit.grad_shard accumulates over micro-steps: ADD chunk / world_size to it "
        "(unit.grad_shard.add_(...)); never overwrite it.",
        "Freeing, in on_done after the add: unit.bucket = None is not enough, every p.grad of "
        "unit.params is a view of the bucket and keeps its memory alive: set p.grad = None for "
        "each p in unit.params too. Return the handle.",
    ),
    "zero3": (
        "gather_params rebuilds the full weights from every rank's shard; free_params throws "
        "them away again and keeps the shard. The parameters are views of unit.param_flat: "
        "that tensor stays, only its memory comes and goes.",
        "When gather_params is called, unit.param_flat has no memory (free_params released it): "
        "give it back with alloc_storage(unit.param_flat) before anything writes into it.",
        "Then one blocking all_gather: output unit.param_flat, input unit.param_shard (this "
        "rank's resident shard - not a range of unit.param_flat, whose values were freed).",
        "free_params: free_storage(unit.param_flat). Not unit.param_shard (your only copy of "
        "the weights), and don't replace unit.param_flat with None or a new tensor.",
    ),
}


def steps(name: str) -> tuple[str, ...]:
    """Exercise `name`'s hints, in order (ValueError for an unknown exercise)."""
    if name not in EXERCISES:
        raise ValueError(f"exercise {name!r} is not one of {', '.join(EXERCISES)}")
    return STEPS.get(name) or EXERCISES[name].hints


def text(name: str, k=1) -> str:
    """Hint `k` (1, 2, ...; an int or its text, as typed after --hint) of exercise `name`, with
    its number and how to get the next. ValueError (one line) for a k out of range."""
    hints = steps(name)
    try:
        k = int(k)
        if isinstance(k, bool) or not 1 <= k <= len(hints):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"hint {k!r} is not one of 1-{len(hints)} for {name} (1 is a nudge, "
                         f"{len(hints)} almost the code)") from None
    ex = EXERCISES[name]
    after = (f"next: zerolab check {name} --hint {k + 1} (notebook: exercises.hint(\"{name}\", "
             f"{k + 1}))" if k < len(hints) else
             "that was the last hint; the full solution is zerolab's own code, in the last cell "
             "of the exercise's notebook" + ("" if ex.grader else     # (f)-(j): the cell says which
                                             f" ({', '.join(f'{ex.module}.{f}' for f in ex.functions)})"))
    return f"exercise ({ex.letter}) {ex.title}: hint {k} of {len(hints)}\n  {hints[k - 1]}\n  {after}"
