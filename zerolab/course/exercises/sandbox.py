"""The exercise checker's processes: the learner's code never runs in the process that gives the
verdict, and nothing a check starts outlives it.

Idea: `zerolab check` loads the learner's file and calls its functions in children only - the
judge (`judge`: a fork of this process that loads the file, checks it without ranks and grades
the rank-free exercises) and N gloo ranks (`run_ranks`: forks of multiprocessing's forkserver,
as `zerolab.course.testing.run_ranks`). This process reads what they report and decides, so a
file that exits, hangs or rewrites the checker at import can neither end the check without a
verdict nor make it pass. Each child
- lives in a process group of its own and ends with the checking process, even when that one is
  SIGKILLed: the judge by PR_SET_PDEATHSIG, a rank by a thread watching it (its parent, the
  forkserver, lives on while its children hold the forkserver's pipe); every group is SIGKILLed
  when the call ends for any reason: a report, a timeout, an exception, SIGINT / SIGTERM /
  SIGHUP (those then raise LaunchInterrupted, as zerolab.run.launch does for torchrun);
- records which of the learner's functions runs now and since when (`marked`: a small file this
  process polls) and how often each was called (`calls`). A call longer than `call_timeout`
  seconds is a hang, named by its function; a child that ends without its report ended inside
  the function its file names (or while the learner's file was imported: `marking`);
- ranks only: talks over loopback. The rendezvous store is hosted here on 127.0.0.1 (torch's
  TCPStore server listens on every interface) and gloo uses `lo`, whatever MASTER_ADDR or the
  host name say.

    from zerolab.course.exercises import sandbox
    sandbox.run_ranks(worker, 3, *args, timeout=90, call_timeout=20)   # or raises sandbox.Failed
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import faulthandler
import functools
import inspect
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from ...run.launch import LaunchInterrupted, linux_prctl
from ..testing import RanksFailed

_PRCTL = linux_prctl()          # loaded here, in the parent: a forked child only calls it
MARK = None                     # this child's Mark (None in the checking process)
GRACE_S = 3.0                   # after a child failed: the others' time to report theirs


class Failed(RanksFailed):
    """Children that ended without their report. `.why`: one line; `.ranks`: {rank: report}
    (as RanksFailed; the judge is rank 0); `.hung`: {rank: (function, seconds)} of calls past
    `.call_timeout`; `.exited`: {rank: exit code} of children that ended with neither a report
    nor a traceback (os._exit, a signal); `.marks`: {rank: the learner's function it was in,
    "import" while the learner's file was imported, or ""}; `.judge`: the judge failed."""

    def __init__(self, why, ranks, hung, exited, marks, call_timeout, judge=False):
        super().__init__(why, ranks)
        self.hung, self.exited, self.marks = hung, exited, marks
        self.call_timeout, self.judge = call_timeout, judge


# --- inside a child: what runs, how often -----------------------------------------------------
class Mark:
    """Which of the learner's functions this child runs now (outermost call) and since when, in a
    file of one fixed-size record (`os.pwrite`: survives os._exit and SIGKILL); calls per name."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.depth, self.calls = 0, collections.Counter()

    def enter(self, name: str):
        self.calls[name] += 1
        self.depth += 1
        if self.depth == 1:
            self._write(f"{name}\t{time.monotonic():.3f}")

    def leave(self):
        self.depth -= 1
        if self.depth == 0:
            self._write("")

    def _write(self, text: str):
        os.pwrite(self.fd, text.encode()[:255].ljust(256), 0)


def read_mark(path) -> tuple[str, float] | None:
    """(function, time.monotonic() when its call began) from a child's mark file, or None."""
    try:
        name, _, since = Path(path).read_bytes().decode(errors="replace").strip().partition("\t")
        return (name, float(since)) if name else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def marking(name: str):
    """Record `name` as running in this child while the block runs (no-op in the parent)."""
    if MARK is None:
        yield
        return
    MARK.enter(name)
    try:
        yield
    except SystemExit:                      # the mark stays: where the learner's code exited
        raise
    except BaseException:
        MARK.leave()
        raise
    MARK.leave()


def _wrap(fn, name):
    @functools.wraps(fn)                    # __wrapped__: spy._file finds the learner's file
    def run(*args, **kwargs):
        with marking(name):
            return fn(*args, **kwargs)
    run.zerolab_marked = True
    return run


def marked(functions: dict) -> dict:
    """The learner's {name: function}, each call recorded (`marking`); a class keeps its place
    and has each of its own methods wrapped (as "Class.method")."""
    out = {}
    for fname, fn in functions.items():
        if inspect.isclass(fn):
            for attr, method in list(vars(fn).items()):
                if inspect.isfunction(method) and not getattr(method, "zerolab_marked", False):
                    setattr(fn, attr, _wrap(method, f"{fname}.{attr}"))
            out[fname] = fn
        else:
            out[fname] = _wrap(fn, fname)
    return out


def calls() -> dict:
    """{name: calls so far} in this child ({} in the parent)."""
    return dict(MARK.calls) if MARK is not None else {}


def _started(pid: int):
    """The start time of process `pid` (Linux), None when it is gone or a zombie (a recycled pid
    has another start time); elsewhere "alive" or None."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[19] if fields[0] != "Z" else None
    except (OSError, IndexError):
        return None


def _die_with(pid: int):
    """SIGKILL this child's group once process `pid` (the checking process) is gone."""
    start = _started(pid)

    def watch():
        while _started(pid) == start:
            time.sleep(0.25)
        if os.getpgid(0) == os.getpid():    # its own group: whatever the learner started too
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if start is None:                       # gone before this child started
        os._exit(1)
    threading.Thread(target=watch, name="zerolab-die-with-checker", daemon=True).start()


def _child_setup(folder: Path, tag: str, parent: int, checker: int):
    """First thing in a child: own process group, SIGKILL when the parent or the checking
    process dies, default signal handlers, the mark file and a stack dump on SIGUSR1."""
    global MARK
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    if os.getppid() != parent:              # the parent died before prctl
        os._exit(1)
    if checker != parent:
        _die_with(checker)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    MARK = Mark(folder / f"{tag}.mark")
    stack = open(folder / f"{tag}.stack", "w")  # noqa: SIM115 - open while the child lives
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)


def _report_error(folder: Path, tag: str):
    (folder / f"{tag}.err").write_text(traceback.format_exc())
    sys.stdout.flush()
    os._exit(1)


def _judge_main(fn, folder, parent, args):
    folder = Path(folder)
    _child_setup(folder, "judge", parent, parent)
    try:
        import torch
        torch.set_num_threads(1)            # a fork: as DataLoader's workers (OpenMP after fork)
        out = fn(*args)
        (folder / "judge.json").write_text(json.dumps({"result": out, "calls": calls()}))
    except BaseException:  # noqa: BLE001 - reported to the parent
        _report_error(folder, "judge")
    sys.stdout.flush()
    os._exit(0)


def _rank_main(worker, rank, world_size, port, folder, parent, checker, args):
    import torch
    import torch.distributed as dist
    folder = Path(folder)
    _child_setup(folder, f"rank{rank}", parent, checker)
    try:
        torch.set_num_threads(1)            # several ranks share the cores
        if os.path.isdir("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"      # gloo's own sockets on loopback too
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        try:
            result = worker(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"result": result, "calls": calls()}, folder / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the parent
        _report_error(folder, f"rank{rank}")
    sys.stdout.flush()
    os._exit(0)


# --- in the parent ------------------------------------------------------------------------------
class _Signalled(Exception):
    """SIGTERM or SIGHUP reached the checking process."""


@contextlib.contextmanager
def _signals_raise():
    """While the children run: SIGTERM / SIGHUP raise _Signalled (SIGINT: KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise _Signalled(signal.Signals(signum).name)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _kill(procs):
    for p in procs:
        if p.pid is None or p.exitcode is not None:     # never started, or reaped: its pid may
            continue                                    # belong to another process by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)    # the child's group: whatever it started too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)      # not in its own group yet
    for p in procs:
        p.join(5)


def _supervise(procs, folder: Path, tags, done, timeout: float, call_timeout: float):
    """Wait for `procs` (started) until all ended, one failed (then GRACE_S more), one hung in a
    learner's function or `timeout` passed. Returns (why or None, {index: (function, seconds)}
    of hung calls, the indices still alive then: asked for their stacks, to be killed).
    done(i): child i has reported."""
    deadline, failed_at, why, hung = time.monotonic() + timeout, None, None, {}
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode is not None and (p.exitcode != 0 or not done(i))
                                     for i, p in enumerate(procs)):
            failed_at = now
        for i, p in enumerate(procs):
            mark = read_mark(folder / f"{tags[i]}.mark") if p.is_alive() else None
            if mark and now - mark[1] > call_timeout:
                hung[i] = (mark[0], now - mark[1])
        if hung:
            why = "hung"
            break
        if now > deadline:
            why = f"timed out after {timeout:g} s"
            break
        if failed_at is not None and now > failed_at + GRACE_S:
            why = "a child failed"
            break
        time.sleep(0.05)
    stopped = {i for i, p in enumerate(procs) if p.is_alive()}
    for i in stopped:                           # where is each one stuck?
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[i].pid, signal.SIGUSR1)
    if stopped:
        time.sleep(0.5)
    return why, hung, stopped


def _outcome(procs, folder, tags, done, why, hung, stopped, call_timeout, label):
    """Raise Failed when some child did not report (why is set, or one ended without it)."""
    codes = [p.exitcode for p in procs]
    if why is None and all(c == 0 and done(i) for i, c in enumerate(codes)):
        return
    report, exited, marks = {}, {}, {}
    for i, tag in enumerate(tags):
        err, stack = folder / f"{tag}.err", folder / f"{tag}.stack"
        text = err.read_text() if err.exists() else ""
        if not text and stack.exists() and stack.read_text():
            text = "stack when stopped:\n" + stack.read_text()
        mark = read_mark(folder / f"{tag}.mark")
        marks[i] = mark[0] if mark else ""
        if not err.exists() and not done(i) and i not in stopped:
            exited[i] = codes[i]                # os._exit, a signal, ...
        if not text:
            text = "(finished)" if done(i) else "(no report)"
        report[i] = f"(exit code {codes[i]})\n{text}"
    if why in (None, "a child failed"):
        why = "a rank failed" if label == "ranks" else "the judge failed"
    raise Failed(f"{label}: {why}", report, hung, exited, marks, call_timeout,
                 judge=label == "judge")


@contextlib.contextmanager
def _stopping(procs, what: str):
    """Every child SIGKILLed (with its group) when the block ends; SIGINT / SIGTERM / SIGHUP
    raise LaunchInterrupted naming the signal once they are."""
    try:
        with _signals_raise():
            yield
    except (KeyboardInterrupt, _Signalled) as err:
        _kill(procs)
        how = "interrupted" if isinstance(err, KeyboardInterrupt) else f"terminated ({err})"
        raise LaunchInterrupted(f"{how}: every process of the {what} was stopped") from None
    finally:
        _kill(procs)


def judge(fn, *args, timeout: float = 60.0, call_timeout: float = 20.0):
    """fn(*args) in a fork of this process (see the module docstring): (its JSON result, calls).
    Raises Failed when the child ended without a result (exited, hung, raised, timed out)."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="zerolab-judge-") as tmp:
        folder = Path(tmp)
        proc = ctx.Process(target=_judge_main, args=(fn, tmp, os.getpid(), args), daemon=True)

        def done(_):
            return (folder / "judge.json").exists()
        with _stopping([proc], "check"):
            proc.start()
            why, hung, stopped = _supervise([proc], folder, ["judge"], done, timeout,
                                            call_timeout)
        _outcome([proc], folder, ["judge"], done, why, hung, stopped, call_timeout, "judge")
        answer = json.loads((folder / "judge.json").read_text())
        return answer["result"], answer["calls"]


def run_ranks(worker, world_size: int, *args, timeout: float = 120.0,
              call_timeout: float = float("inf")) -> list[dict]:
    """`worker(rank, world_size, *args)` on `world_size` gloo ranks on loopback; per rank
    {"result": its return value, "calls": {function: calls}}. Raises Failed (a rank raised,
    exited without a result, hung in a learner's function, or `timeout` seconds passed)."""
    import torch
    import torch.distributed as dist

    from ..testing import _context
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="zerolab-ranks-") as tmp:
        folder = Path(tmp)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))             # the store listens on loopback only
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, master_listen_fd=sock.detach(),
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        tags, parent = [f"rank{r}" for r in range(world_size)], _forkserver_pid()
        procs = [ctx.Process(target=_rank_main, args=(worker, r, world_size, port, tmp,
                                                      parent, os.getpid(), args), daemon=True)
                 for r in range(world_size)]

        def done(i):
            return (folder / f"{tags[i]}.pt").exists()
        try:
            with _stopping(procs, "check"):
                for p in procs:
                    p.start()
                why, hung, stopped = _supervise(procs, folder, tags, done, timeout, call_timeout)
        finally:
            del store
        _outcome(procs, folder, tags, done, why, hung, stopped, call_timeout, "ranks")
        return [torch.load(folder / f"{t}.pt", weights_only=True) for t in tags]


def _forkserver_pid() -> int:
    """The pid of multiprocessing's forkserver (the ranks' parent), started if need be."""
    from multiprocessing import forkserver
    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid
