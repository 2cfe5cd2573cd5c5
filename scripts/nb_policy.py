"""Apply the notebooks' output policy: keep outputs only of cells tagged `nbval-check-output`.

Policy: committed notebooks (notebooks/, labs/) carry no machine-specific noise. Cells whose
output is deterministic (formula tables, byte counts, group layouts) are tagged
`nbval-check-output`; they keep the outputs of the CPU reference run, and nbval compares them
in CI. Every other cell is committed without outputs (nbval --nbval-lax only runs it).
Execution counts and kernel-run metadata are removed everywhere.

    python scripts/nb_policy.py notebooks/*.ipynb labs/*.ipynb          # rewrite in place
    python scripts/nb_policy.py --check notebooks/*.ipynb labs/*.ipynb  # exit 1 if any differs
"""
import json
import sys

TAG = "nbval-check-output"


def clean(nb: dict) -> dict:
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        cell["metadata"].pop("papermill", None)
        if cell["cell_type"] != "code":
            continue
        # nbval refuses a reference cell that has outputs but no execution_count ("Unrun
        # reference cell has outputs"), so a kept cell gets a fixed count of 1.
        keep = TAG in cell["metadata"].get("tags", [])
        cell["execution_count"] = 1 if keep else None
        if not keep:
            cell["outputs"] = []
        for out in cell["outputs"]:
            if "execution_count" in out:
                out["execution_count"] = 1
    nb["metadata"].pop("papermill", None)
    return nb


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
                with open(path, "w") as f:
                    json.dump(new, f, indent=1, ensure_ascii=False)
                    f.write("\n")
    if check and bad:
        print("not following the output policy (run scripts/nb_policy.py on them):", *bad, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
