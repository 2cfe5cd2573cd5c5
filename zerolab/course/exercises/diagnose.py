"""Diagnoses for the exercise checker: name a learner's mistake from what their code observably
did, in one or two lines (what is wrong, where in their code, what to do), instead of only
"parameter P differs" or a traceback from inside zerolab.

checker.py uses three parts, each worded for ONE exercise (no message gives another exercise's
advice):

- `probe(name, functions)`, in the checking process before any rank starts: the functions that
  need no collective, on small stand-ins. shard_range on a table of (numel, N) - a wrong range
  is classified (last rank clipped to numel, floor instead of ceil, off by one, (start, length),
  overlapping, unequal lengths, floats); ZeRO-1's own_gradient on a bf16 unit (rank 2 of 4), the
  only place where a missing fp32 conversion shows (the check trains in fp32, where .float() is
  a no-op).
- `watch.instrument(name, functions, notes)` (watch.py, with spy.py), inside every rank:
  wrappers around the learner's functions that watch what they do. The `comm` they receive is a spy that records each
  collective (which of unit's buffers, the line of the learner's file) and starts it only when
  the learner's function returns or waits - so that a change to a tensor between starting its
  collective and its end (dividing outside `handle.on_done`, copying the master after the
  all_gather) is seen every time, not only when gloo's thread happens to lose the race. Once
  the collective is done (after `on_done`), the result is compared with the right one - worked
  out with a collective of our own, outside the ledger - and with the usual wrong ones: the sum
  (N x the average), the previous micro-step's shard lost, the old weights, a bucket still
  alive. A handle that is not returned is caught before zerolab calls `.wait()` on it; a
  collective into freed memory is stopped (`Mistake`) before it runs.
- here: `Mistake` and `Notes` (what a rank reports), `probe`, and `norm_advice`,
  `param_advice`: the wording of the end-of-step findings (gradient norm, parameters) for each
  exercise, used when no wrapper named the cause.
"""
from __future__ import annotations

import operator

import torch

# --- what every rank reports ---------------------------------------------------------------------


class Mistake(Exception):
    """A learner's mistake that would crash zerolab (or corrupt memory) if the run went on: the
    checker reports `text` for function `kind` and stops every rank (raised on every rank alike,
    the learner's code being the same on each)."""

    def __init__(self, fname: str, text: str):
        self.kind, self.text = _kind_text(fname, text)
        super().__init__(f"{self.kind}: {self.text}")


def _kind_text(fname: str, text: str) -> tuple[str, str]:
    """("your FNAME", the rest): the checker prints them as "rank r: your FNAME: what is wrong"."""
    kind = f"your {fname}"
    for cut in (kind + ": ", kind + " "):
        if text.startswith(cut):
            return kind, text[len(cut):]
    return kind, text


class Notes:
    """The diagnoses one rank made so far: (kind = the learner's function, text), each once."""

    def __init__(self):
        self.items: list[tuple[str, str]] = []
        self.step = 0               # the optimizer step being checked (set by the checker)

    def add(self, fname: str, text: str):
        item = _kind_text(fname, text)
        if item not in self.items:
            self.items.append(item)

    def drain(self) -> list[tuple[str, str]]:
        out, self.items = self.items, []
        return out


def _same(a, b) -> bool:
    """Bit for bit, NaN where NaN was (a tensor left as it was)."""
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def _close(a, b) -> bool:
    """Equal up to the order of a float sum (an N x or a lost micro-step is far outside)."""
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape or torch.isnan(a).any():
        return False
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-30)
    return bool(((a - b).abs() <= 1e-5 * scale + 1e-12).all())


def _largest(got, want) -> str:
    diff = (got.detach().float() - want.detach().float()).abs()
    i = int(diff.reshape(-1).nan_to_num(float("inf")).argmax())
    return f"element {i}: {got.reshape(-1)[i].item():.6g}, expected {want.reshape(-1)[i].item():.6g}"


# --- (a) shard_range, without ranks ---------------------------------------------------------------
SHOWCASE = [(10, 4), (3, 4), (7, 3)]          # the skeleton's examples first: the clearest cases
NUMELS = [*range(1, 41), 1000, 1001, 4099, 10**9 + 7]


def _pairs(ranges) -> str:
    return " ".join(f"({a}, {b})" for a, b in ranges)


def shard_range_problem(fn) -> list[str]:
    """[] when `fn` gives every rank's padded range for numel 1..40 and a few large ones, N = 1..8;
    else two lines: the first (numel, N) whose ranges are wrong, and what is wrong with them."""
    for numel, n in SHOWCASE + [(numel, n) for numel in NUMELS for n in range(1, 9)]:
        shard = -(-numel // n)
        want = [(r * shard, (r + 1) * shard) for r in range(n)]
        got = []
        for r in range(n):
            call = f"shard_range(numel={numel}, world_size={n}, rank={r})"
            try:
                value = fn(numel, n, r)
            except Exception as err:  # noqa: BLE001 - shown to the learner
                return [f"{call} raised {type(err).__name__}: {err}"]
            try:
                start, stop = value
            except (TypeError, ValueError):
                return [f"{call} returned {value!r}: expected a pair of ints (start, stop), "
                        f"here {want[r]}"]
            if any(isinstance(v, float) for v in (start, stop)):
                return [f"{call} returned {value!r}: floats, and a range indexes a tensor",
                        "numel / world_size is true division in Python 3: use ints, "
                        "-(-numel // world_size) (ceil division) or math.ceil(numel / world_size)"]
            try:
                got.append((operator.index(start), operator.index(stop)))
            except TypeError:
                return [f"{call} returned {value!r}: expected a pair of ints (start, stop), "
                        f"here {want[r]}"]
        if got != want:
            return [f"shard_range(numel={numel}, world_size={n}) for ranks 0-{n - 1} returned "
                    f"{_pairs(got)}; expected {_pairs(want)}",
                    _shard_range_why(numel, n, got, want, shard)]
    return []


def _shard_range_why(numel, n, got, want, shard) -> str:
    lengths = [b - a for a, b in got]
    starts_ok = all(a == w[0] for (a, _), w in zip(got, want))
    floor = numel // n
    each = f"every rank owns ceil(numel / world_size) = {shard} elements"
    if got == [(min(a, numel), min(b, numel)) for a, b in want]:
        return (f"the last rank's range stops at numel = {numel}: ranges are padded, {each} "
                f"and the last one reaches into the padding: don't clip to numel, stop = "
                f"(rank + 1) * {shard}")
    if n > 1 and starts_ok and all(b == shard for _, b in got):
        return (f"the second value is the length ({shard}), but it is the stop, the exclusive "
                f"end of the range: return (start, start + {shard})")
    if starts_ok and set(lengths) == {shard - 1}:
        return (f"off by one: stop is exclusive ([start, stop) holds stop - start elements), "
                f"{each}: stop = (rank + 1) * {shard}, where rank + 1 starts")
    if starts_ok and set(lengths) == {shard + 1}:
        return (f"off by one: stop is exclusive, so rank r + 1 starts AT rank r's stop, and "
                f"{each}: stop = (rank + 1) * {shard}")
    if floor < shard and got == [(r * floor, (r + 1) * floor) for r in range(n)]:
        return (f"not padded: numel // world_size = {floor} rounds down, so {n} x {floor} = "
                f"{n * floor} < {numel} elements and the last {numel - n * floor} belong to no "
                f"rank: round up, ceil(numel / world_size) = {shard} (the buffer is padded to "
                f"{n * shard})")
    if (got[0][0] == 0 and got[-1][1] == numel and len(set(lengths)) > 1
            and all(got[r][1] == got[r + 1][0] for r in range(n - 1))):
        return (f"the ranges split exactly numel elements, with unequal lengths {lengths}: ZeRO "
                f"pads instead, {each} (one equal chunk per rank for reduce_scatter / "
                f"all_gather), the last reaching into the padding")
    for r in range(n - 1):
        if got[r][1] > got[r + 1][0]:
            return (f"rank {r}'s range {got[r]} overlaps rank {r + 1}'s {got[r + 1]}: rank r + 1 "
                    f"starts where rank r stops; {each}: (rank * {shard}, (rank + 1) * {shard})")
        if got[r][1] < got[r + 1][0]:
            return (f"elements [{got[r][1]}, {got[r + 1][0]}) between rank {r} and rank {r + 1} "
                    f"belong to no rank: rank r + 1 starts where rank r stops; {each}: "
                    f"(rank * {shard}, (rank + 1) * {shard})")
    if len(set(lengths)) > 1:
        return f"the ranges have unequal lengths {lengths}: {each}"
    return f"{each}, in rank order: rank r's range is (r * {shard}, (r + 1) * {shard})"


# --- (c) own_gradient, without ranks: on a bf16 unit, where the fp32 conversion shows ----------
def own_gradient_problem(fn) -> list[str]:
    """[] when `fn(unit)` returns this rank's range of unit.grad_flat as fp32 on a bf16 unit of 13
    elements (rank 2 of 4: range [8, 12) of 16); else one line. An exception: [] (the ranks
    report it with the line of the learner's file)."""
    from ...sharding import FlatUnit
    n, rank, dtype = 4, 2, torch.bfloat16
    params = [torch.nn.Parameter(torch.zeros(5, 2, dtype=dtype)),
              torch.nn.Parameter(torch.zeros(3, dtype=dtype))]
    unit = FlatUnit("probe", params, n, rank)
    unit.param_flat = unit.flatten()
    unit.grad_flat = torch.zeros(unit.padded_numel, dtype=dtype)
    unit.grad_flat[:unit.numel] = torch.arange(1, unit.numel + 1, dtype=dtype)
    unit.bind_grads(unit.grad_flat)
    unit.master = unit.own(unit.param_flat).float().clone()
    before, k = unit.grad_flat.clone(), unit.shard_numel
    try:
        got = fn(unit)
    except Exception:  # noqa: BLE001 - the ranks report it, with rank and line
        return []
    where = (f"your own_gradient (tried on a bf16 unit of {unit.numel} elements padded to "
             f"{unit.padded_numel}, rank {rank} of {n}: its range is [{unit.start}, "
             f"{unit.start + k}) of unit.grad_flat)")
    if not torch.is_tensor(got):
        return [f"{where} returned {type(got).__name__}, not a tensor: return "
                f"unit.own(unit.grad_flat).float()"]
    if got.numel() == unit.padded_numel:
        return [f"{where} returned all of unit.grad_flat ({unit.padded_numel} elements): this "
                f"rank's master holds only its own range, unit.own(unit.grad_flat) ({k})"]
    if tuple(got.shape) != (k,):
        return [f"{where} returned shape {tuple(got.shape)}: this rank's range has "
                f"unit.shard_numel = {k} elements, unit.own(unit.grad_flat)"]
    if not _close(got, unit.own(before)):
        for r in range(n):
            if _close(got, before[r * k:(r + 1) * k]):
                return [f"{where} returned rank {r}'s range [{r * k}, {(r + 1) * k}): each rank "
                        f"updates its OWN range, unit.own(unit.grad_flat) (it starts at "
                        f"unit.start = rank x unit.shard_numel)"]
        return [f"{where} returned values that are not this rank's range of unit.grad_flat "
                f"({_largest(got, unit.own(before))}): return unit.own(unit.grad_flat).float()"]
    if got.dtype != torch.float32:
        return [f"{where} returned {str(got.dtype).replace('torch.', '')}: no fp32 conversion. "
                f"The master and AdamW's states are fp32 while bf16 weights have a bf16 gradient: "
                f"return unit.own(unit.grad_flat).float() (a copy, not a view of the bucket)"]
    if not torch.equal(unit.grad_flat, before):
        return [f"{where} changed unit.grad_flat: read it, don't modify it - return a new "
                f"tensor, unit.own(unit.grad_flat).float()"]
    return []


def probe(name: str, functions: dict) -> list[str]:
    """Findings about exercise `name`'s functions that need no rank ([]: none, start the ranks)."""
    if name == "shard_range":
        return shard_range_problem(functions["shard_range"])
    if name == "zero1":
        return own_gradient_problem(functions["own_gradient"])
    return []


# --- end-of-step findings, worded per exercise ------------------------------------------------------
def norm_advice(name: str, ratio: float, n: int) -> str:
    """What a global gradient norm `ratio` x the reference's means for exercise `name`."""
    if abs(ratio - n) < 0.01 * n:
        return {"ddp": "the gradients are summed, not averaged: divide by world_size in "
                       "handle.on_done",
                "zero2": "the gradient shards are summed, not averaged: divide each chunk by "
                         "world_size before adding it to unit.grad_shard",
                }.get(name, f"the gradient is {n} x too large")
    if abs(ratio * n - 1) < 0.01:
        return {"ddp": "divided by world_size twice? divide once, in handle.on_done",
                "zero2": "divided by world_size twice? divide each chunk once",
                }.get(name, f"the gradient is {n} x too small")
    return {"ddp": "unit.grad_flat is not the average of the ranks' gradients after the wait: "
                   "all_reduce it in place and divide it in handle.on_done, after the sum arrived",
            "zero1": "own_gradient must return this rank's range of the averaged gradient, "
                     "unit.own(unit.grad_flat)",
            "zero2": "a micro-step's gradient is lost or counted twice: ADD each averaged "
                     "chunk to unit.grad_shard, in handle.on_done",
            "zero3": "the blocks computed with wrong weights: gather_params must fill "
                     "unit.param_flat with every rank's unit.param_shard",
            "shard_range": "a parameter's gradient is split into the wrong ranges",
            }.get(name, "the gradient differs from the single-process one")


def param_advice(name: str, stale: bool) -> str:
    """What a parameter that differs from the reference means for exercise `name` ('' if
    nothing specific): `stale` - it still holds its value from before this step."""
    if stale:
        return {"zero1": "it still holds its value from before this step: the update never "
                         "reached the weights - publish_update must copy unit.master into "
                         "unit.own(unit.param_flat) BEFORE the all_gather",
                }.get(name, "it still holds its value from before this step: the update never "
                            "reached the weights")
    return ""
