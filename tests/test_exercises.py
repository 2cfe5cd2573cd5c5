"""The exercise checker grades: the package's own functions, and other right solutions, pass
every exercise; each deliberately wrong solution (tests/exercise_broken/EXERCISE[_MISTAKE].py,
the usual mistakes of each exercise) fails with its own diagnosis (zerolab.course.exercises.
diagnose): the mistake, the learner's function and line, what to do - and no other exercise's
advice; the blank skeletons fail with a message, not a traceback, before any rank starts; a
learner's exception is reported with the rank and the line of the learner's file; hints come one
at a time (`exercises.hint`, `zerolab check --hint`). The checks themselves are those of
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
# every wrong solution in tests/exercise_broken/ (its file stem) -> the key phrase of its diagnosis
DIAGNOSES = {
    "shard_range": "the last rank's range stops at numel",      # clipped: not padded at the end
    "shard_range_floor": "not padded: numel // world_size",
    "shard_range_off_by_one": "off by one: stop is exclusive",
    "shard_range_overlap": "rank 0's range (0, 3) overlaps rank 1's",
    "shard_range_uneven": "unequal lengths [2, 2, 2, 4]",       # torch.chunk-like remainder
    "shard_range_length": "the second value is the length",
    "shard_range_float": "floats",
    "ddp": "unit.grad_flat holds the SUM of the 2 ranks' gradients",
    "ddp_div_outside": "changed unit.grad_flat after starting its all_reduce",
    "ddp_copy": "all_reduces a copy of unit.grad_flat",
    "ddp_no_return": "returned None: return the handle that comm.all_reduce",
    "ddp_max": "all_reduce(op='max')",
    "ddp_div_twice": "divided by world_size again",
    "zero1": "the weights did not change",                      # all_gather without the copy
    "zero1_copy_after": "changed unit.own(unit.param_flat) after starting its all_gather",
    "zero1_wrong_range": "returned rank 0's range",
    "zero1_no_float": "no fp32 conversion",
    "zero1_gather_master": "all_gathers straight from unit.master",
    "zero1_no_return": "returned None: return the handle that comm.all_gather",
    "zero2": "keeps unit.bucket (the full gradient)",            # never freed
    "zero2_overwrite": "overwrote unit.grad_shard",
    "zero2_no_divide": "received the SUM of the 2 ranks' chunks",
    "zero2_early": "before it had arrived",                     # add / free outside on_done
    "zero2_keep_grads": "the p.grad of unit.params are views of the bucket",
    "zero2_free_first": "passes None as the input of comm.reduce_scatter",
    "zero3": "left the 50,816 bytes of unit.param_flat allocated",   # never freed
    "zero3_no_alloc": "alloc_storage(unit.param_flat)",
    "zero3_wrong_buffer": "all_gathers from unit.own(unit.param_flat)",
    "zero3_free_shard": "freed unit.param_shard, this rank's only copy",
    "zero3_set_none": "replaced unit.param_flat with None",
}
# words of the other exercises' advice, never in an exercise's message (plus their functions)
FOREIGN = {"shard_range": ("on_done", "accumulate", "master", "grad_flat", "handle"),
           "ddp": ("accumulate", "grad_shard", "param_flat", "master"),
           "zero1": ("on_done", "accumulate", "grad_shard"),
           "zero2": ("param_flat", "master", "param_shard"),
           "zero3": ("on_done", "accumulate", "grad_shard", "bucket", "master")}
# right solutions other than zerolab's own, that the diagnoses must not flag
RIGHT = {
    "ddp": ("def all_reduce_bucket(comm, unit, world_size):\n"     # pre-divide, no on_done
            "    unit.grad_flat.div_(world_size)\n"
            "    return comm.all_reduce(unit.grad_flat, what='grads', unit=unit.name, "
            "async_op=True)\n"),
    "zero1": ("import torch\n\n\ndef own_gradient(unit):\n"
              "    return unit.grad_flat[unit.start:unit.start + unit.shard_numel]"
              ".to(torch.float32).clone()\n\n\n"
              "def publish_update(comm, unit):\n"
              "    unit.own(unit.param_flat).copy_(unit.master)\n"
              "    h = comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what='params', "
              "unit=unit.name, async_op=True)\n"
              "    h.wait()\n    return h\n"),
    "zero2": ("def reduce_scatter_bucket(comm, unit, world_size):\n"   # in place, own chunk
              "    mine, bucket = unit.own(unit.bucket), unit.bucket\n"
              "    handle = comm.reduce_scatter(mine, bucket, what='grads', unit=unit.name, "
              "async_op=True)\n\n"
              "    def done():\n"
              "        unit.grad_shard += mine / world_size\n"
              "        unit.bucket = None\n"
              "        for p in unit.params:\n            p.grad = None\n"
              "    handle.on_done = done\n    return handle\n"),
    "zero3": ("from zerolab.sharding import alloc_storage, free_storage\n\n\n"
              "def gather_params(comm, unit):\n"
              "    alloc_storage(unit.param_flat)\n"
              "    comm.all_gather(unit.param_flat, unit.param_shard, what='params', "
              "unit=unit.name, async_op=True).wait()\n\n\n"
              "def free_params(unit):\n    free_storage(unit.param_flat)\n"),
}
FILL_INS = [n for n, e in EXERCISES.items() if not e.grader]   # (f)-(j): test_exercises_more.py


@pytest.mark.timeout(180)
def test_package_code_and_other_right_solutions_pass_every_exercise(tmp_path):
    right = []
    for name, source in RIGHT.items():
        (tmp_path / f"right_{name}.py").write_text(source)
        right.append((name, str(tmp_path / f"right_{name}.py")))
    results = checker.run_checks([(name, EXERCISES[name].module) for name in FILL_INS] + right,
                                 nproc=3)
    for r in results:
        assert r.ok, r.text()
        assert "equals single-process torch AdamW" in r.lines[0]


def _exercise_of(stem: str) -> str:
    return "shard_range" if stem.startswith("shard_range") else stem.split("_")[0]


@pytest.mark.timeout(240)
def test_each_wrong_solution_gets_its_own_diagnosis():
    """One group of 2 ranks grades every wrong solution (the ones diagnosed without ranks -
    shard_range, own_gradient - never start one): each fails with its own message, naming the
    learner's function (and line), with none of another exercise's advice."""
    files = sorted(BROKEN.glob("*.py"))
    assert {f.stem for f in files} == set(DIAGNOSES)
    results = checker.run_checks([(_exercise_of(f.stem), str(f)) for f in files], nproc=2)
    for f, r in zip(files, results):
        name, text = _exercise_of(f.stem), r.text()
        assert not r.ok and r.diagnosed, text
        assert DIAGNOSES[f.stem] in text, text
        assert "Traceback" not in text and "usual mistakes" not in text, text
        assert f"zerolab check {name} --hint" in text           # the way to a hint
        body = "\n".join(line for line in r.lines if not line.startswith("step "))
        others = [fn for other in FILL_INS if other != name for fn in EXERCISES[other].functions]
        for word in [*others, *FOREIGN[name]]:
            assert word not in body, (f.stem, word, text)
        if name != "shard_range" and f.stem != "zero1_no_float" and f.stem != "zero1_wrong_range":
            assert any(f": your {fn}: " in text for fn in EXERCISES[name].functions), text
    by_stem = {f.stem: r.text() for f, r in zip(files, results)}
    # where in the learner's code: the file and line of the collective
    assert "(ddp_div_outside.py line 4)" in by_stem["ddp_div_outside"]
    assert "(zero1_copy_after.py line 7)" in by_stem["zero1_copy_after"]
    # the failing ranks, step and parameter are still named, with expected vs got values; a
    # weight that kept its old value says so
    zero1 = by_stem["zero1"]
    assert "step 1 of 3" in zero1 and "ranks 0, 1: parameters: parameter " in zero1
    assert "expected" in zero1 and "still holds its value from before this step" in zero1
    # the rank-free diagnoses show the case: every rank's range, got and expected
    assert ("shard_range(numel=10, world_size=4) for ranks 0-3 returned (0, 3) (3, 6) (6, 9) "
            "(9, 10); expected (0, 3) (3, 6) (6, 9) (9, 12)") in by_stem["shard_range"]


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



def test_hints_come_one_at_a_time_from_a_nudge_to_almost_the_code(capsys):
    from zerolab.course.exercises import hint, hints
    for name in FILL_INS:                                   # (a)-(e): at least 3 each
        steps = hints.steps(name)
        assert len(steps) >= 3 and len(set(steps)) == len(steps), name
        assert len(steps[0]) <= len(steps[-1]) * 1.5        # a nudge first, not the code
        for k in range(1, len(steps) + 1):
            hint(name, k)
            out = capsys.readouterr().out
            assert f"hint {k} of {len(steps)}" in out and steps[k - 1] in out
            assert ("that was the last hint" in out) == (k == len(steps)), out
    hint("ddp")                                             # k defaults to 1
    assert "hint 1 of 4" in capsys.readouterr().out
    assert "comm.all_reduce(unit.grad_flat" in hints.steps("ddp")[-1]   # almost the code
    for bad in (0, 5, "two", None):
        with pytest.raises(ValueError, match=r"hint .* is not one of 1-4 for ddp"):
            hint("ddp", bad)
    with pytest.raises(ValueError, match="exercise 'zero4' is not one of"):
        hint("zero4")


def test_hint_command_line(capsys):
    from zerolab.cli.commands import main
    assert main(["check", "zero2", "--hint"]) == 0
    out = capsys.readouterr().out
    assert "hint 1 of 4" in out and "next: zerolab check zero2 --hint 2" in out
    assert main(["check", "zero2", "--hint", "4"]) == 0
    assert "hint 4 of 4" in capsys.readouterr().out
    assert main(["check", "--hint"]) == 2
    assert "--hint needs an exercise" in capsys.readouterr().err
    # a bad number: exit code 2 and one line that names the value and the accepted range
    for bad in ("7", "0", "x"):
        assert main(["check", "zero3", "--hint", bad]) == 2
        out, err = capsys.readouterr()
        value = repr(bad) if bad == "x" else bad
        assert out == "" and err.splitlines() == [
            f"zerolab check: error: hint {value} is not one of 1-4 for zero3 (1 is a nudge, 4 "
            f"almost the code)"], err
