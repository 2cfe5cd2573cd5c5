"""Run folders: one manifest per run, a lock against concurrent runs, tagged and atomic writes.

Idea: every launch that writes into an output folder OUT is one *run* with an id. Whoever starts it
(the `zerolab` command, `nb.launch`, or rank 0 of a bare `torchrun -m zerolab.run.train`) calls
`start_run`, which

- takes an exclusive lock on OUT/.zerolab.lock for the run's whole life (`fcntl.flock`: the kernel
  drops it when the process dies, so a killed run never leaves a stale lock), and refuses a second
  run into a folder that is in use;
- keeps a run the folder already holds: its manifest and the result paths it names move to a
  new numbered sibling, OUT.1 (then OUT.2, ...), and one line says where (`keep_aside`), so the
  same command can be typed again and again; `overwrite=True` deletes that run's files instead
  (only the paths its manifest names as outputs, never anything else, and never through a
  symbolic link: a link is removed itself, what it points to stays); `previous="refuse"`
  refuses the folder; keeping refuses (one line, nothing moved) a result path holding what no
  run wrote (`not_written`);
- writes OUT/run.json: run id, command, arguments, world size, start time, versions, status.

Every file a run writes carries its run id (a "run_id" key in JSON files and torch files, PNG
metadata), and is written atomically (a temporary file in the same folder, then `os.replace`), so a
killed run leaves either the old file or the new one, never half of one. Readers
(`zerolab.course.results.load_run`) keep only the files of the manifest's run and say so when others are
present.

    with start_run("runs/compare", command="compare", args=vars(args), world_size=4) as run:
        ...   # pass run.run_id to the ranks (zerolab.run.train --run-id)
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import platform
import secrets
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

from .resources import describe

MANIFEST = "run.json"
LOCK = ".zerolab.lock"
#: what a run of each command writes (globs relative to OUT); --overwrite deletes these only,
#: keeping a run moves these (and the manifest) aside
OUTPUTS = {"train": ["stage[0-9]*", "compare.json", "compare.png"],
           "compare": ["stage[0-9]*", "compare.json", "compare.png"],
           "labs": ["lab*", "report.md"],
           "bench": ["bench.json", "meter_cost.json"]}
#: what `begin_run` does with a run OUT already holds
PREVIOUS = ("keep", "replace", "refuse")


class RunFolderError(ValueError):
    """OUT cannot take this run: in use by another run, holding another run, or not writable."""


def new_run_id() -> str:
    """'20260129T153012Z-3fa9c1': UTC start time (sortable) and 24 random bits."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def versions() -> dict[str, str]:
    """Versions that decide the numbers: Python, torch, zerolab, and the CUDA/NCCL torch was built with."""
    import torch

    from .. import __version__
    return {"python": platform.python_version(), "torch": torch.__version__, "zerolab": __version__,
            "cuda": str(torch.version.cuda), "platform": platform.platform()}


# --- atomic writes -------------------------------------------------------------------------------
_UMASK = os.umask(0)
os.umask(_UMASK)


def _mkstemp(path: Path, suffix: str) -> tuple[int, str]:
    """A temporary file next to `path` with the permissions a plain open() would give it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.fchmod(fd, 0o666 & ~_UMASK)
    return fd, tmp


def atomic_write(path, data: bytes | str) -> Path:
    """Write `data` to `path` through a temporary file in the same folder and `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path, ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_json(path, obj, **kwargs) -> Path:
    """`atomic_write` of json.dumps(obj, indent=1)."""
    return atomic_write(path, json.dumps(obj, indent=1, **kwargs))


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to `path` for a writer that wants a filename (torch.save,
    savefig); it becomes `path` by `os.replace` when the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path, path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# --- the folder ----------------------------------------------------------------------------------
def check_out_dir(out, flag: str = "--out") -> Path:
    """Raise RunFolderError (one line) unless `out` is, or can become, a writable folder."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise RunFolderError(f"{flag} {str(out)!r} is a file, not a folder (give a folder path)")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise RunFolderError(f"{flag} {str(out)!r} is inside {str(probe)!r}, which is a file")
    try:                                    # a nameless probe file: nothing is left behind
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise RunFolderError(f"{flag} {str(out)!r} is not writable: {str(probe)!r} refuses a new "
                             f"file ({err.strerror})") from None
    return p


def read_manifest(out) -> dict | None:
    """OUT/run.json, or None when there is none (or it is not a manifest)."""
    try:
        data = json.loads((Path(out) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "run_id" in data else None


def _held_outputs(out: Path, patterns) -> list[Path]:
    return sorted({p for pat in patterns for p in out.glob(pat)})


class Run:
    """A started run: `run_id`, `out`, `manifest`; `finish(status)` records how it ended."""

    def __init__(self, out: Path, manifest: dict, lock_fd: int):
        self.out, self.manifest, self._lock_fd = out, manifest, lock_fd
        self.run_id = manifest["run_id"]

    def finish(self, status: str, **extra):
        """Record status ("ok", "failed", "interrupted"), end time and `extra` (e.g. reason: the
        one line that ended the run); release the lock. On a full disk the manifest is
        overwritten in place, without the file list (its blocks are already allocated)."""
        if self._lock_fd is None:
            return
        try:
            self.manifest.update(status=status, finished=_now(), **extra)
            self.manifest["files"] = sorted(str(p.relative_to(self.out)) for p in _files(
                _held_outputs(self.out, self.manifest["outputs"])))
            atomic_json(self.out / MANIFEST, self.manifest, default=str)
        except OSError:
            with contextlib.suppress(OSError):
                _overwrite(self.out / MANIFEST, json.dumps(
                    {k: v for k, v in self.manifest.items() if k != "files"}, default=str))
        finally:
            os.close(self._lock_fd)          # closing the descriptor releases the flock
            self._lock_fd = None


def _overwrite(path: Path, text: str):
    """Write `text` over the file at `path` in place (no new file: a full disk has no room for
    one), then cut it to length. Not atomic: the last resort of `Run.finish`."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, text.encode(), 0)
        os.ftruncate(fd, len(text.encode()))
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(paths):
    for p in paths:
        if p.is_dir():
            yield from (q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
        elif p.is_file():
            yield p


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def continues(out, resume) -> bool:
    """True when the checkpoint `resume` lies inside `out`: a resumed run that continues the
    run OUT holds (its results are replaced, the checkpoints kept)."""
    if not resume:
        return False
    out, resume = Path(out).resolve(), Path(resume).resolve()
    return resume == out or out in resume.parents


def remove_tree(path):
    """Delete `path`: a file, a symbolic link itself (never what it points to), or a folder with
    everything in it (shutil.rmtree, which removes the links inside without following them).
    A path that is not there is fine."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    shutil.rmtree(path) if stat.S_ISDIR(mode) else path.unlink()


def _remove(path: Path, keep: list[Path]):
    """Delete `path` (file, folder or link, `remove_tree`), except `keep` paths inside it and
    their contents."""
    if any(path == k or path in k.parents for k in keep):
        if path.is_dir() and not path.is_symlink() and not any(path == k for k in keep):
            for child in path.iterdir():
                _remove(child, keep)
        return
    remove_tree(path)


def _size(paths) -> int:
    total = 0
    for f in _files(paths):
        with contextlib.suppress(OSError):
            total += f.lstat().st_size
    return total


def _human(nbytes: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:,.0f} {unit}" if unit == "bytes" else f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    return ""


def not_written(out: Path, held: list[Path], manifest: dict | None) -> list[str]:
    """Entries under the result paths `held` that no zerolab run wrote, relative to OUT: files
    the manifest's list (`Run.finish`) lacks - for a run that never finished (no list), files
    older than its start - and every link (a run makes none). Dot-files count as the run's."""
    written, started = set((manifest or {}).get("files", [])), None
    if manifest and "files" not in manifest:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            started = datetime.datetime.fromisoformat(manifest["started"]).timestamp() - 2
    alien = []
    for p in held:
        for q in [p, *(p.rglob("*") if p.is_dir() and not p.is_symlink() else [])]:
            rel = q.relative_to(out).as_posix()
            if q.is_symlink() or not (q.is_dir() or q.name.startswith(".") or rel in written
                                      or (started is not None and q.stat().st_mtime >= started)):
                alien.append(rel)
    return sorted(alien)


def keep_aside(out, held: list[Path]) -> Path:
    """Move the run OUT holds - its manifest and its result paths `held` (entries of OUT) - into
    a new sibling folder OUT.1, or OUT.2, ... (the first number not taken); return that folder
    as OUT was given (runs/compare -> runs/compare.1). Files of OUT that are not the run's stay.
    Raises RunFolderError (one line) when OUT has no parent to hold a sibling (the root)."""
    out = Path(out)
    base = out.resolve()
    if base.parent == base:
        raise RunFolderError(f"--out {str(out)!r} holds an earlier run and has no parent folder "
                             "to keep it in; pass --overwrite to replace it, or choose another --out")
    k = 1
    while True:
        sibling = base.parent / f"{base.name}.{k}"
        try:
            sibling.mkdir()                     # taken atomically: two runs never share one
            break
        except FileExistsError:
            k += 1
    for p in [*held, out / MANIFEST]:
        src = base / p.relative_to(out)
        if os.path.lexists(src):
            shutil.move(str(src), str(sibling / src.name))   # a rename on one file system
    return out.parent / sibling.name if out.name else sibling


def begin_run(out, *, command: str, args: dict, world_size: int, overwrite: bool = False,
              run_id: str | None = None, outputs=None, resume=None, previous: str | None = None,
              echo=None) -> Run:
    """Lock OUT, deal with a run it already holds, write the manifest with status "running";
    return the Run. Raises RunFolderError (one line), ValueError for a bad `previous`.

    previous: what happens to a run OUT holds - "keep" (the default): it moves to OUT.1 (OUT.2,
    ...: `keep_aside`) and `echo` (default: print) says so in one line; "replace" (the default
    with `overwrite=True`): its outputs are deleted; "refuse": RunFolderError. `resume`: the
    checkpoint a resumed run starts from; when it lies inside OUT the run continues OUT's run:
    the earlier results are replaced, the checkpoint folder is kept."""
    previous = previous or ("replace" if overwrite else "keep")
    if previous not in PREVIOUS:
        raise ValueError(f"previous {previous!r} is not one of {', '.join(PREVIOUS)}")
    out = check_out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"--out {str(out)!r} cannot be created ({err.strerror})") from None
    outputs = list(outputs or OUTPUTS.get(command, OUTPUTS["train"]))
    had_lock = os.path.lexists(out / LOCK)
    try:                                # never through a link: it would truncate its target
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        what = ("is a symbolic link (zerolab never makes one); remove it" if err.errno ==
                errno.ELOOP else f"cannot be opened ({err.strerror})")
        raise RunFolderError(f"--out {str(out)!r}: its lock file {LOCK} {what}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunFolderError(f"--out {str(out)!r} is in use by a run that is still going "
                             f"({holder}); wait for it or choose another --out") from None
    try:
        old = read_manifest(out)
        held = _held_outputs(out, outputs + list((old or {}).get("outputs", [])))
        if old or held:
            what = (f"run {old['run_id']} ({old.get('command')}, started {old.get('started')}, "
                    f"{old.get('status')})" if old else f"{len(held)} result path(s) of an earlier run")
            keep = []
            alien = not_written(out, held, old) if previous == "keep" and not continues(
                out, resume) else []
            if alien:
                if not had_lock:                # touching nothing at all
                    os.unlink(out / LOCK)
                more = f" (and {len(alien) - 1} more)" if len(alien) > 1 else ""
                raise RunFolderError(f"--out {str(out)!r}: {alien[0]}{more} sits where zerolab "
                                     f"{command} writes results, and no zerolab run wrote it; "
                                     "nothing was moved: move it out, or choose another --out")
            if continues(out, resume):          # keep the whole checkpoints folder it is in
                src = Path(resume).resolve()
                keep = [src.parent if src.parent.name == "checkpoints" else src]
            elif previous == "refuse":
                raise RunFolderError(f"--out {str(out)!r} holds {what}; pass --overwrite to replace "
                                     "it, or choose another --out")
            elif previous == "keep" and held:      # results to keep (a bare manifest is not)
                size = _size([*held, out / MANIFEST])
                moved = keep_aside(out, held)
                desc = (f"run {old['run_id']} ({old.get('command')}, {old.get('status')})" if old
                        else f"{len(held)} result path(s) of an earlier run")
                (echo or (lambda line: print(line, flush=True)))(
                    f"zerolab {command}: {out} held {desc}; it is now in {moved} "
                    f"({_human(size)}; --overwrite replaces instead of keeping)")
                held = []
            base = out.resolve()                # the folder named, never the entries' links
            for p in held:
                _remove(base / p.relative_to(out), keep)
        run_id = run_id or new_run_id()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        manifest = {"run_id": run_id, "command": command, "argv": sys.argv, "args": args,
                    "world_size": world_size, "started": _now(), "finished": None,
                    "status": "running", "pid": os.getpid(), "host": socket.gethostname(),
                    "versions": versions(), "outputs": outputs}
        atomic_json(out / MANIFEST, manifest, default=str)
    except OSError as err:                  # a full disk, a folder it may not change
        os.close(fd)
        what = describe(err)
        raise RunFolderError(f"--out {str(out)!r}: cannot start the run there: "
                             f"{what[0] if what else err}; {what[1] if what else 'check it'}"
                             ) from None
    except BaseException:
        os.close(fd)
        raise
    return Run(out, manifest, fd)


@contextlib.contextmanager
def start_run(out, **kwargs):
    """`begin_run` as a context manager: status "ok" on success, "interrupted" on
    KeyboardInterrupt / SystemExit, else "failed"."""
    run = begin_run(out, **kwargs)
    try:
        yield run
    except (KeyboardInterrupt, SystemExit):
        run.finish("interrupted")
        raise
    except BaseException as err:
        line = str(err).split("\n")[0] or type(err).__name__
        run.finish("interrupted" if "interrupted" in line or "terminated" in line else "failed",
                   reason=line)
        raise
    run.finish("ok")


def in_use(out) -> bool:
    """True while some run holds OUT's lock (this process's own run included)."""
    try:
        fd = os.open(Path(out) / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# --- reading -------------------------------------------------------------------------------------
def one_run(out, items: list[tuple[Path, dict]], echo=None) -> tuple[str | None, list]:
    """Keep the (path, data) items of one run: the manifest's run id when OUT has a manifest,
    else the only run id present. Says so through `echo` (default: stderr) when files of other
    runs were left out; raises RunFolderError when there is no manifest and several runs are mixed.
    Returns (run_id, kept items)."""
    manifest = read_manifest(out)
    ids = {d.get("run_id") for _, d in items}
    if manifest:
        run_id = manifest["run_id"]
    elif len(ids) <= 1:
        run_id = next(iter(ids), None)
    else:
        raise RunFolderError(f"{str(out)!r} mixes files of {len(ids)} runs and has no {MANIFEST} to "
                             "say which is current; rerun into it with --overwrite")
    kept = [(p, d) for p, d in items if d.get("run_id") == run_id]
    others = len(items) - len(kept)
    say = echo or (lambda s: print(s, file=sys.stderr, flush=True))
    if others:
        say(f"note: {str(out)!r}: read run {run_id} only; {others} file(s) of other runs ignored")
    status = (manifest or {}).get("status")
    if status in ("failed", "interrupted") or (status == "running" and not in_use(out)):
        say(f"note: {str(out)!r}: run {run_id} did not finish (status {status!r})")
    return run_id, kept
