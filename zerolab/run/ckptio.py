"""A checkpoint folder on disk: written by every rank together and committed atomically, read
back checked file by file (zerolab/run/checkpoint.py decides *what* is saved; this module how).

Writing (`write`, collective): rank 0 makes a hidden `.tmp_step_*` folder; every rank writes and
fsyncs its rank{r}.pt, hashing it as torch.save writes it (`integrity.HashingWriter`); the
ranks exchange their hashes (or their failure); rank 0 writes meta.json with every file's size
and sha256, sealed with its own (`integrity.seal`), renames the folder into place, and only then
replaces `latest` with the folder's name and meta.json's sha256 (`integrity.pointer`). A crash
or kill leaves the previous checkpoint and `latest` as they were. A rank that cannot write - the
disk is full, no permission - makes every rank raise the same one line (`ResourceError` when
something ran out) naming what ran out, what was kept and what to do; the partial folder is
removed first (so the run's manifest can still be written). Nothing is ever deleted through a
symbolic link (`folders.remove_tree`).

Reading (`find`, `read_meta`, `load_rank_file`): `latest` must match the meta.json it names,
meta.json its seal, each rank file its size and sha256 - before anything is used; otherwise one
line naming the file (`integrity.IntegrityError`). Format 2 checkpoints (no hashes) still load.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from .folders import atomic_write, remove_tree
from .integrity import (SEAL, HashingWriter, IntegrityError, check_file, check_seal, pointer,
                        read_pointer, seal, sha256_bytes, sha256_file)
from .resources import ResourceError, describe

FORMAT_VERSION = 3        # 2: per-parameter AdamW step counts ("steps"), meta.json "frozen";
#                           3: a sha256 of every file (meta.json "sha256", "sealed"; `latest`)
TODO = "resume from an earlier checkpoint (a step_* folder), or rerun"


# --- write: collective -------------------------------------------------------------------------
def write(root, step: int, make_state, make_meta, *, crash_rank: int | None = None) -> Path:
    """Collective: root/step_{step:06d}/ with this rank's rank{r}.pt = torch.save(make_state())
    and rank 0's meta.json = make_meta(files {name: bytes}, sha256 {name: hex}) + "sealed";
    then root/latest. Three all_gathers of a few bytes (`_together`). crash_rank (tests only): that rank
    truncates its file and kills itself mid-save. Returns the folder."""
    rank, n = dist.get_rank(), dist.get_world_size()
    root, name = Path(root), f"step_{step:06d}"
    final, tmp, old = root / name, root / f".tmp_{name}", root / f".old_{name}"
    failed = None
    if rank == 0:
        try:
            remove_tree(tmp)                    # a link is removed itself, never followed
            tmp.mkdir(parents=True)
        except OSError as err:
            failed = _failure(err, root, name, rank)
    _raise_any(_together(failed))
    writer = digest = None
    try:
        with open(tmp / f"rank{rank}.pt", "wb") as f:
            writer = HashingWriter(f)
            torch.save(make_state(), writer)
            f.flush()
            if crash_rank == rank:              # tests: die with half a file written
                f.truncate(f.tell() // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            os.fsync(f.fileno())
        digest = writer.hexdigest()
    except (OSError, RuntimeError) as err:      # torch.save: RuntimeError("unexpected pos")
        failed = _failure((writer and writer.error) or err, root, name, rank)
    digests = _together((digest, failed))       # every rank file is complete on disk
    if rank == 0 and any(f for _, f in digests):
        remove_tree(tmp)                        # frees what the partial checkpoint took
    _raise_any([f for _, f in digests])
    if rank == 0:
        moved = placed = False
        try:
            files = {f"rank{r}.pt": (tmp / f"rank{r}.pt").stat().st_size for r in range(n)}
            text = json.dumps(seal(make_meta(files, {f"rank{r}.pt": d for r, (d, _)
                                                     in enumerate(digests)})), indent=1)
            atomic_write(tmp / "meta.json", text)
            if final.exists() or final.is_symlink():   # the same step saved before: replace it
                remove_tree(old)
                os.replace(final, old)
                moved = True
            os.replace(tmp, final)
            placed = True
            atomic_write(root / "latest", pointer(name, sha256_bytes(text.encode())))
        except OSError as err:                  # undo: the folder as it was before the save
            failed = _failure(err, root, name, rank)
            remove_tree(final if placed else tmp)
            if moved:
                os.replace(old, final)
        with contextlib.suppress(OSError):
            remove_tree(old)
    _raise_any(_together(failed))
    return final


def _together(item) -> list:
    """Collective: every rank's `item` (picklable), in rank order; a barrier too.
    The gather's few pickled bytes are kept out of any memory measurement around a save
    (`memory.transient_peak`, MemTracker: a dispatch mode, paused here): gloo's worker thread
    frees them when it next gets the GIL, so they landed in the save's peak on one rank in some
    runs (4-rank nano, stages 0-3, two saves each: 5 of 48 rank saves measured 121,428 bytes
    instead of 121,408; a barrier after the gather still let one through under CI load)."""
    items = [None] * dist.get_world_size()
    with _disable_current_modes():
        dist.all_gather_object(items, item)
    return items


def _failure(err: BaseException, root: Path, name: str, rank: int) -> tuple[bool, str]:
    """(ran out of something?, the one line) for a save of `name` under `root` that failed."""
    why = describe(err)
    what, todo = why or (f"{type(err).__name__}: {err}",
                         "check that folder (permissions, space), or choose another --out")
    return why is not None, (f"{what}, while rank {rank} saved checkpoint {name} in {str(root)!r}:"
                             f" nothing of {name} was kept, {kept(root)}; {todo}")


def _raise_any(failures: list):
    """Raise the first failure of `failures` ((resource?, line) or None) on every rank."""
    for failure in failures:
        if failure:
            raise (ResourceError if failure[0] else ValueError)(failure[1])


def latest_name(root) -> str | None:
    """The step folder root/latest names (None when there is none or it is unreadable)."""
    try:
        return read_pointer((Path(root) / "latest").read_text(), "")[0]
    except (OSError, ValueError):
        return None


def kept(root) -> str:
    """What a failed run keeps under the checkpoints folder `root`, in words for one line."""
    name = latest_name(root)
    if name is None:
        return "no checkpoint was kept (none had been saved)"
    return f"checkpoint {name} stays latest (resume with --resume {root})"


def kept_in(out) -> str:
    """What a run that stopped keeps under `out`, in words for one line: each stage's latest
    checkpoint, or that none was saved."""
    roots = sorted(Path(out).glob("stage[0-9]*/checkpoints"))
    saved = [kept(r) for r in roots if latest_name(r)]
    return "; ".join(saved) or "no checkpoint was saved (--save-every K writes them)"


# --- read: checked before use ------------------------------------------------------------------
def find(path) -> Path:
    """The step folder for `path`: a step_* folder itself, or a folder holding `latest`
    (OUT/stage{S}/checkpoints), or OUT/stage{S}. ValueError when none is there; IntegrityError
    when `latest` is damaged or meta.json is not the one it recorded."""
    p = Path(path)
    for candidate in (p, p / "checkpoints"):
        if (candidate / "meta.json").is_file():
            return candidate
        if (candidate / "latest").is_file():
            where = f"checkpoint {str(candidate)!r}: latest "
            name, digest = read_pointer((candidate / "latest").read_text(errors="replace"), where)
            step = candidate / name
            if not (step / "meta.json").is_file():
                raise ValueError(f"checkpoint {str(candidate)!r}: 'latest' names {name!r}, "
                                 "which has no meta.json (latest damaged, or the folder removed)")
            if digest is not None and sha256_file(step / "meta.json") != digest:
                read_meta(step)                 # names meta.json when it is the damaged one
                raise IntegrityError(f"{where}does not match {name}/meta.json (latest damaged "
                                     f"or replaced); open a step_* folder directly, or rerun")
            return step
    raise ValueError(f"no checkpoint at {str(path)!r}: expected a step_* folder with meta.json, "
                     "or OUT/stage{S}/checkpoints with a 'latest' file")


def read_meta(folder: Path) -> dict:
    """meta.json, checked: readable, a format this zerolab reads, and (format 3, or whenever a
    hash is recorded) the same content as when it was written (`integrity.check_seal`)."""
    where = repr(str(folder))
    try:
        meta = json.loads((folder / "meta.json").read_text())
        version = meta["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"checkpoint {where}: meta.json is unreadable ({err})") from None
    hashed = version == FORMAT_VERSION or SEAL in meta or "sha256" in meta
    try:
        if hashed:
            check_seal(meta, f"checkpoint {where}: meta.json ", TODO)
    except IntegrityError:
        if isinstance(version, int) and version <= FORMAT_VERSION:
            raise
        hashed = "damaged"
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"checkpoint {where} has format version {version!r}; this zerolab "
                         f"reads versions up to {FORMAT_VERSION}: upgrade zerolab to load it"
                         + (" (or meta.json is damaged: it differs from the sha256 it records)"
                            if hashed == "damaged" else ""))
    return meta


def load_rank_file(folder: Path, meta: dict, r: int) -> dict:
    """rank{r}.pt of the checkpoint in `folder`, memory-mapped (torch.load(mmap=True,
    weights_only=True)), after checking that it is there, has the recorded size, loads, and
    (format 3) has the recorded sha256. ValueError / IntegrityError (one line) otherwise."""
    where, n, f = repr(str(folder)), meta["world_size"], folder / f"rank{r}.pt"
    if not f.is_file():
        raise ValueError(f"checkpoint {where} is missing rank{r}.pt (saved by {n} ranks: "
                         f"rank0.pt .. rank{n - 1}.pt must all be there)")
    size, recorded = f.stat().st_size, meta["files"].get(f.name)
    if size != recorded:
        raise ValueError(f"checkpoint {where}: rank{r}.pt has {size} bytes but meta.json "
                         f"recorded {recorded}: the file is truncated or was replaced")
    try:
        state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint {where}: rank{r}.pt is unreadable ({first})") from None
    hashes = meta.get("sha256")
    if hashes is not None or meta["format_version"] >= 3:
        if not isinstance(hashes, dict) or f.name not in hashes:
            raise IntegrityError(f"checkpoint {where}: meta.json records no sha256 for "
                                 f"{f.name}; {TODO}")
        check_file(f, hashes[f.name], f"checkpoint {where}: ", TODO)
    return state
