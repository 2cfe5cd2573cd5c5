"""Exercise (k): the owner of each whole matrix (zerolab.course.exercises.owners), no ranks.

The reference the check grades against (muon_theory.assign_owners) is held to torch's own
ZeroRedundancyOptimizer partition on torch's fake process group; a learner's correct solution
written without zerolab passes; each usual mistake (tests/exercise_solutions/wrong/
owner_assignment_*.py, plus the rules of owners.MISTAKES written in-process) fails with its own
diagnosis, and a wrong answer no rule explains still names the case, the owners and the loads.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from zerolab.course.exercises import EXERCISES, checker, owners

SOLUTIONS = Path(__file__).parent / "exercise_solutions"
WRONG = {   # file stem -> the diagnosis the check must give
    "list_order": "why: the parameters are taken in list order",
    "rows": "why: the size is the number of rows (shape[0])",
    "round_robin": "why: the ranks are dealt round-robin (i % world_size)",
    "ties_high": "why: a tie goes to the highest rank",
    "reverse_ties": "why: equal sizes are taken last first",
    "count": "why: the loads count parameters, not elements",
    "sorted_order": "why: the owners are listed in size order",
}


def check(impl):
    r = checker.run_check("owner_assignment", str(impl))
    assert "Traceback" not in r.text()
    return r


def test_reference_is_torchs_zero_redundancy_optimizer_partition():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zerolab.timing.whatif import fake_world
    rng = random.Random(1)
    tiny = owners._gpt_shapes("tiny")
    for n in (1, 2, 3, 5, 8):
        with fake_world(n):
            for k in range(6):
                shapes = tiny if k == 0 else [
                    tuple(rng.randint(1, 9) for _ in range(rng.choice((0, 1, 2, 3))))
                    for _ in range(rng.randint(1, 10))]
                ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
                zero = ZeroRedundancyOptimizer(ps, torch.optim.SGD, lr=0.1)
                index, theirs = {id(p): i for i, p in enumerate(ps)}, [None] * len(ps)
                for r, groups in enumerate(zero._partition_parameters()):
                    for g in groups:
                        for p in g["params"]:
                            theirs[index[id(p)]] = r
                assert owners.assign_owners(shapes, n) == theirs, (shapes, n)


def test_a_correct_solution_passes_and_the_blank_skeleton_fails_at_once():
    r = check(SOLUTIONS / "owner_assignment.py")
    assert r.ok and "all 311 cases" in r.lines[0], r.text()
    assert "7.5B GPT (36 x 4096) on 64 ranks: the largest owner holds 206,045,184" in r.text()
    r = check(EXERCISES["owner_assignment"].skeleton)
    assert not r.ok and "NotImplementedError (the blank skeleton)" in r.lines[0], r.text()


def test_each_usual_mistake_fails_with_its_diagnosis():
    for stem, why in WRONG.items():
        r = check(SOLUTIONS / "wrong" / f"owner_assignment_{stem}.py")
        assert not r.ok and r.diagnosed, (stem, r.text())
        assert r.lines[0].startswith("assign_owners(") and "expected" in r.lines[0], r.text()
        assert "first difference: parameter" in r.lines[1], r.text()
        assert r.lines[2].startswith(why), (stem, r.text())


def test_every_rule_of_mistakes_is_told_apart_in_process():
    """Each wrong rule differs from the reference somewhere and is named by its own diagnosis
    (no earlier rule explains it on every case); a wrong answer no rule explains, a wrong type
    and an exception are one line each, naming the case."""
    cases = owners.cases()
    for why, rule in owners.MISTAKES:
        ok, lines = owners.grade("owner_assignment", {"assign_owners": rule}, "x", 2, 10)
        assert not ok and lines[-1] == f"why: {why}", (why, lines)
        assert any(rule(s, n) != owners.assign_owners(s, n) for _, s, n in cases), why

    def off_by_one_rank(shapes, n):                 # right, but rank + 1 on the last parameter
        got = owners.assign_owners(shapes, n)
        got[-1] = (got[-1] + 1) % n
        return got
    ok, lines = owners.grade("owner_assignment", {"assign_owners": off_by_one_rank}, "x", 2, 10)
    assert not ok and "returned [0, 1, 0]; expected [0, 1, 1]" in lines[0], lines
    assert not any(line.startswith("why: ") for line in lines), lines
    for fn, says in ((lambda s, n: None, "returned None: expected a list of ranks"),
                     (lambda s, n: [n] * len(s), "names rank 2, outside 0..1"),
                     (lambda s, n: [0], "returned 1 ranks for 3 parameters"),
                     (lambda s, n: 1 / 0, "raised ZeroDivisionError")):
        ok, lines = owners.grade("owner_assignment", {"assign_owners": fn}, "x", 2, 10)
        assert not ok and len(lines) == 1 and says in lines[0], lines
