"""Write notebooks/exercises/*.ipynb from the package: one notebook per coding exercise, (a)-(e)
and (f)-(j) with the optional track (its %%writefile cell is the skeleton in
zerolab/course/exercises/skeletons/, byte for byte) and the
"predict, then measure" notebook (its questions are zerolab.course.exercises.answers.QUESTIONS).

    python scripts/make_exercise_notebooks.py && python scripts/nb_policy.py notebooks/exercises/*.ipynb

Rerun it after changing a skeleton, a hint or a question (tests/test_exercises.py checks that
the notebooks' skeletons equal the package's).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from zerolab.course.exercises import EXERCISES  # noqa: E402
from zerolab.course.exercises.answers import QUESTIONS  # noqa: E402

OUT = ROOT / "notebooks" / "exercises"
# every exercise notebook links the course's one table of symbols
SYMBOLS = "The symbols (Ψ, N, n, S, α, β, ...) are defined in the [symbols](../glossary.md#symbols) table."

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
    "zero1": ("c_zero1", "05_zero1", 15, ["zerolab.zero1.ZeRO1.update",
                                          "zerolab.zero1.ZeRO1.publish"],
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
              "accumulates), and no full-gradient bucket survives a backward. The bytes held "
              "and sent equal the formulas for the precision the checker runs, fp32: 4Ψ + "
              "16Ψ/N held and 2(n-1)/n·4Ψ sent. (In the notes' bf16 the same formulas read "
              "2Ψ + 14Ψ/N and 2(n-1)/n·2Ψ.)"),
    "zero3": ("e_zero3", "07_zero3", 15, ["zerolab.zero3.ZeRO3._gather",
                                          "zerolab.zero3.ZeRO3._start_gather",
                                          "zerolab.zero3.ZeRO3._free"],
              "ZeRO-3 keeps only its own range of the weights too. Just before a block runs "
              "(forward, and again backward) its full weights are all-gathered into a buffer; "
              "right after, the buffer's memory is released.",
              "the parameters equal the reference, no block stays gathered after its forward "
              "or after the step, each rank holds 16Ψ/N (fp32: 20Ψ/N) and sent 3(n-1)/n·2Ψ "
              "bytes a step."),
}


# exercises (f)-(j), graded by their own module (`Exercise.grader`): file stem, what to read first,
# minutes, the zerolab code to show before (what the prediction is about, or the loop that drives
# the learner's class), the idea, how the check grades, and the solution to show afterwards
MORE = {
    "groups": ("f_groups", "`notebooks/09_tensor_parallel.ipynb` (sections 1 and 3) and the "
               "HSDP part of `notebooks/08_fsdp.ipynb`", 10, [],
               "8 ranks as tp_size = 2 by dp_size = 4: which ranks split one replica's weights "
               "between them (TP), which ones average the same part of different replicas (DP, "
               "where ZeRO shards)? And HSDP (FSDP's HYBRID_SHARD): shard inside a node, "
               "replicate across nodes. Both are the same grid of ranks, read along its two "
               "axes; `torch.distributed.device_mesh.init_device_mesh` builds it.",
               "the check calls your two functions for every world size up to 16 and every group "
               "size that divides it (no ranks needed). It checks that every rank is in exactly "
               "one group of each kind, the sizes, that TP and shard groups are on one node, and "
               "that each DP / replicate group takes the same slot of every TP / shard group. "
               "Then it compares with zerolab's own layout (`theory.mesh_groups`, torch's "
               "`init_device_mesh`). Last, it asks for a ValueError for a size that does not "
               "divide the world.",
               ["zerolab.theory.mesh_groups"]),
    "buckets_prefetch": ("g_buckets_prefetch", "`notebooks/04_ddp.ipynb` (buckets) and "
                         "`notebooks/07_zero3.ipynb` (prefetch)", 15,
                         ["zerolab.sharding.bucket_numel", "zerolab.zero3.ZeRO3._gather",
                          "zerolab.zero3.ZeRO3._ahead"],
                         "Two knobs you will meet in every real run: torch DDP's bucket_cap_mb "
                         "(how many gradients share one all_reduce) and FSDP's / ZeRO-3's "
                         "prefetch (how many blocks are gathered ahead). In zerolab they are a "
                         "strategy's bucket_mb, and ZeRO-3's prefetch depth. The depth is one "
                         "block in zero3.py, which _ahead reads. A variant beside the stage, "
                         "zerolab/variants/prefetch.py, sets other depths. In zerolab, DDP fills its "
                         "buckets in forward order (block 0 first). In torch, DDP fills them in "
                         "reverse registration order, its first bucket capped at 1 MiB. Predict what each "
                         "does, then let the check measure it.",
                         "the check compares `ddp_buckets` with zerolab's grouping on a few "
                         "hundred (sizes, cap, dtype) cases. Then it starts 3 gloo ranks that "
                         "build zerolab's DDP with four caps and ZeRO-3 with five prefetch depths, "
                         "on GPT nano with 6 blocks. It compares your buckets with the buckets and "
                         "all_reduces those runs formed, and your peak with the gathered-weights "
                         "peak the memory meter measured.",
                         ["zerolab.course.exercises.more.ddp_buckets",
                          "zerolab.theory.bucket_groups",
                          "zerolab.course.exercises.more.zero3_gathered_peak"]),
    "timing": ("h_timing", "`notebooks/03_collectives.ipynb` (the ring) and "
               "`notebooks/12_time.ipynb`", 10, ["zerolab.timing.linkemu.LinkEmulator"],
               "How long does a collective take? The α-β model: a latency α for each ring step "
               "plus the bytes each rank sends over the bandwidth β. zerolab's link emulator "
               "(shown below) makes gloo collectives last exactly as long as the model says. So "
               "your prediction can be measured on a laptop. That checks your arithmetic against "
               "zerolab's model and schedule, not the model against a real network (notebook 13 "
               "does that with published NCCL figures).",
               "the check compares `ring_time` with zerolab's cost model on a few hundred (op, "
               "size, n, link) cases. Then it times each collective on 3 gloo ranks over an "
               "emulated 0.1 Gb/s link with α = 2 ms. The measured time must be within "
               "25 % + 10 ms of your prediction.",
               ["zerolab.timing.costmodel.collective_time"]),
    "strategy_ddp": ("i_strategy_ddp", "`notebooks/04_ddp.ipynb` and exercise (b)", 45,
                     ["zerolab.course.exercises.track._correctness"],
                     "The optional track: no skeleton of zerolab's to fill in, a whole class of "
                     "your own. DDP with gradient buckets whose all_reduce starts from a hook "
                     "while backward still runs on the earlier layers; the check's loop (shown "
                     "below) drives it with torch alone.",
                     "the check runs your class on 3 gloo ranks. It compares the parameters "
                     "after each of 3 steps with single-process torch AdamW (and the gradient "
                     "norm), and the bytes of the ledger with 2(n-1)/n × 4Ψ. It asks for "
                     "buckets of at most the cap, and every all_reduce issued during "
                     "loss.backward(). Then, over an emulated link with a model whose blocks "
                     "sleep in backward, it measures how much communication your overlap "
                     "leaves exposed.",
                     ["zerolab.ddp.DDP._grads_ready", "zerolab.loop.hooks.GradReady"]),
    "strategy_zero1": ("j_strategy_zero1", "`notebooks/05_zero1.ipynb` and exercise (c)", 45,
                       ["zerolab.course.exercises.track._correctness"],
                       "The optional track, second class: a sharded AdamW (ZeRO-1). Each rank "
                       "keeps the optimizer state of its own 1/N of every parameter group, "
                       "updates that range, and an all_gather brings every rank's update to "
                       "everyone. The check's loop (shown below) drives it with torch alone.",
                       "the check runs your class on 3 gloo ranks. It compares the parameters "
                       "after each of 3 steps with single-process torch AdamW, the all_gather "
                       "bytes with (n-1)/n × 4Ψ, and the bytes your object keeps between steps "
                       "with 12Ψ/N. It also times the step over an emulated link where every "
                       "collective pays (n-1) × 5 ms of latency.",
                       ["zerolab.zero1.ZeRO1.update", "zerolab.zero1.ZeRO1.publish",
                        "zerolab.zero1.publish_update"]),
    "owner_assignment": ("k_owner_assignment", "`notebooks/08b_whole_matrix.ipynb` (sections 1 "
                         "and 3)", 15, ["zerolab.wholematrix.muon_owner.MuonOwner.hold"],
                         "Muon orthogonalises each weight matrix whole, so a sharded Muon cannot "
                         "step ZeRO's flat 1/N ranges. The owner layout gives every parameter to "
                         "one rank, which keeps its state and steps it whole. Which rank is the "
                         "rule torch's ZeroRedundancyOptimizer uses for any optimizer: largest "
                         "first, each to the rank that owns the fewest elements so far, the "
                         "lowest rank on a tie. `MuonOwner.hold` (shown below) calls it. Then it "
                         "lays out one flat buffer of N segments of the largest owner's load (its "
                         "elements): the owners you choose set the bytes every rank sends.",
                         "the check calls your `assign_owners` on 311 cases, no ranks needed. "
                         "Some are hand-made to tell the usual mistakes apart: a big parameter "
                         "last, many rows but few elements, equal sizes, more ranks than "
                         "parameters, a 0-d parameter. Then come 300 random ones, the course's "
                         "GPT on 2-4 ranks and the 7.5B GPT on 64. Each is compared with "
                         "zerolab's answer (which the tests hold to torch's "
                         "ZeroRedundancyOptimizer). A wrong answer names the first case, the "
                         "owners and loads, and the rule you wrote when it recognises it.",
                         ["zerolab.wholematrix.muon_theory.assign_owners"]),
}


def _module_of(dotted: str) -> str:
    """The longest importable module prefix of `dotted` (a function, class or method path)."""
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:k]))
            return ".".join(parts[:k])
        except ImportError:
            continue
    raise ValueError(dotted)


def _learn(functions) -> str:
    """'by writing `f` yourself; the check compares it with zerolab's own code' (or `f` and `g`)."""
    names = [f"`{f}`" for f in functions]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return (f"by writing {listed} yourself; the check compares "
            f"{'it' if len(names) == 1 else 'them'} with zerolab's own code")


def more_notebook(name: str) -> nbformat.NotebookNode:
    ex = EXERCISES[name]
    stem, read, minutes, callers, idea, how, solution = MORE[name]
    fns = ", ".join(f"`{f}`" for f in ex.functions)
    imports = sorted({_module_of(c) for c in callers + solution})
    head = "\n".join(f"import {m}" for m in imports) + \
        "\nfrom zerolab import nb\nfrom zerolab.course import exercises"
    track = ex.grader.endswith(".track")
    cells = [
        new_markdown_cell(
            f"# {'Track' if track else 'Exercise'} ({ex.letter}): {ex.title}\n\n"
            f"**You will learn** " + (f"by writing a whole {fns} of your own, an optional track; the "
                                      f"check runs it against plain torch" if track
                                      else _learn(ex.functions)) + ".\n\n"
            f"**You need** {read}; a laptop CPU.\n\n"
            f"**Time** ~{minutes} min.\n\n{SYMBOLS}\n\n{idea}\n\n**How it is checked**: {how} From a "
            f"terminal: `zerolab check {name} --impl notebooks/exercises/my_{name}.py`."),
        new_markdown_cell(
            "## The check's loop\n\nThe code that drives your class in the check (plain torch "
            "around it):" if track else "## The zerolab code your prediction is about\n\nWhat "
            "the check runs and measures:" if callers else "## Set-up"),
        new_code_cell(head + "".join(f"\nnb.show({c})" for c in callers)),
        new_markdown_cell("## Your code\n\nFill in the body, run the cell (it writes "
                          f"`my_{name}.py` next to this notebook), then run the check below. "
                          f"Stuck before checking? `exercises.hint(\"{name}\")` in a cell prints "
                          f"a first hint, `exercises.hint(\"{name}\", 2)` the next, and so on "
                          f"up to almost the code (terminal: `zerolab check {name} --hint 2`)."),
        new_code_cell(f"%%writefile my_{name}.py\n" + ex.skeleton.read_text()),
        new_markdown_cell("## Check\n\n`PASS` lists what was compared and measured; `FAIL` "
                          "names the first case (or step and rank) that differs, with the "
                          "expected value and, for a known mistake, why; the blank skeleton "
                          "fails at once."),
        new_code_cell(f'result = exercises.exercise("{name}", "my_{name}.py")'),
        new_markdown_cell("## Stuck, or done?\n\n" + (
            "zerolab's own strategy does the same job inside its own interface (compare after "
            "you passed):" if track else "zerolab's own answer. Uncomment and run when you have "
            "passed, or after a real try:")),
        new_code_cell("\n".join(f"# nb.show({c})" for c in solution)),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return nb


def exercise_notebook(name: str) -> nbformat.NotebookNode:
    ex = EXERCISES[name]
    stem, stage_nb, minutes, callers, idea, proves = PLAN[name]
    fns = ", ".join(f"`{f}`" for f in ex.functions)
    cells = [
        new_markdown_cell(
            f"# Exercise ({ex.letter}): {ex.title}\n\n"
            f"**You will learn** {_learn(ex.functions)}.\n\n"
            f"**You need** notebook {stage_nb[:2]} (`notebooks/{stage_nb}.ipynb`) and a laptop "
            f"CPU.\n\n**Time** ~{minutes} min.\n\n{SYMBOLS}\n\n{idea}\n\n"
            f"**How it is checked**: the check cell starts 3 gloo ranks. It puts your function "
            f"in place of zerolab's own inside the real strategy and trains a small GPT for 3 "
            f"steps. It compares with single-process torch AdamW and with the formulas of "
            f"`zerolab.theory`: the same checks zerolab's own tests use. From a terminal: "
            f"`zerolab check {name} --impl notebooks/exercises/my_{name}.py`."),
        new_markdown_cell("## Where your function is called\n\nzerolab's own code, as it runs "
                          "in the check (your function replaces the one it calls):"),
        new_code_cell("import zerolab.ddp, zerolab.sharding, zerolab.zero1, zerolab.zero2, zerolab.zero3\n"
                      "from zerolab import nb\nfrom zerolab.course import exercises\n\n"
                      + "\n".join(f"nb.show({c})" for c in callers)),
        new_markdown_cell("## Your code\n\nFill in the body, run the cell (it writes "
                          f"`my_{name}.py` next to this notebook), then run the check below. "
                          f"Stuck before checking? `exercises.hint(\"{name}\")` in a cell prints "
                          f"a first hint, `exercises.hint(\"{name}\", 2)` the next, and so on "
                          f"up to almost the code (terminal: `zerolab check {name} --hint 2`)."),
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
            "# Predict, then measure\n\n**You will learn** to predict the bytes and ranks of "
            "notebooks 02, 03 and 07 before a run shows them.\n\n**You need** notebooks 02, 03 "
            "and 07, and a laptop CPU.\n\n**Time** ~20 min; the measurement takes about 10 s.\n\n"
            + SYMBOLS + "\n\n"
            "Each question asks for a number. Write your prediction "
            "in place of `None` and run the cell: `answer` says whether it is right (with a hint "
            "if not; `reveal(id)` gives the answer and how it is computed). The last questions "
            "are then measured on 2 gloo ranks, so you see your number appear in a real run.\n\n"
            "Question ids name the notebook they come from (`02.3` is about "
            "`notebooks/02_memory.ipynb`; `pp` = a disagreement of `zerolab papers`; `pm` = this "
            "notebook's measurement)."),
        new_code_cell("from zerolab import nb\nfrom zerolab.course import checks\n"
                      "from zerolab.course.exercises import answer, reveal"),
    ]
    for qid, q in QUESTIONS.items():
        if qid == "pp.1":
            cells.append(new_markdown_cell(
                "## The papers\n\n`zerolab papers` (the site's page *The papers, reproduced on a "
                "laptop*) puts published numbers next to zerolab's prediction and a measurement. "
                "Where they disagree, work out why: predict the number the ledger measures, then "
                "write in one sentence where the paper's formula goes astray."))
        cells.append(new_markdown_cell(f"**{qid}.** {q.text}" + (f" ({q.unit})" if q.unit else "")))
        cells.append(new_code_cell(f'answer("{qid}", None)   # your prediction instead of None'))
        if qid == "pp.2":
            cells.append(new_markdown_cell(
                "**Where the paper's formula goes astray**, in one sentence (then compare with the "
                "row fsdp-hybrid of `zerolab papers`): *write it here*"))
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


def fit_batch_notebook() -> nbformat.NotebookNode:
    """Exercise (l): the largest micro-batch that fits, graded by zerolab.course.exercises.fitbatch."""
    stages = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    cells = [
        new_markdown_cell(
            "# Exercise (l): the largest micro-batch that fits\n\n"
            "**You will learn** to assemble one rank's peak from its parts before you launch.\n"
            "**You need** notebook 10 (the peak above the formula) and a laptop CPU.\n"
            "**Time** ~15 min.\n\n"
            "A rank's peak is not its model states. "
            "During backward it also holds the activations, their gradients and the stage's "
            "transients. "
            "Inside the optimizer step it holds the fp32 gradient copies instead. "
            "The question: how many rows per rank, B, fit the device at each stage? "
            "See the [symbols](../glossary.md#symbols) for B, N and Ψ."),
        new_markdown_cell(
            "## The parts\n\n"
            "The cell prints each stage's parts, in bytes per rank, as `zerolab fit` counts them. "
            "*rest* is what the backward holds besides the states and gathered blocks: buckets "
            "and reduce_scatter outputs, minus gathered bytes already freed at that moment. "
            "*act/row* is what the forward keeps per row; *temp/row* is what the backward adds "
            "per row at its peak."),
        new_code_cell("from zerolab.course.exercises import fitbatch\n\nfitbatch.show_parts()"),
        new_markdown_cell(
            "## Your answers\n\n"
            "Write your B in place of `None` and run the cell. "
            "A wrong B names the mistake that gives it, when it is a usual one. "
            "`fitbatch.reveal(stage)` shows the answer and how it is assembled.\n\n"
            "**Takeaway:** the peak is the larger of the backward's and the optimizer step's, "
            "and only the backward's grows with B."),
    ]
    for s, name in enumerate(stages):
        cells.append(new_code_cell(f"fitbatch.answer({s}, None)   # your B for {name}"))
    cells.append(new_markdown_cell(
        "## Stuck, or done?\n\n"
        "Uncomment and run to see each answer, assembled from the parts and simulated by "
        "`zerolab fit`.\n\n"
        "**Takeaway:** `zerolab fit` does this assembly for any model before you launch."))
    cells.append(new_code_cell("\n".join(f"# fitbatch.reveal({s})" for s in range(4))))
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return nb


def write(nb: nbformat.NotebookNode, path: Path):
    """Write `nb`, keeping the cell ids of the notebook already at `path` (same cell count), so
    that regenerating an unchanged notebook changes nothing."""
    if path.exists():
        old = nbformat.read(path, as_version=4)
        if len(old.cells) == len(nb.cells):
            for new, cell in zip(nb.cells, old.cells):
                if "id" in cell:
                    new["id"] = cell["id"]
    nbformat.write(nb, path)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name in EXERCISES:
        if name in MORE:
            write(more_notebook(name), OUT / f"{MORE[name][0]}.ipynb")
        else:
            write(exercise_notebook(name), OUT / f"{PLAN[name][0]}.ipynb")
    write(predict_notebook(), OUT / "predict_then_measure.ipynb")
    write(fit_batch_notebook(), OUT / "l_fit_batch.ipynb")
    print(f"wrote {len(EXERCISES) + 2} notebooks to {OUT}")


if __name__ == "__main__":
    main()
