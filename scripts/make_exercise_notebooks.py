"""Write notebooks/exercises/*.ipynb from the package: one notebook per coding exercise (its
%%writefile cell is the skeleton in zerolab/course/exercises/skeletons/, byte for byte) and the
"predict, then measure" notebook (its questions are zerolab.course.exercises.answers.QUESTIONS).

    python scripts/make_exercise_notebooks.py && python scripts/nb_policy.py notebooks/exercises/*.ipynb

Rerun it after changing a skeleton, a hint or a question (tests/test_exercises.py checks that
the notebooks' skeletons equal the package's).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from zerolab.course.exercises import EXERCISES  # noqa: E402
from zerolab.course.exercises.answers import QUESTIONS  # noqa: E402

OUT = ROOT / "notebooks" / "exercises"

# per exercise: (file stem, stage notebook that explains it, minutes for a first-time learner,
# the package code that calls the learner's function, what to read first, what "pass" proves)
PLAN = {
    "shard_range": ("a_shard_range", "05_zero1", 10, ["zerolab.sharding.FlatUnit.__init__"],
                    "Every flat bucket of Ψ_u elements is cut into N equal, contiguous ranges; "
                    "when N does not divide Ψ_u, zeros pad the bucket up to a multiple of N. "
                    "`FlatUnit` asks your function where rank r's range starts and stops.",
                    "every (numel, N, rank) up to N = 8 gives the right range, and ZeRO-3 on an "
                    "odd-sized model (vocab 1001, a 3-element bias) trains exactly like one "
                    "process with your ranges."),
    "ddp": ("b_ddp", "04_ddp", 10, ["zerolab.sharding.on_grads_ready", "zerolab.ddp.DDP._grads_ready"],
            "DDP does not wait for the end of backward: as soon as the last gradient of a bucket "
            "is accumulated, a hook starts the bucket's all_reduce, which then overlaps the "
            "backward of the earlier layers.",
            "after every step every rank's parameters equal single-process AdamW on the global "
            "batch, the gradient norm is the global batch's, one all_reduce per bucket ran "
            "during backward, and each rank sent 2(n-1)/n × 4Ψ bytes (fp32)."),
    "zero1": ("c_zero1", "05_zero1", 15, ["zerolab.zero1.ZeRO1.step"],
              "ZeRO-1 keeps DDP's forward and backward; only the update changes: each rank "
              "updates the master weights of its own range, writes them into its weights, and "
              "an all_gather brings every rank's updated range to everyone.",
              "the parameters equal the reference after every step, each rank holds 4Ψ + 12Ψ/N "
              "bytes (fp32 here: 8Ψ + 12Ψ/N) and sent all_reduce + all_gather bytes."),
    "zero2": ("d_zero2", "06_zero2", 20, ["zerolab.zero2.ZeRO2._open_bucket",
                                          "zerolab.zero2.ZeRO2._grads_ready"],
              "ZeRO-2 keeps only its own range of the averaged gradient. A block's full local "
              "gradient lives in a bucket just long enough: reduce_scatter it as soon as it is "
              "ready, keep your chunk, free the bucket.",
              "the parameters equal the reference with 2 micro-steps per step (your shard "
              "accumulates), no full-gradient bucket survives a backward, and the bytes held "
              "and sent equal 2Ψ + 14Ψ/N and 2(n-1)/n·2Ψ (bf16; fp32 doubles the 2s)."),
    "zero3": ("e_zero3", "07_zero3", 15, ["zerolab.zero3.ZeRO3._gather", "zerolab.zero3.ZeRO3._free"],
              "ZeRO-3 keeps only its own range of the weights too. Just before a block runs "
              "(forward, and again backward) its full weights are all-gathered into a buffer; "
              "right after, the buffer's memory is released.",
              "the parameters equal the reference, no block stays gathered after its forward "
              "or after the step, each rank holds 16Ψ/N (fp32: 20Ψ/N) and sent 3(n-1)/n·2Ψ "
              "bytes a step."),
}


def exercise_notebook(name: str) -> nbformat.NotebookNode:
    ex = EXERCISES[name]
    stem, stage_nb, minutes, callers, idea, proves = PLAN[name]
    fns = ", ".join(f"`{f}`" for f in ex.functions)
    cells = [
        new_markdown_cell(
            f"# Exercise ({ex.letter}): {ex.title}\n\n"
            f"**You write** {fns} (about {minutes} minutes). **Read first**: "
            f"`notebooks/{stage_nb}.ipynb`.\n\n{idea}\n\n"
            f"**How it is checked**: the check cell starts 3 gloo ranks, puts your function in "
            f"place of zerolab's own inside the real strategy, trains a small GPT for 3 steps "
            f"and compares with single-process torch AdamW and with the formulas of "
            f"`zerolab.theory`, the same checks zerolab's own tests use. From a terminal: "
            f"`zerolab check {name} --impl notebooks/exercises/my_{name}.py`."),
        new_markdown_cell("## Where your function is called\n\nzerolab's own code, as it runs "
                          "in the check (your function replaces the one it calls):"),
        new_code_cell("import zerolab.ddp, zerolab.sharding, zerolab.zero1, zerolab.zero2, zerolab.zero3\n"
                      "from zerolab import nb\nfrom zerolab.course import exercises\n\n"
                      + "\n".join(f"nb.show({c})" for c in callers)),
        new_markdown_cell("## Your code\n\nFill in the body, run the cell (it writes "
                          f"`my_{name}.py` next to this notebook), then run the check below."),
        new_code_cell(f"%%writefile my_{name}.py\n" + ex.skeleton.read_text()),
        new_markdown_cell("## Check\n\n`PASS` means: " + proves + " `FAIL` names the first "
                          "step, rank and parameter (or byte count) that differs; the blank "
                          "skeleton fails at once."),
        new_code_cell(f'result = exercises.exercise("{name}", "my_{name}.py")'),
        new_markdown_cell("## Stuck, or done?\n\nzerolab's own version is the reference "
                          "solution. Uncomment and run when you have passed, or after a real "
                          "try:"),
        new_code_cell("\n".join(f"# nb.show({ex.module}.{f})" for f in ex.functions)),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return nb


def predict_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Predict, then measure\n\nEach question asks for a number. Write your prediction "
            "in place of `None` and run the cell: `answer` says whether it is right (with a hint "
            "if not; `reveal(id)` gives the answer and how it is computed). The last questions "
            "are then measured on 2 gloo ranks, so you see your number appear in a real run.\n\n"
            "Question ids name the notebook they come from (`02.3` is about "
            "`notebooks/02_memory.ipynb`; `pm` = this notebook's measurement)."),
        new_code_cell("from zerolab import nb\nfrom zerolab.course import checks\n"
                      "from zerolab.course.exercises import answer, reveal"),
    ]
    for qid, q in QUESTIONS.items():
        cells.append(new_markdown_cell(f"**{qid}.** {q.text}" + (f" ({q.unit})" if q.unit else "")))
        cells.append(new_code_cell(f'answer("{qid}", None)   # your prediction instead of None'))
        if qid == "07.1":
            cells.append(new_markdown_cell(
                "## Measure\n\nGPT nano on 2 gloo ranks in bf16, DDP and ZeRO-3, 2 steps (about "
                "10 s). Predict pm.1 - pm.3 first, then run the measurement below."))
    cells += [
        new_code_cell('runs = nb.launch(stages="0,3", nproc=2, preset="nano", steps=2, '
                      'backend="gloo", device="cpu", out="runs/predict_then_measure")'),
        new_code_cell("traffic = {row['stage']: sum(row['measured'].values()) "
                      "for row in checks.traffic_rows(runs)}\n"
                      "held = {row['stage']: sum(row['measured'].values()) "
                      "for row in checks.memory_rows(runs) if row['rank'] == 0}\n"
                      "for qid, measured in ((\"pm.1\", traffic[0]), (\"pm.2\", traffic[3]), "
                      "(\"pm.3\", held[3])):\n"
                      "    print(f\"{qid}: measured {measured:,.0f} bytes\")\n"
                      "    assert answer(qid, measured)    # the measurement equals the answer"),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return nb


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name in EXERCISES:
        nbformat.write(exercise_notebook(name), OUT / f"{PLAN[name][0]}.ipynb")
    nbformat.write(predict_notebook(), OUT / "predict_then_measure.ipynb")
    print(f"wrote {len(EXERCISES) + 1} notebooks to {OUT}")


if __name__ == "__main__":
    main()
