"""The exercise checker grades: the package's own functions pass every exercise; one deliberately
broken variant per exercise (tests/exercise_broken/) fails, naming the right check; the blank
skeletons fail with a message, not a traceback, before any rank starts; a learner's exception is
reported with the rank and the line of the learner's file. The checks themselves are those of
test_equivalence / test_measure (zerolab.course.testing.reference, theory's formulas)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerolab.course.exercises import EXERCISES, checker

BROKEN = Path(__file__).parent / "exercise_broken"
ROOT = Path(__file__).parent.parent
# what each broken variant gets wrong, and the check that must catch it
BROKEN_KIND = {"shard_range": "returned (1, 1); expected (1, 2)",
               "ddp": "gradient norm",          # summed, not averaged: the norm is N x
               "zero1": "parameters",           # the update never reaches the weights
               "zero2": "bucket of",            # the full-gradient bucket is never freed
               "zero3": "still gathered"}       # the gathered block is never freed


@pytest.mark.timeout(180)
def test_package_code_passes_every_exercise():
    results = checker.run_checks([(name, ex.module) for name, ex in EXERCISES.items()], nproc=3)
    for r in results:
        assert r.ok, r.text()
        assert "equals single-process torch AdamW" in r.lines[0]


@pytest.mark.timeout(180)
def test_broken_variant_of_each_exercise_fails_on_the_right_check():
    results = checker.run_checks([(name, str(BROKEN / f"{name}.py")) for name in EXERCISES],
                                 nproc=3)
    for name, r in zip(EXERCISES, results):
        assert not r.ok, name
        text = r.text()
        assert BROKEN_KIND[name] in text, text
        assert "Traceback" not in text
    # the failing rank, step and parameter are named, with expected vs got values
    zero1 = results[list(EXERCISES).index("zero1")].text()
    assert "step 1 of 3" in zero1 and "ranks 0, 1, 2: parameters: parameter " in zero1
    assert "expected" in zero1


@pytest.mark.timeout(120)
def test_blank_skeletons_fail_with_a_message_before_any_rank_starts():
    for name, ex in EXERCISES.items():
        r = checker.run_check(name, str(ex.skeleton))
        assert not r.ok and r.seconds < 5, name
        assert "NotImplementedError (the blank skeleton)" in r.lines[0], r.text()
        for f in ex.functions:
            assert f in r.lines[0]
    # the command line: exit code 1, the message, no traceback
    out = subprocess.run([sys.executable, "-m", "zerolab", "check", "zero3", "--impl",
                          str(EXERCISES["zero3"].skeleton)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 1, out
    assert "FAIL" in out.stdout and "gather_params and free_params" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_missing_file_function_or_argument_is_one_line(tmp_path):
    r = checker.run_check("ddp", str(tmp_path / "nope.py"))
    assert not r.ok and "no such file" in r.lines[0]
    wrong = tmp_path / "my_ddp.py"
    wrong.write_text("def all_reduce_bucket(comm, unit):\n    return None\n")
    assert "keep the skeleton's arguments" in checker.run_check("ddp", str(wrong)).lines[0]
    wrong.write_text("def all_reduce(comm, unit, n):\n    return None\n")
    assert "defines no function all_reduce_bucket" in checker.run_check("ddp", str(wrong)).lines[0]
    wrong.write_text("def all_reduce_bucket(comm, unit, n)\n    return None\n")
    assert "line 1: SyntaxError" in checker.run_check("ddp", str(wrong)).lines[0]
    with pytest.raises(ValueError, match="nproc 5 must be 2, 3 or 4"):
        checker.run_check("ddp", str(wrong), nproc=5)
    with pytest.raises(ValueError, match="exercise 'zero4' is not one of"):
        checker.run_check("zero4", str(wrong))


@pytest.mark.timeout(120)
def test_an_exception_in_the_learners_code_names_rank_file_and_line(tmp_path):
    impl = tmp_path / "my_ddp.py"
    impl.write_text("def all_reduce_bucket(comm, unit, world_size):\n"
                    "    return comm.all_reduce(unit.grad, what='grads', async_op=True)\n")
    r = checker.run_check("ddp", str(impl), nproc=2, timeout=60)
    assert not r.ok
    assert r.lines[0].startswith("rank ") and "your all_reduce_bucket (my_ddp.py line 2)" \
        in r.lines[0] and "AttributeError" in r.lines[0], r.text()


def test_exercise_notebooks_start_from_the_package_skeletons():
    """Each notebook's %%writefile cell is the skeleton file, byte for byte (one source)."""
    seen = set()
    for path in sorted((ROOT / "notebooks" / "exercises").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] == "code" and src.startswith("%%writefile my_"):
                first, _, body = src.partition("\n")
                name = first.split("my_")[1].removesuffix(".py")
                assert body == EXERCISES[name].skeleton.read_text(), (path.name, name)
                seen.add(name)
    assert seen == set(EXERCISES)


def test_numeric_answers_are_graded_against_theory(capsys):
    from zerolab.course.exercises import answer, reveal
    from zerolab.course.exercises.answers import QUESTIONS
    for qid, q in QUESTIONS.items():
        want = reveal(qid)
        assert answer(qid, want)
        assert not answer(qid, want * 1.1 + 1)              # 10 % off is not right
    out = capsys.readouterr().out
    assert "not yet" in out and "reveal(" in out
    assert answer("02.3", 14) and not answer("02.3", 13)    # 16 × 70e9 / 80e9 = 14 ranks
    assert not answer("02.1", None)
    assert "is not a number" in capsys.readouterr().out
    with pytest.raises(ValueError, match="question '99.9' is not one of"):
        answer("99.9", 1)

