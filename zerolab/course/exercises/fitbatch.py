"""Exercise (l): the largest micro-batch that fits a device, at each stage, graded with a
diagnosis per likely mistake.

Idea: the learner gets the parts of one rank's peak - the model states (the formula), the fp32
gradient copies of the optimizer step, ZeRO-3's gathered blocks, the buckets and reduce_scatter
outputs, and per row the activations and the backward's temporaries - and assembles them into
the largest rows per rank B that fit `BUDGET` bytes. The right answer is `zerolab fit`'s
(`run.fit.largest_rows`: the step simulated on the meta device at every B it tries). A wrong
answer is compared with the answers that the usual mistakes give, each computed from the same
parts, and the nearest one within its tolerance is named.

    from zerolab.course.exercises import fitbatch
    fitbatch.show_parts()            # the scenario and its parts, per stage
    fitbatch.answer(3, 40)           # right, or which mistake gives 40
    fitbatch.reveal(3)

Scenario: the "small" preset (Ψ ≈ 2.7M) at s = 16 tokens on N = 4 ranks in bf16, 0.2 GB per
rank: a small model on a small budget, so that `zerolab fit` answers in seconds on a laptop,
with rows cheap enough that each mistake gives its own B; the arithmetic is the same for gpt2
on a 24 GB GPU.
"""
from __future__ import annotations

import functools
import math

PRESET, WORLD, BUDGET = "small", 4, 0.2e9
SEQ = 16
ARGV = ["--preset", PRESET, "--block-size", str(SEQ), "--nproc", str(WORLD), "--steps", "2",
        "--batch-size", str(WORLD)]


def _args():
    from ...run import fitreport
    from ..fitcheck import fit_args
    args = fit_args(ARGV)
    fitreport.check_args(args)
    return args


@functools.lru_cache(maxsize=None)
def parts(stage: int) -> dict:
    """The parts of stage `stage`'s peak, bytes: states, fp32_copies (the optimizer step's),
    gathered (ZeRO-3's blocks at their peak), buckets (the rest of the backward's fixed bytes:
    gradient buckets and reduce_scatter outputs, minus the gathered bytes already freed at the
    backward's peak, so it can be below 0), act_per_row (what the forward keeps), temp_per_row
    (the backward's temporaries at its peak), eq1_per_row (what Korthikanti et al.'s eq. 1 adds
    per row), largest (zerolab fit's answer, simulated)."""
    from ...run import fit
    from ..fitanchors import counted_per_layer, korthikanti
    from ...model import get_config
    args = _args()
    target = fit.target_of(args)
    lo, hi = 128, 256                               # the backward sets the peak here: linear
    one, two = (fit.simulate(args, stage, WORLD, r, target) for r in (lo, hi))
    slope = (two["peak"] - one["peak"]) // (hi - lo)
    fixed = two["peak"] - hi * slope                # the backward's peak at 0 rows
    act = (two["activations"] - one["activations"]) // (hi - lo)
    largest = _rows(BUDGET - fixed, slope)          # checked by simulating it and one row more
    if not (fit.simulate(args, stage, WORLD, largest, target)["peak"] <= BUDGET
            < fit.simulate(args, stage, WORLD, largest + 1, target)["peak"]):
        largest = fit.largest_rows(args, stage, WORLD, BUDGET, target)[0]
    t = two["transients"]
    gathered, copies = t["gathered_params"], t["grad_fp32"]
    cfg = get_config(PRESET, block_size=SEQ)
    return {"states": int(two["model_states_total"]), "fp32_copies": copies,
            "gathered": gathered, "buckets": int(fixed - two["model_states_total"] - gathered),
            "act_per_row": act, "temp_per_row": slope - act,
            "eq1_per_row": cfg.n_layer * (korthikanti(cfg, 1)
                                          - counted_per_layer(PRESET, 1, SEQ)),
            "largest": largest}


def _rows(room: float, per_row: float) -> int:
    return max(0, math.floor(room / per_row))


def mistakes(stage: int) -> dict[str, int]:
    """{diagnosis: the B that mistake gives}, from the same parts."""
    p = parts(stage)
    per = p["act_per_row"] + p["temp_per_row"]
    fixed = p["states"] + p["gathered"] + p["buckets"]
    out = {
        "you counted the activations the forward keeps but not the backward's temporaries (the "
        "gradient of each activation lives beside them at the backward's peak)":
            _rows(BUDGET - fixed, p["act_per_row"]),
        "you added the fp32 gradient copies to the backward's peak: they exist only inside the "
        "optimizer step, when the activations are gone (counted twice, the gradients cost "
        "their bytes again)": _rows(BUDGET - fixed - p["fp32_copies"], per),
        "you used Korthikanti et al.'s eq. 1 as printed: its 5·a·s/h term is the s x s attention "
        "scores, which a flash attention kernel never keeps": _rows(BUDGET - fixed,
                                                                   per + p["eq1_per_row"]),
    }
    if p["gathered"]:
        out["you left out ZeRO-3's gathered blocks: the block that computes and the one "
            "prefetched are whole on every rank during forward and backward"] = _rows(
                BUDGET - fixed + p["gathered"], per)
    return out


def assembled(stage: int) -> int:
    """The B the parts give: floor((BUDGET - states - gathered - buckets) / per row)."""
    p = parts(stage)
    return _rows(BUDGET - p["states"] - p["gathered"] - p["buckets"],
                 p["act_per_row"] + p["temp_per_row"])


def diagnose(stage: int, value) -> tuple[bool, str]:
    """(right, the line to print) for the learner's B at `stage`."""
    from ... import theory
    name = theory.STAGE_NAMES[stage]
    if value is None:
        return False, f"{name}: write your B (rows per rank) in place of None"
    p = parts(stage)
    right = {p["largest"], assembled(stage)}       # the simulation's, the parts' (one apart at most)
    if value in right:
        return True, (f"{name}: right, B = {value} rows per rank fit in {BUDGET / 1e9:g} GB "
                      f"(zerolab fit: {p['largest']})")
    for why, b in mistakes(stage).items():
        if b not in right and value == b:
            return False, f"{name}: not {value}: {why}"
    right = max(right)
    if value > right:
        per = p["act_per_row"] + p["temp_per_row"]
        if value * per + p["states"] < BUDGET and value > 2 * right:
            return False, (f"{name}: not {value}: the activations are missing; each row keeps "
                           "bytes from the forward to the backward")
        return False, f"{name}: not {value}: too many rows; some part of the peak is missing"
    return False, f"{name}: not {value}: too few rows; a part is counted that is not there then"


def answer(stage: int, value) -> bool:
    """Print whether `value` is the largest B at `stage`, or which mistake gives it."""
    ok, line = diagnose(stage, value)
    print(line)
    return ok


def reveal(stage: int) -> int:
    """Print and return the answer with how it is assembled."""
    from ... import theory
    p = parts(stage)
    per = p["act_per_row"] + p["temp_per_row"]
    fixed = p["states"] + p["gathered"] + p["buckets"]
    print(f"{theory.STAGE_NAMES[stage]}: B = floor(({BUDGET:,.0f} - {fixed:,.0f}) / {per:,.0f}) "
          f"= {_rows(BUDGET - fixed, per)}; zerolab fit's simulation says {p['largest']} "
          f"(the optimizer step's {p['states'] + p['fp32_copies']:,.0f} bytes fit without rows)")
    return p["largest"]


def show_parts():
    """Print the scenario and its parts per stage (what the learner assembles)."""
    from ... import theory
    print(f"{PRESET} on N = {WORLD} ranks, bf16, {BUDGET / 1e9:g} GB per rank; bytes per rank")
    head = ("stage", "states", "fp32 copies", "gathered", "rest", "act/row", "temp/row")
    print("".join(f"{h:>14}" for h in head))
    for s in range(4):
        p = parts(s)
        print(f"{theory.STAGE_NAMES[s]:>14}" + "".join(
            f"{p[k]:>14,}" for k in ("states", "fp32_copies", "gathered", "buckets",
                                     "act_per_row", "temp_per_row")))
