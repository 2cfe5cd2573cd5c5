"""Reference results: a committed CPU run of every lab, so that a class can still plot when a
launch fails (or a machine is too slow).

Idea: `zerolab/reference_runs/` holds the rank JSONs (`stage{S}/rank{r}.json`, a few KB each) of
one `zerolab labs` run on the reference machine (2 CPU cores, gloo, torch 2.13), stored under the
path each lab launched into, from the lab's folder on (e.g. `lab2_traffic_by_stage/notes`). In
reference mode `zerolab.nb.launch` starts no ranks: it copies the matching reference run into the
requested `out` folder and returns it, so every later cell (tables, checks, plots) runs unchanged.

    zerolab labs --reference                 # every lab, from the reference run
    from zerolab import nb; nb.use_reference()   # in one notebook; rerun the failed cell

Reference mode is on when `use_reference()` was called in this process or the environment
variable ZEROLAB_REFERENCE=1 is set (what `zerolab labs --reference` does for papermill).
Regenerate with `python -m zerolab.reference RUNS_LABS_FOLDER` after `zerolab labs`.
Not covered: lab 5, which compares parameter files (`params.pt`, binary) and needs a real
launch; in reference mode it stops with a one-line "no reference run" error.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

FOLDER = Path(__file__).parent / "reference_runs"
SKIP = ("lab5_same_training",)      # compares parameter files (params.pt): needs a real launch
_ON = False


def use_reference(on: bool = True):
    """Turn reference mode on (or off) for this process's launches."""
    global _ON
    _ON = bool(on)


def active() -> bool:
    return _ON or os.environ.get("ZEROLAB_REFERENCE") == "1"


def key(out) -> str:
    """The reference key of an `out` folder: its path from the lab's folder (lab<k>_...) on."""
    parts = Path(out).parts
    for i, part in enumerate(parts):
        if re.match(r"lab\d+_", part):
            return "/".join(parts[i:])
    return Path(out).name


def restore(out) -> Path:
    """Copy the reference run for `out` into `out`; FileNotFoundError naming what exists."""
    src = FOLDER / key(out)
    if not any(src.glob("stage[0-3]/rank*.json")):
        known = sorted(str(p.parent.parent.relative_to(FOLDER))
                       for p in FOLDER.glob("**/stage0/rank0.json"))
        raise FileNotFoundError(f"no reference run for {key(out)!r} (out={str(out)!r}); "
                                f"reference runs: {', '.join(known) or 'none'}")
    dst = Path(out)
    for path in src.glob("stage[0-3]/rank*.json"):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return dst


def save(labs_out) -> int:
    """Store every rank JSON under `labs_out` (a `zerolab labs` folder) as the reference."""
    labs_out, count = Path(labs_out), 0
    if FOLDER.exists():
        shutil.rmtree(FOLDER)
    for path in labs_out.glob("**/stage[0-3]/rank*.json"):
        name = key(path.parent.parent)
        if name.startswith(SKIP):
            continue
        target = FOLDER / name / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(json.loads(path.read_text()), separators=(",", ":")))
        count += 1
    return count


if __name__ == "__main__":
    print(f"stored {save(sys.argv[1])} rank JSONs under {FOLDER}")
