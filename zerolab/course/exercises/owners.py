"""Exercise (k): the owner of each whole matrix, greedy by size, graded without ranks.

Muon, Adafactor and LAMB read a parameter's whole matrix, so the owner layout
(zerolab/wholematrix/muon_owner.py) gives every parameter to one rank, as torch's ZeroRedundancyOptimizer
does for any optimizer (`_partition_parameters`): largest first (all of a parameter's elements;
equal sizes in list order), each to the rank owning the fewest elements so far (the lowest rank on
a tie). The learner writes `assign_owners(shapes, world_size)`; the check compares it with
zerolab's (`muon_theory.assign_owners`, which tests/test_exercises_owners.py holds to torch's
ZeroRedundancyOptimizer) on hand-made cases that tell the usual mistakes apart, a few hundred
random ones, the course's GPT on 2-4 ranks and the 7.5B GPT on 64. A wrong answer names the
first case that differs, the owners and loads got and expected, and - when the answer equals a
known wrong rule on every case - that rule and its fix (`MISTAKES`).

`checker.run_check`'s judge (a fork, no ranks) loads the learner's function and calls `grade`.
"""
from __future__ import annotations

import random

from ...wholematrix import muon_theory as mt


# --- the reference solution ------------------------------------------------------------------
def assign_owners(shapes, world_size: int) -> list[int]:
    """Owning rank of each parameter of `shapes` on `world_size` ranks: torch's
    ZeroRedundancyOptimizer's greedy partition (muon_theory.assign_owners, one group)."""
    return mt.assign_owners([mt.numel(s) for s in shapes], world_size)


# --- the usual mistakes, each as the rule a learner wrote ------------------------------------
def _greedy(sizes, n, order, pick=None):
    """Each parameter in `order` to rank pick(loads) (default: the least loaded, lowest on a
    tie), loads counted in `sizes`."""
    pick = pick or (lambda loads: loads.index(min(loads)))
    loads, owners = [0] * n, [0] * len(sizes)
    for i in order:
        r = pick(loads)
        owners[i], loads[r] = r, loads[r] + sizes[i]
    return owners


def _numels(shapes):
    return [mt.numel(s) for s in shapes]


def _largest_first(sizes):
    return sorted(range(len(sizes)), key=lambda i: -sizes[i])


MISTAKES = (   # (why, wrong assign_owners): named when the learner's answer equals it everywhere
    ("the parameters are taken in list order: sort them largest first (a big one placed last "
     "lands on top of a full rank)",
     lambda s, n: _greedy(_numels(s), n, range(len(s)))),
    ("the parameters are taken smallest first: sort by size descending (key=-numel, or "
     "reverse=True)",
     lambda s, n: _greedy(_numels(s), n, sorted(range(len(s)), key=lambda i: _numels(s)[i]))),
    ("the size is the number of rows (shape[0]): sort by numel, the product of the whole shape "
     "(a 768 x 3072 weight is 2.4M elements, not 768)",
     lambda s, n: _greedy(_numels(s), n, _largest_first([mt.rows(x) for x in s]))),
    ("the loads count rows (shape[0]) instead of elements: add numel to the owner's load",
     lambda s, n: _greedy([mt.rows(x) for x in s], n, _largest_first(_numels(s)))),
    ("the loads count parameters, not elements (that is round-robin in size order): add the "
     "parameter's numel to its owner's load",
     lambda s, n: _greedy([1] * len(s), n, _largest_first(_numels(s)))),
    ("the ranks are dealt round-robin (i % world_size): give each parameter to the rank owning "
     "the fewest elements so far",
     lambda s, n: [k % n for k in range(len(s))]),
    ("a tie goes to the highest rank: among equally loaded ranks take the lowest "
     "(loads.index(min(loads)) finds it)",
     lambda s, n: _greedy(_numels(s), n, _largest_first(_numels(s)),
                          lambda loads: n - 1 - loads[::-1].index(min(loads)))),
    ("equal sizes are taken last first (sorted((numel, index), reverse=True) reverses the "
     "indices too): keep equal sizes in list order, sort by the size alone (a stable sort)",
     lambda s, n: _greedy(_numels(s), n, [i for _, i in sorted(
         ((k, i) for i, k in enumerate(_numels(s))), reverse=True)])),
    ("the owners are listed in size order: return them in the order of `shapes` (owners[i] "
     "for parameter i)",
     lambda s, n: [assign_owners(s, n)[i] for i in _largest_first(_numels(s))]),
)


# --- the cases ---------------------------------------------------------------------------------
def _gpt_shapes(preset: str):
    import torch

    from ...model import GPT, get_config
    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(get_config(preset)).parameters()]


def _big_shapes():
    from ..muontable import BIG, gpt_shapes
    return gpt_shapes(BIG)[0]


def cases():
    """[(label, shapes, world_size)]: first the hand-made ones (each separates mistakes that
    agree elsewhere), then random ones, then the course's GPT and the 7.5B GPT."""
    out = [("the docstring's example", [(4, 4), (2, 2), (3, 3)], 2),
           ("a large parameter last", [(2, 3), (2, 2), (1, 3), (4, 8)], 2),
           ("many rows, few elements, against few rows, many elements",
            [(64, 1), (2, 100), (3, 50), (8,)], 2),
           ("equal sizes", [(3, 4), (4, 3), (2, 6), (12,), (1,)], 3),
           ("more ranks than parameters", [(5, 5), (3,)], 4),
           ("a 0-d parameter and a 3-D one", [(), (2, 3, 4), (6, 6), (7,)], 3),
           ("one rank", [(3, 3), (2,)], 1)]
    rng = random.Random(0)
    for k in range(300):
        shapes = [tuple(rng.randint(1, 40) for _ in range(rng.choice((0, 1, 2, 2, 3))))
                  for _ in range(rng.randint(1, 12))]
        out.append((f"random case {k}", shapes, rng.randint(1, 8)))
    for n in (2, 3, 4):
        out.append((f"the course's GPT (tiny) on {n} ranks", _gpt_shapes("tiny"), n))
    out.append(("the 7.5B GPT (36 x 4096) on 64 ranks", _big_shapes(), 64))
    return out


# --- grading -----------------------------------------------------------------------------------
def _short(shapes, limit=8):
    text = ", ".join(map(str, shapes[:limit]))
    return f"[{text}{', ...' if len(shapes) > limit else ''}] ({len(shapes)} parameters)"


def _as_owners(value, count, n):
    """value as a list of `count` ints in 0..n-1, or one line on why not."""
    try:
        owners = [int(r) for r in value]
    except (TypeError, ValueError):
        return None, f"returned {value!r}: expected a list of ranks, one int per parameter"
    if len(owners) != count:
        return None, f"returned {len(owners)} ranks for {count} parameters: one rank per parameter"
    bad = [r for r in owners if not 0 <= r < n]
    if bad:
        return None, f"names rank {bad[0]}, outside 0..{n - 1}"
    return owners, None


def grade(name: str, functions: dict, impl: str, nproc: int, timeout: float):
    """(ok, lines) for the learner's assign_owners (exercise (k)); no ranks are started."""
    fn, cs = functions["assign_owners"], cases()
    got_all = []
    for label, shapes, n in cs:
        call = f"assign_owners({_short(shapes)}, {n})"
        try:
            value = fn(list(shapes), n)
        except Exception as err:  # noqa: BLE001 - shown to the learner
            return False, [f"{call} raised {type(err).__name__}: {err} ({label})"]
        owners, problem = _as_owners(value, len(shapes), n)
        if problem:
            return False, [f"{call} {problem} ({label})"]
        got_all.append(owners)
    wrong = [k for k, ((_, s, n), got) in enumerate(zip(cs, got_all)) if got != assign_owners(s, n)]
    if not wrong:
        tiny = next((s, n) for label, s, n in cs if "tiny" in label and n == 4)
        big = cs[-1]
        lines = [f"assign_owners equals torch's ZeroRedundancyOptimizer's greedy partition "
                 f"(zerolab.wholematrix.muon_theory.assign_owners) on all {len(cs)} cases: hand-made ones for "
                 f"each usual mistake, 300 random ones, the course's GPT on 2-4 ranks, 7.5B on 64"]
        for label, shapes, n in ((f"GPT tiny, {tiny[1]} ranks", *tiny), (big[0], big[1], big[2])):
            loads = mt.loads(_numels(shapes), assign_owners(shapes, n), n)
            lines.append(f"{label}: the largest owner holds {max(loads):,} elements, "
                         f"{mt.imbalance(loads):.2f} x the mean (the owner layout pads every "
                         f"rank's piece to it: notebook 08b)")
        return True, lines
    label, shapes, n = cs[wrong[0]]
    got, want = got_all[wrong[0]], assign_owners(shapes, n)
    sizes = _numels(shapes)
    lines = [f"assign_owners({_short(shapes)}, {n}) returned {got if len(got) <= 12 else '...'}; "
             f"expected {want if len(want) <= 12 else '...'} ({label}: {len(wrong)} of "
             f"{len(cs)} cases differ)"]
    k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    lines.append(f"first difference: parameter {k} of shape {shapes[k]} ({sizes[k]:,} elements) "
                 f"on rank {got[k]}, expected rank {want[k]}; loads (elements per rank) "
                 f"{mt.loads(sizes, got, n)}, expected {mt.loads(sizes, want, n)}")
    everywhere = [why for why, rule in MISTAKES
                  if all(rule(s, m) == g for (_, s, m), g in zip(cs, got_all))]
    here = [why for why, rule in MISTAKES if rule(shapes, n) == got]
    if everywhere:
        lines.append(f"why: {everywhere[0]}")
    elif here:
        lines.append(f"perhaps (this case fits it, not every case): {here[0]}")
    return False, lines
