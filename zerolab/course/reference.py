"""Reference results: a committed CPU run of every lab, so that a class can still plot when a
launch fails (or a machine is too slow).

Idea: `zerolab/course/reference_runs/` holds what each lab reads back from its launches, from one
`zerolab labs` run on the reference machine (2 CPU cores, gloo, torch 2.13), stored under the path
each lab launched into, from the lab's folder on (e.g. `lab2_traffic_by_stage/notes`): the rank
JSONs (`stage{S}/rank{r}.json`, a few KB each; lab 6's step times are in them), the Chrome
traces of labs 3 and 6 (`stage{S}/trace_rank{r}.json`, cut to the ranges `trace.spans` reads:
compute phases and blocks, each collective's issue, wait and run; a few KB) and, for lab 5, the
per-parameter differences to DDP (`param_diffs.json`, written by `results.param_diffs`) instead of
the binary `params.pt` files; for lab 7, the JSONs its demo wrote (`<model>/rank{r}.json`, from
`zerolab.course.demos.byom`). In reference mode `zerolab.course.nb.launch` (and `nb.launch_demo`)
starts no ranks: it copies the matching reference run into the requested `out` folder and
returns it, so every later cell (tables, checks, plots) runs unchanged.

    zerolab labs --reference                 # every lab, from the reference run
    from zerolab import nb; nb.use_reference()   # in one notebook; rerun the failed cell

Reference mode is on when `use_reference()` was called in this process or the environment
variable ZEROLAB_REFERENCE=1 is set (what `zerolab labs --reference` does for papermill).
Regenerate (what made the committed files, on the 2-core CPU machine):

    python -m zerolab labs --out /tmp/ref            # or --only lab5,lab6 for some labs
    python -m zerolab.course.reference /tmp/ref [lab5_same_training lab6_time_by_stage ...]

which replaces the stored runs of the labs found in the folder (or only the named ones) and
rewrites `reference_runs/SHA256SUMS`: the sha256 of every stored file (`sha256sum -c SHA256SUMS`
in that folder checks them). `restore` checks each file against it before copying: a file that
differs (or is not listed) is one line naming it, and nothing is restored from a damaged run.
A restore writes each file through a temporary file and a rename: a link in `out` is replaced
itself, what it points to is never written.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

FOLDER = Path(__file__).parent / "reference_runs"
SUMS = "SHA256SUMS"                 # in FOLDER: '<sha256>  <path from FOLDER>' per stored file
FILES = ("stage[0-3]/rank*.json", "stage[0-3]/trace_rank*.json", "param_diffs.json")
DEMO_FILES = ("rank*.json",)        # a demo's run (lab 7: zerolab.course.demos.byom): OUT/rank{r}.json
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
    """Copy the reference run for `out` (the files FILES names) into `out` and make OUT/run.json
    name it (a manifest already there, e.g. of the launch that failed, is kept as
    run.<its run_id>.json); returns `out`. FileNotFoundError naming the stored runs when there is
    none for `out`'s key."""
    src = FOLDER / key(out)
    if not any(src.glob("stage[0-3]/rank*.json")):
        known = sorted(str(p.parent.parent.relative_to(FOLDER))
                       for p in FOLDER.glob("**/stage*/rank0.json"))
        raise FileNotFoundError(f"no reference run for {key(out)!r} (out={str(out)!r}); "
                                f"reference runs: {', '.join(sorted(set(known))) or 'none'}")
    dst = Path(out)
    _copy_checked([p for pattern in FILES for p in src.glob(pattern)], src, dst)
    # the folder's manifest now names the reference run (else load_run would look for the files
    # of the launch that failed there); the failed run's manifest is kept beside it
    from ..run.folders import MANIFEST, atomic_json, read_manifest
    run_id = json.loads(next(src.glob("stage[0-3]/rank0.json")).read_text()).get("run_id")
    old = read_manifest(dst)
    if old and old["run_id"] != run_id:
        os.replace(dst / MANIFEST, dst / f"run.{old['run_id']}.json")
    atomic_json(dst / MANIFEST, {"run_id": run_id, "command": "reference", "status": "ok",
                                 "source": f"zerolab/course/reference_runs/{key(out)}",
                                 "replaces": (old or {}).get("run_id")})
    return dst


def restore_demo(out) -> Path:
    """`restore` for a demo's run (`nb.launch_demo`): copy the stored OUT/rank{r}.json files for
    `out`'s key into `out`; returns `out`. FileNotFoundError naming the stored demo runs when
    there is none."""
    src = FOLDER / key(out)
    files = [p for pattern in DEMO_FILES for p in src.glob(pattern)]
    if not files:
        known = sorted(str(p.parent.relative_to(FOLDER)) for p in _demo_runs(FOLDER))
        raise FileNotFoundError(f"no reference run for {key(out)!r} (out={str(out)!r}); "
                                f"reference demo runs: {', '.join(known) or 'none'}")
    dst = Path(out)
    data = _checked(files)
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("rank*.json"):
        old.unlink()                        # a link is removed itself
    from ..run.folders import atomic_write
    for path in files:
        atomic_write(dst / path.name, data[path])
    return dst


def _sums(folder: Path = None) -> dict[str, str]:
    """{path from FOLDER: sha256} from FOLDER/SHA256SUMS; {} when there is none."""
    folder = folder or FOLDER
    try:
        text = (folder / SUMS).read_text()
    except FileNotFoundError:
        return {}
    return {name: digest for digest, name in (line.split("  ", 1) for line in text.splitlines()
                                              if "  " in line)}


def _checked(paths) -> dict[Path, bytes]:
    """{path: its bytes} for stored files `paths`, each checked against SHA256SUMS first;
    IntegrityError (one line naming the file) for a file that differs or is not listed."""
    from ..run.integrity import IntegrityError, sha256_bytes
    sums, out = _sums(), {}
    for path in paths:
        name, data = path.relative_to(FOLDER).as_posix(), path.read_bytes()
        if sums.get(name) != sha256_bytes(data):
            what = "is not listed in" if name not in sums else "differs from the sha256 in"
            raise IntegrityError(f"reference run file {name} {what} {FOLDER / SUMS} (damaged or "
                                 "altered); reinstall zerolab (or `git checkout` that file), or "
                                 "launch the run instead")
        out[path] = data
    return out


def _copy_checked(paths, src: Path, dst: Path):
    """Copy stored files `paths` (under `src`) to the same places under `dst`, all checked
    before the first is written; each through a temporary file and a rename (never a link)."""
    from ..run.folders import atomic_write
    for path, data in _checked(paths).items():
        folder = dst
        for part in path.relative_to(src).parent.parts:   # a linked folder on the way: the
            folder = folder / part                          # link goes, its target is untouched
            if folder.is_symlink():
                folder.unlink()
        atomic_write(dst / path.relative_to(src), data)


def write_sums(folder: Path = None) -> Path:
    """(Re)write FOLDER/SHA256SUMS: the sha256 of every stored file, sorted by path."""
    from ..run.folders import atomic_write
    from ..run.integrity import sha256_file
    folder = folder or FOLDER
    lines = [f"{sha256_file(p)}  {p.relative_to(folder).as_posix()}"
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != SUMS]
    return atomic_write(folder / SUMS, "".join(line + "\n" for line in lines))


def _demo_runs(folder: Path) -> list[Path]:
    """rank0.json files under `folder` written by a demo (they say which: a "demo" key)."""
    out = []
    for path in folder.glob("**/rank0.json"):
        if re.fullmatch(r"stage[0-3]", path.parent.name):
            continue
        try:
            if "demo" in json.loads(path.read_text()):
                out.append(path)
        except (OSError, ValueError):
            continue
    return out


def _trace(path: Path) -> dict:
    """A Chrome trace cut to the ranges `trace.spans` reads (`trace.keep`), without their args:
    the labs print and plot those; the metadata (zerolab's run / stage / rank / step) is kept."""
    from ..timing import trace
    data = json.loads(path.read_text())
    return {**data, "traceEvents": [{k: v for k, v in e.items() if k != "args"}
                                    for e in data["traceEvents"] if trace.keep(e)]}


def save(labs_out, labs=None) -> int:
    """Store the rank JSONs (and lab 5's `param_diffs.json`, which the lab wrote with
    `results.param_diffs`, and the traces, cut) under `labs_out` (a `zerolab labs` folder) as the
    reference of each lab found there (or of the named `labs` only), replacing that lab's stored
    run; returns the number of files stored. ValueError for a run whose parameters were saved
    but not compared (no param_diffs.json)."""
    labs_out, count = Path(labs_out), 0
    demos = sorted({p.parent for p in _demo_runs(labs_out) if re.match(r"lab\d+_", key(p.parent))})
    found = sorted({key(p.parent.parent).split("/")[0]
                    for p in labs_out.glob("**/stage[0-3]/rank0.json")}
                   | {key(run).split("/")[0] for run in demos})
    chosen = [lab for lab in found if not labs or lab in labs]
    if labs and set(labs) - set(chosen):
        raise ValueError(f"no run of {sorted(set(labs) - set(chosen))} in {str(labs_out)!r} "
                         f"(found {found})")
    from ..run.folders import remove_tree
    for lab in chosen:
        remove_tree(FOLDER / lab)
    for run in sorted({p.parent.parent for p in labs_out.glob("**/stage[0-3]/rank0.json")}):
        name = key(run)
        if name.split("/")[0] not in chosen:
            continue
        if any(run.glob("stage[0-3]/params.pt")) and not (run / "param_diffs.json").exists():
            raise ValueError(f"{str(run)!r} holds params.pt but no param_diffs.json: lab 5 "
                             "writes it (results.param_diffs); rerun that lab")
        for pattern in FILES:
            for path in run.glob(pattern):
                data = _trace(path) if path.name.startswith("trace") else json.loads(path.read_text())
                target = FOLDER / name / path.relative_to(run)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(data, separators=(",", ":")))
                count += 1
    for run in demos:
        if key(run).split("/")[0] not in chosen:
            continue
        for pattern in DEMO_FILES:
            for path in run.glob(pattern):
                target = FOLDER / key(run) / path.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(json.loads(path.read_text()), separators=(",", ":")))
                count += 1
    write_sums()
    return count


if __name__ == "__main__":
    import argparse
    cli = argparse.ArgumentParser(prog="python -m zerolab.course.reference",
                                  description="store a `zerolab labs` folder's runs as the reference")
    cli.add_argument("labs_out", help="a `zerolab labs --out` folder")
    cli.add_argument("labs", nargs="*", help="only these labs (e.g. lab5_same_training)")
    ns = cli.parse_args()
    if not Path(ns.labs_out).is_dir():
        cli.error(f"{ns.labs_out!r} is not a folder")
    print(f"stored {save(ns.labs_out, ns.labs or None)} files under {FOLDER}")
