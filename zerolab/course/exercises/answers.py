"""Numeric "predict, then measure" questions: the learner writes a number, a function grades it.

Every answer is computed here from `zerolab.theory` (never typed in), so a question and the
formula it tests cannot drift apart. `answer(qid, value)` prints whether the value is right
(within the question's tolerance) and, when it is not, a hint that does not give it away;
`reveal(qid)` prints the answer and how it is computed.

    from zerolab.course.exercises import answer, reveal
    answer("02.3", 14)          # -> right: ...
    reveal("02.3")

Question ids: "NN.k" = notebook NN's k-th question; "pp.k" = a disagreement of `zerolab papers`
(site/papers.md); "pm.k" = notebooks/exercises/predict_then_measure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ... import theory
from ...variants import tiers


@dataclass(frozen=True)
class Question:
    text: str
    compute: Callable[[], float]   # the answer, from theory
    how: str                       # how it is computed (shown by reveal)
    unit: str = ""
    rel: float = 0.01              # accepted relative error (0: exact integer)


def _hsdp_cross_host(w: int, g: int) -> float:
    """HSDP's cross-host bytes per GPU a step in M (the gradient bytes): the ledger's ring."""
    return tiers.hybrid_traffic_bytes(1.0, w, g, "hsdp")["inter"]["all_reduce"] / 2


def _pm_psi_padded(stage_n=2) -> int:
    from ..checks import padded_psi
    return padded_psi("nano", stage_n)


QUESTIONS: dict[str, Question] = {
    "02.1": Question("Bytes per parameter for AdamW with bf16 mixed precision under DDP "
                     "(weights, gradients, master weights, exp_avg, exp_avg_sq)?",
                     lambda: sum(theory.bytes_per_param("bf16").values()),
                     "2 + 2 + 4 + 4 + 4 (theory.bytes_per_param)", "bytes", 0),
    "02.2": Question("Per-rank model states of ZeRO-1, Ψ = 7.5e9, N = 64, in GB (1e9 bytes)?",
                     lambda: theory.model_state_total(7.5e9, 64, 1) / 1e9,
                     "4Ψ + 12Ψ/N = 30e9 + 90e9/64 bytes (theory.model_state_total)", "GB"),
    "02.3": Question("Smallest N at which a 70B-parameter model's ZeRO-3 model states fit in 80 GB "
                     "per rank?",
                     lambda: math.ceil(16 * 70e9 / 80e9),
                     "16Ψ/N <= 80e9  ->  N >= 16 × 70e9 / 80e9 = 14", "ranks", 0),
    "02.4": Question("ZeRO-2 at N = 8: model-state bytes per parameter per rank?",
                     lambda: theory.model_state_total(1.0, 8, 2),
                     "2 + (2 + 12)/8 = 3.75 (theory.model_state_total with Ψ = 1)", "bytes"),
    "03.1": Question("A ring all_reduce of a 1 GB array on 8 ranks: bytes each rank sends, in GB?",
                     lambda: theory.RING_FACTOR["all_reduce"](8) * 1.0,
                     "2(n-1)/n × S = 2 × 7/8 × 1 GB (theory.RING_FACTOR)", "GB"),
    "03.2": Question("The same 1 GB array, reduce_scatter on 8 ranks: bytes each rank sends, in GB?",
                     lambda: theory.RING_FACTOR["reduce_scatter"](8) * 1.0,
                     "(n-1)/n × S = 7/8 × 1 GB", "GB"),
    "07.1": Question("ZeRO-3's bytes sent per step divided by DDP's (same Ψ, same N)?",
                     lambda: sum(theory.traffic_bytes(1e9, 8, 3).values())
                     / sum(theory.traffic_bytes(1e9, 8, 0).values()),
                     "3(n-1)/n·2Ψ / (2(n-1)/n·2Ψ) = 1.5 (theory.traffic_bytes)", "x"),
    "pp.1": Question("The FSDP paper puts hybrid sharding's cross-host traffic at 2M(W-1)/(GW) per "
                     "GPU (M: the gradient bytes); zerolab's ledger measures less (`zerolab papers` "
                     "shows both: look after you answer). W = 8 GPUs in hosts of G = 4: each "
                     "GPU's 1/G shard is "
                     "all-reduced by a ring through the W/G hosts. Predict the ledger's bytes per "
                     "GPU, in M",
                     lambda: _hsdp_cross_host(8, 4),
                     "a ring of W/G ranks all-reduces M/G bytes: 2(W/G-1)/(W/G)·M/G = 2M(W-G)/(GW) "
                     "= 0.25M (tiers.hybrid_traffic_bytes); the paper's W-1 should be W-G", "M"),
    "pp.2": Question("The same at W = 64, G = 8: the paper's formula divided by the ledger's?",
                     lambda: 2 * 63 / (8 * 64) / _hsdp_cross_host(64, 8),
                     "(W-1)/(W-G) = 63/56: the paper's formula and the ring meet as W/G grows",
                     "x"),
    "pm.1": Question("GPT nano, 2 gloo ranks, bf16: bytes ONE rank sends in one DDP step (the "
                     "gradients' all_reduce), at the padded Ψ?",
                     lambda: sum(theory.traffic_bytes(_pm_psi_padded(), 2, 0).values()),
                     "2(n-1)/n × 2 bytes × Ψ_padded, n = 2 (theory.traffic_bytes; "
                     "checks.padded_psi('nano', 2))", "bytes"),
    "pm.2": Question("The same run under ZeRO-3: bytes one rank sends per step?",
                     lambda: sum(theory.traffic_bytes(_pm_psi_padded(), 2, 3).values()),
                     "3(n-1)/n × 2 bytes × Ψ_padded: two all_gathers and one reduce_scatter",
                     "bytes"),
    "pm.3": Question("The same run under ZeRO-3: model-state bytes one rank holds after a step?",
                     lambda: theory.model_state_total(_pm_psi_padded(), 2, 3),
                     "16Ψ_padded / N (theory.model_state_total)", "bytes"),
}


def _question(qid: str) -> Question:
    if qid not in QUESTIONS:
        raise ValueError(f"question {qid!r} is not one of {', '.join(QUESTIONS)}")
    return QUESTIONS[qid]


def is_right(qid: str, value: float) -> bool:
    """True when `value` equals question `qid`'s answer within its tolerance."""
    q, want = _question(qid), _question(qid).compute()
    if q.rel == 0:
        return value == want
    return abs(value - want) <= q.rel * abs(want)


def answer(qid: str, value) -> bool:
    """Print whether `value` answers question `qid` (see QUESTIONS) and return it as a bool.
    A wrong answer gets a hint (too high / too low, off by a factor), never the answer."""
    q = _question(qid)
    try:
        value = float(value)
    except (TypeError, ValueError):
        print(f"{qid}: {value!r} is not a number; answer with a number ({q.unit or 'no unit'})")
        return False
    if is_right(qid, value):
        print(f"{qid}: right ({value:g} {q.unit}). {q.how}")
        return True
    want = q.compute()
    ratio = value / want if want else float("inf")
    hint = "too high" if value > want else "too low"
    if want and value and any(abs(ratio - f) < 0.02 or abs(1 / ratio - f) < 0.02
                              for f in (2, 4, 8, 16, 64)):
        hint += f", by a factor of {max(ratio, 1 / ratio):.3g}: a factor N, 2 bytes or 2(n-1)/n?"
    print(f"{qid}: not yet: {value:g} {q.unit} is {hint}. Question: {q.text} "
          f"(reveal({qid!r}) shows the answer)")
    return False


def reveal(qid: str) -> float:
    """Print and return question `qid`'s answer with how it is computed."""
    q = _question(qid)
    want = q.compute()
    print(f"{qid}: {q.text}\n  answer: {want:,.6g} {q.unit} = {q.how}")
    return want
