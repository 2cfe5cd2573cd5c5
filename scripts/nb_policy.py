"""Apply the notebooks' output policy: keep the outputs of cells tagged `nbval-check-output`, the
figures of cells tagged `figure`, and the code listings of cells tagged `shown-code`; nothing else.

Policy: committed notebooks (notebooks/, labs/) carry no machine-specific noise. Cells whose
output is deterministic (formula tables, byte counts, group layouts) are tagged
`nbval-check-output`; they keep the outputs of the CPU reference run, and nbval compares them
in CI. Cells that draw are tagged `figure` and keep their image/png outputs only (the picture of
the CPU reference run, rendered by scripts/nb_figures.py, which also checks that every drawing
cell has one; nbval never compares images); their text outputs (the `<Figure ...>` repr,
progress lines) are dropped unless the cell is also tagged `nbval-check-output`. Cells tagged
`keep-output` print what a reader needs to see without running (a table of losses) but whose last
digits depend on the machine: they keep the CPU reference run's outputs for reading, and nbval
--nbval-lax does not compare them. Cells tagged `shown-code` show the package's own code
(`nb.show(...)`, a diff of two strategy files): they keep their display outputs' text/markdown
and text/plain data only (never an image, a stream or an error), made without running the
notebook by scripts/nb_shown.py, whose --check compares them with the code as it is now (nbval
--nbval-lax does not compare them). Every other cell is committed without outputs (nbval
--nbval-lax only runs it). Execution counts and
kernel-run metadata are removed everywhere; a cell that keeps outputs gets execution count 1.

    python scripts/nb_policy.py notebooks/*.ipynb labs/*.ipynb          # rewrite in place
    python scripts/nb_policy.py --check notebooks/*.ipynb labs/*.ipynb  # exit 1 if any differs
"""
import json
import sys

TAG = "nbval-check-output"
FIGURE_TAG = "figure"           # keeps its image/png outputs (scripts/nb_figures.py renders them)
KEEP_TAG = "keep-output"        # kept for reading, not compared (machine-specific digits)
NO_FIGURE_TAG = "no-figure"     # draws, by its code, but shows nothing on the CPU reference run
SHOWN_TAG = "shown-code"        # keeps its Markdown listing of the package's code (nb_shown.py)
SHOWN_MIME = ("text/markdown", "text/plain")


def _figure_only(outputs: list) -> list:
    """The image/png outputs of a figure cell, as display_data with the PNG alone."""
    kept = []
    for out in outputs:
        png = out.get("data", {}).get("image/png") if out.get("output_type") in (
            "display_data", "execute_result") else None
        if png:
            meta = {k: v for k, v in out.get("metadata", {}).items() if k == "image/png"}
            kept.append({"data": {"image/png": png}, "metadata": meta, "output_type": "display_data"})
    return kept


def _shown_only(outputs: list) -> list:
    """The Markdown display outputs of a shown-code cell: text/markdown and text/plain data."""
    kept = []
    for out in outputs:
        if out.get("output_type") != "display_data":
            continue
        data = {k: v for k, v in out.get("data", {}).items() if k in SHOWN_MIME}
        if "text/markdown" in data:
            kept.append({"data": data, "metadata": {}, "output_type": "display_data"})
    return kept


def clean(nb: dict) -> dict:
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        cell["metadata"].pop("papermill", None)
        if cell["cell_type"] != "code":
            continue
        # nbval refuses a reference cell that has outputs but no execution_count ("Unrun
        # reference cell has outputs"), so a kept cell gets a fixed count of 1.
        tags = cell["metadata"].get("tags", [])
        if TAG not in tags and KEEP_TAG not in tags:
            cell["outputs"] = (_figure_only(cell["outputs"]) if FIGURE_TAG in tags else []) \
                + (_shown_only(cell["outputs"]) if SHOWN_TAG in tags else [])
        cell["execution_count"] = 1 if TAG in tags or cell["outputs"] else None
        for out in cell["outputs"]:
            if "execution_count" in out:
                out["execution_count"] = 1
    nb["metadata"].pop("papermill", None)
    return nb


def write(path, nb: dict):
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main(argv) -> int:
    check = "--check" in argv
    bad = []
    for path in [a for a in argv if a != "--check"]:
        with open(path) as f:
            nb = json.load(f)
        new = clean(nb)
        if new != nb:
            bad.append(path)
            if not check:
                write(path, new)
    if check and bad:
        print("not following the output policy (run scripts/nb_policy.py on them):", *bad, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
