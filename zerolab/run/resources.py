"""Running out of something - disk, memory, open files, processes, ports - said in one line.

Idea: a run that meets the end of a resource says which one, what it kept and what to do, in
one line, and its manifest (OUT/run.json) records how it ended - never a traceback whose cause
is on its last line. `describe(err)` names the resource behind an exception, following its cause
and context (torch.save reports a full disk as "unexpected pos ..."; the OSError is its cause);
`ResourceError` is the one-line error (a ValueError: every door prints those as one line);
`in_output(text)` finds the resource in a rank's last words when the rank died before it could
say it itself (a MemoryError while importing torch, an agent out of file descriptors).

    except Exception as err:
        why = describe(err)
        if why is None:
            raise
        raise ResourceError(f"{why[0]}; {kept}; {why[1]}") from None
"""
from __future__ import annotations

import errno
import re
import resource

_DISK = "free space there (or choose another --out), then rerun or resume"
_MEMORY = ("give the run more memory (raise `ulimit -v`, close other programs), or use fewer "
           "ranks (--nproc), a smaller --preset or --batch-size")
_FILES = "raise the open-file limit (`ulimit -n 1024`), or use fewer ranks (--nproc)"
_PROCS = "raise the process limit (`ulimit -u`), or use fewer ranks (--nproc)"
_PORTS = "choose another port (or unset it to let zerolab pick one), or wait for its holder to end"


class ResourceError(ValueError):
    """A run ran out of disk, memory, open files, processes or ports: one line."""


def _limit(which, unit: int = 1, suffix: str = "") -> str:
    soft = resource.getrlimit(which)[0]
    return "" if soft == resource.RLIM_INFINITY else f"{soft // unit}{suffix}"


def _memory_limit() -> str:
    limit = _limit(resource.RLIMIT_AS, 1 << 20, " MiB")
    return f"; the address-space limit (ulimit -v) is {limit}" if limit else ""


def _file_of(err) -> str:
    name = getattr(err, "filename", None)
    return f": {name}" if name else ""


def _one(err) -> tuple[str, str] | None:
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return f"out of memory ({type(err).__name__}{_memory_limit()})", _MEMORY
    if isinstance(err, OSError):
        code = err.errno
        if code in (errno.ENOSPC, errno.EDQUOT):
            what = "disk full" if code == errno.ENOSPC else "disk quota exceeded"
            return f"{what} ({err.strerror}{_file_of(err)})", _DISK
        if code == errno.ENOMEM:
            return f"out of memory ({err.strerror}{_memory_limit()})", _MEMORY
        if code == errno.EMFILE:
            return (f"out of open files (this process's limit, `ulimit -n`, is "
                    f"{_limit(resource.RLIMIT_NOFILE)})"), _FILES
        if code == errno.ENFILE:
            return "out of open files (the whole system's table is full)", _FILES
        if code == errno.EAGAIN:              # fork / clone: no process or thread left
            return f"out of processes or threads ({err.strerror})", _PROCS
        if code == errno.EADDRINUSE:
            return f"the port is already in use ({err.strerror})", _PORTS
    if isinstance(err, RuntimeError):       # torch's C++ allocator, threads
        return in_output(str(err))
    return None


def describe(err: BaseException) -> tuple[str, str] | None:
    """(what ran out, what to do) when `err`, its cause or its context is running out of a
    resource; None otherwise. Any error raised while this process's address space reached
    its limit (`ulimit -v`) counts as out of memory: there Python fails in odd ways
    (SystemError "error return without exception set" from an import)."""
    seen, first = set(), err
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        found = _one(err)
        if found:
            return found
        err = err.__cause__ or err.__context__
    if first is not None and near_memory_limit():
        return (f"out of memory ({type(first).__name__} with the address space at its "
                f"limit{_memory_limit()})"), _MEMORY
    return None


def vm_bytes(field: str = "VmSize") -> int | None:
    """This process's address space (VmSize, or VmPeak) from /proc/self/status; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def near_memory_limit(margin: int = 64 << 20) -> bool:
    """True when an address-space limit is set and this process's peak came within `margin`."""
    soft, peak = resource.getrlimit(resource.RLIMIT_AS)[0], vm_bytes("VmPeak")
    return soft != resource.RLIM_INFINITY and peak is not None and peak + margin >= soft


def open_files_needed(nproc: int) -> int:
    """File descriptors torchrun's agent and each rank need at least: about 25 + nproc measured
    (sockets to the store and the peers, pipes, libraries), with a margin."""
    return 24 + 2 * nproc


def check_open_files(nproc: int):
    """Raise this process's soft open-file limit towards its hard limit when it is below what a
    run of `nproc` ranks needs (the ranks inherit it); ResourceError (one line) when even the
    hard limit is below: the run would die of it or, worse, hang in torchrun's rendezvous."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_files_needed(nproc)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        want = max(need, 1024)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY
                                                    else min(hard, want), hard))
        return
    raise ResourceError(f"out of open files before starting: the limit (ulimit -n) is {hard}, "
                        f"and {nproc} rank(s) need at least {need}: nothing was started or "
                        f"written; {_FILES}")


#: a rank's address space beyond what this process (torch imported) already takes: torch._dynamo,
#: gloo's threads and their stacks, the data (about 250 MiB for preset nano on 2 CPU cores)
RANK_OVERHEAD = 256 << 20


def check_address_space():
    """ResourceError (one line) when the address-space limit (`ulimit -v`) is below what one
    rank needs at least: this process's own (torch imported) plus RANK_OVERHEAD. A rank
    started under it would die of it, in whatever import came last."""
    soft, now = resource.getrlimit(resource.RLIMIT_AS)[0], vm_bytes()
    if soft == resource.RLIM_INFINITY or now is None or soft >= now + RANK_OVERHEAD:
        return
    need = now + RANK_OVERHEAD
    kib = -(-need // (256 << 20)) * (256 << 10)             # rounded up to whole 256 MiB
    raise ResourceError(f"out of memory before starting: the address-space limit (ulimit -v) "
                        f"is {soft >> 20} MiB, and a rank needs at least {need >> 20} MiB "
                        f"(torch alone takes {now >> 20} MiB here): nothing was started or "
                        f"written; raise it (e.g. `ulimit -v {kib}`, or `ulimit -v unlimited`)")


# what a process that died of it prints (its traceback's last lines, torch's C++ messages)
_SIGNS = (("No space left on device", "disk full (No space left on device)", _DISK),
          ("Disk quota exceeded", "disk quota exceeded", _DISK),
          ("Too many open files", "out of open files (Too many open files)", _FILES),
          ("can't start new thread", "out of processes or threads (can't start new thread)",
           _PROCS),
          ("Address already in use", "the port is already in use", _PORTS),
          ("failed to map segment from shared object",
           "out of memory (a library could not be mapped)", _MEMORY),
          ("can't allocate memory", "out of memory (can't allocate memory)", _MEMORY),
          ("Cannot allocate memory", "out of memory (Cannot allocate memory)", _MEMORY),
          ("CUDA out of memory", "out of GPU memory (CUDA out of memory)", _MEMORY),
          ("MemoryError", "out of memory (MemoryError)", _MEMORY))


def in_output(text: str) -> tuple[str, str] | None:
    """(what ran out, what to do) when `text` (a dead process's last output) says it ran out of
    a resource; None otherwise. The first sign in _SIGNS order wins."""
    for sign, what, todo in _SIGNS:
        if sign in text:
            if todo is _MEMORY:
                what = what[:-1] + _memory_limit() + ")"
            return what, todo
    return None
