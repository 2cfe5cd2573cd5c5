"""Launching ranks: pick backend and device, build the torchrun command, run it with a timeout.

Idea: the caller (the CLI, a notebook, a lab) never initialises CUDA nor runs a collective: it
starts `python -m torch.distributed.run ...` with its own Python (importing this zerolab wherever
it starts: `preflight.child_env`), streams the output, kills the whole process group on timeout or
interrupt (nothing is left behind), and raises `LaunchError` with the failing rank's traceback.

    from zerolab.run.launch import run_torchrun
    run_torchrun(["--stages", "0,1", "--preset", "nano", "--steps", "2"], nproc=2)
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

from .preflight import child_env, nccl_watch
from .resources import describe, in_output


class LaunchError(RuntimeError):
    """A launch that failed: non-zero exit, timeout or interrupt. `.output` holds the last lines."""

    def __init__(self, message: str, output: str = "", *, ran_out: tuple[str, str] | None = None):
        super().__init__(message + (f"\n--- last output of the ranks ---\n{output}" if output else ""))
        self.output = output
        self.ran_out = ran_out      # (what ran out, what to do) when that is why it failed


#: how a rank program starts the one line that says why it stopped (zerolab.run.train prints it)
RANK_ERROR = "zerolab.run.train: error:"


class LaunchInterrupted(LaunchError):
    """The launching process was interrupted (Ctrl-C) or terminated (SIGTERM, SIGHUP)."""


def cuda_device_count() -> int:
    """GPUs torch can see, without creating a CUDA context in this process (NVML count)."""
    try:
        import torch
        return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
    except Exception:  # noqa: BLE001 - a broken driver means "no GPU" for our purposes
        return 0


def resolve(nproc: int, backend: str = "auto", device: str = "auto", nnodes: int = 1,
            gpus: int | None = None) -> tuple[str, str]:
    """(backend, device) for `nproc` ranks per node.

    auto: NCCL on CUDA when this node has at least `nproc` GPUs (one rank per GPU), else gloo on
    CPU. Explicit choices are checked: NCCL needs CUDA and one GPU per rank (it refuses two ranks
    on one GPU: use gloo with --device cuda to share one). Raises ValueError naming the bad value.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc {nproc!r} must be an integer >= 1")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes {nnodes!r} must be an integer >= 1")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not one of auto, gloo, nccl")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {device!r} is not one of auto, cpu, cuda")
    gpus = cuda_device_count() if gpus is None else gpus
    if backend == "nccl" and gpus == 0:
        raise ValueError("backend 'nccl' needs GPUs and none is visible (use backend 'gloo')")
    if backend == "auto":
        backend = "nccl" if device != "cpu" and gpus >= nproc else "gloo"
    if device == "auto":
        device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda" and gpus == 0:
        raise ValueError("device 'cuda' but no GPU is visible (use device 'cpu')")
    if backend == "nccl":
        if device != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda' (use backend 'gloo' on CPU)")
        if nproc > gpus:
            raise ValueError(f"nproc {nproc} is larger than the {gpus} GPU(s) NCCL can use here "
                             "(one rank per GPU); use backend 'gloo' with device 'cuda' to share")
    return backend, device


def auto_note(nproc: int, requested_backend: str, requested_device: str, backend: str,
              device: str, gpus: int | None = None) -> str:
    """One line when "auto" ran on the CPU although GPUs are visible (too few for one NCCL rank
    each): what was chosen and how to share the GPU(s) instead; "" otherwise."""
    gpus = cuda_device_count() if gpus is None else gpus
    if "auto" not in (requested_backend, requested_device) or device != "cpu" or gpus == 0:
        return ""
    return (f"auto chose {backend} on CPU: {gpus} GPU(s) visible, but NCCL needs one GPU per rank "
            f"and {nproc} rank(s) were asked for; to share the GPU(s) use backend gloo with device "
            "cuda (--backend gloo --device cuda)")


def torchrun_command(module_args: list[str], nproc: int, *, module: str = "zerolab.run.train",
                     nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "zerolab") -> list[str]:
    """The argv that starts torchrun. One node: `python -m zerolab.run.launch --standalone
    --local-addr 127.0.0.1 ...`, i.e. torchrun with its stores on loopback only (see
    `loopback_torchrun`). Several nodes: `python -m torch.distributed.run` with the static
    rendezvous at `rdzv_endpoint` (host:port of node 0): global rank = node_rank x nproc + local
    rank, so each node writes the same rank files every time (c10d would ignore --node-rank and
    number the nodes in order of arrival); its port must be reachable inside the cluster only.
    An endpoint on loopback (several launchers on one machine) uses the loopback wrapper too."""
    if nnodes == 1 and rdzv_endpoint is None:
        return [sys.executable, "-m", "zerolab.run.launch", "--nproc-per-node", str(nproc), "--standalone",
                "--local-addr", "127.0.0.1", "-m", module, *module_args]
    if not rdzv_endpoint:
        raise ValueError("several nodes need rdzv_endpoint HOST:PORT (the first node's address)")
    loopback = _is_loopback(rdzv_endpoint.rsplit(":", 1)[0].strip("[]"))
    cmd = [sys.executable, "-m", "zerolab.run.launch" if loopback else "torch.distributed.run",
           "--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
           "--rdzv-backend", "static", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return cmd + (["--local-addr", "127.0.0.1"] if loopback else []) + ["-m", module, *module_args]


def run(cmd: list[str], *, timeout: float = 600, echo=print, env: dict | None = None,
        tail_lines: int = 60, grace: float = 35.0) -> str:
    """Run `cmd` in its own process group, echoing each output line; return all output.

    Raises LaunchError on a non-zero exit (its message: a rank's one-line `zerolab.run.train: error:`
    when there is one; else one line naming what a process ran out of (`resources.in_output`:
    disk, memory, open files..., `.ran_out` set); else the exit code with the last `tail_lines`
    lines, which hold the failing rank's traceback: a traceback is echoed only then, or when the
    run goes on 10 s after it), on timeout (seconds), on KeyboardInterrupt / SIGTERM / SIGHUP, and when
    torchrun itself dies (e.g. SIGKILLed). In every case every process the command started is
    stopped first (`_stop`): ranks live in sessions of their own, so the launcher tracks them.
    TMPDIR and JUPYTER_RUNTIME_DIR point into a private folder removed afterwards, so neither
    torchrun's `torchelastic_*` folders nor a kernel's connection file outlive the run. ValueError
    (one line): Python 3.10 in a folder that shadows a module (`preflight.child_env`).
    """
    _sweep_private_dirs()
    private = None
    tree = _Tree()
    try:
        private = tempfile.mkdtemp(prefix=f"zerolab-run-{os.getpid()}-")
        env = child_env({**nccl_watch(), **os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": private,
                         "JUPYTER_RUNTIME_DIR": os.path.join(private, "jupyter"), **(env or {})})
        if sys.platform == "linux" and os.path.isdir("/sys/class/net/lo") and "127.0.0.1" in cmd:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")   # all on this machine: gloo on loopback
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True, bufsize=1,
                                preexec_fn=_pdeathsig())
    except BaseException as err:
        if private:
            shutil.rmtree(private, ignore_errors=True)
        why = describe(err) if isinstance(err, Exception) else None
        if why is None:
            raise
        raise LaunchError(f"{why[0]}: torchrun could not be started, nothing ran; {why[1]}",
                          ran_out=why) from None
    tree.root = proc.pid
    lines, tail = [], collections.deque(maxlen=tail_lines)
    deadline = time.monotonic() + timeout
    previous = {}
    if threading.current_thread() is threading.main_thread():   # SIGTERM / SIGHUP: clean up too
        TERMINATED.clear()
        previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    died_at, said = None, False
    held, held_at = [], 0.0     # a traceback being printed: echoed once it is not explained

    def flush():
        for ln in held:
            echo(ln.rstrip("\n"))
        held.clear()
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if TERMINATED:                      # received, its exception lost on the way
                raise _Terminated(TERMINATED[-1])
            now = time.monotonic()
            tree.scan()
            if held and now > held_at + 10:    # the run went on: it was not its end
                flush()
            if now > deadline:
                _stop(proc, tree, grace)
                flush()
                raise LaunchError(f"timed out after {timeout:g} s (--timeout): every rank was "
                                  f"stopped: {' '.join(cmd[2:])}", "".join(tail))
            if died_at is None and proc.poll() is not None:
                died_at = now                   # torchrun is gone: its ranks must go too
            if died_at is not None and (proc.returncode < 0 or now > died_at + 10):
                _stop(proc, tree, grace)        # ranks left behind by a killed torchrun
                _drain(proc.stdout, lines, tail, echo)
                break
            if not sel.select(timeout=0.5):
                continue
            line = proc.stdout.readline()
            if not line:
                if proc.poll() is not None:
                    break
                continue
            lines.append(line)
            tail.append(line)
            said |= line.lstrip().startswith(RANK_ERROR)   # a rank said why in one line: it
            if echo and not said and not _noise(line):    # ends the run, torchrun's report of
                if held or _TRACEBACK.match(line):       # the exit would only bury it
                    held_at = held_at if held else now
                    held.append(line)
                else:
                    echo(line.rstrip("\n"))
        proc.wait()
    except (KeyboardInterrupt, _Terminated) as err:
        _stop(proc, tree, grace)
        flush()
        why = "interrupted" if isinstance(err, KeyboardInterrupt) else f"terminated ({err})"
        raise LaunchInterrupted(f"{why}: all ranks were stopped", "".join(tail)) from None
    finally:
        if proc.poll() is None or tree.alive():
            _stop(proc, tree, grace)
        proc.stdout.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(private, ignore_errors=True)
    why = in_output("".join(lines)) if proc.returncode > 0 and not said else None
    if why is None and not said:                # not explained in one line: show it all
        flush()
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise LaunchError(f"torchrun was killed by {name}; every rank was stopped: "
                          f"{' '.join(cmd[2:])}", "".join(tail))
    if proc.returncode != 0:
        own = [ln.strip() for ln in lines if ln.lstrip().startswith(RANK_ERROR)]
        if own:                                 # a rank said why in one line: that is the error
            raise LaunchError(own[0].split("error:", 1)[1].strip())
        if why:                                 # died of it before it could say so (an import)
            err = LaunchError(f"{why[0]}, in a rank or in torchrun (exit code {proc.returncode})"
                              f"; {why[1]}", ran_out=why)
            err.output = "".join(tail)
            raise err
        lost = [m for m in _PEER_LOST if m in "".join(tail)]
        peer = (f"; a peer rank went away ({lost[0]!r}): did another node's launcher stop?"
                if lost else "")
        raise LaunchError(f"the ranks exited with code {proc.returncode}{peer}: "
                          f"{' '.join(cmd[2:])}", "".join(tail))
    return "".join(lines)


def run_torchrun(module_args: list[str], nproc: int, *, timeout: float = 600, echo=print,
                 **kwargs) -> str:
    """torchrun_command + run: launch `zerolab.run.train` (or `module=`) on `nproc` local ranks."""
    return run(torchrun_command(module_args, nproc, **kwargs), timeout=timeout, echo=echo)


class _Terminated(Exception):
    """SIGTERM or SIGHUP reached the launching process."""


#: the signals `run` received (SIGTERM / SIGHUP), newest last: also checked in its loop and by a
#: caller between launches (`zerolab labs`), in case the raised _Terminated was swallowed by code
#: it interrupted (seen under heavy load: a lab ran to its timeout, the next one started)
TERMINATED: list[str] = []


def _raise_terminated(signum, _frame):
    TERMINATED.append(signal.Signals(signum).name)
    raise _Terminated(signal.Signals(signum).name)


def linux_prctl():
    """libc's prctl on Linux (a ctypes function), else None."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _pdeathsig():
    """A function for Popen's preexec_fn that asks Linux to send SIGTERM to the child if the
    launcher dies, even by SIGKILL (prctl PR_SET_PDEATHSIG = 1); torchrun then stops its ranks.
    libc is loaded here, in the parent: the forked child only calls it (no dlopen after fork)."""
    prctl = linux_prctl()
    return (lambda: prctl(1, signal.SIGTERM)) if prctl else None


# --- stopping everything a launch started -------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (ppid, start time in clock ticks, state)} from /proc (Linux); {} elsewhere."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


class _Tree:
    """The processes a launch started: torchrun and every descendant seen so far, remembered by
    (pid, start time) so that a rank re-parented after torchrun's death is still ours and a
    recycled pid is never signalled."""

    def __init__(self):
        self.root, self.known, self._last = None, {}, 0.0

    def scan(self, force=False):
        if not force and time.monotonic() - self._last < 1.0:
            return
        self._last = time.monotonic()
        table = _proc_table()
        members = {pid for pid in self.known if pid in table and table[pid][1] == self.known[pid]}
        if self.root in table:
            members.add(self.root)
            self.known.setdefault(self.root, table[self.root][1])
        grew = True
        while grew:
            grew = False
            for pid, (ppid, start, _) in table.items():
                if ppid in members and pid not in members:
                    members.add(pid)
                    self.known.setdefault(pid, start)
                    grew = True

    def alive(self) -> list[int]:
        table = _proc_table()
        return [pid for pid, start in self.known.items()
                if pid in table and table[pid][1] == start and table[pid][2] != "Z"]

    def signal(self, sig):
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _stop(proc: subprocess.Popen, tree: _Tree, grace: float):
    """SIGTERM torchrun (and wake stopped ranks so they can act on theirs), wait up to `grace`
    seconds for torchrun's own shutdown of its ranks, then SIGKILL every process still alive."""
    tree.scan(force=True)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    tree.signal(signal.SIGCONT)
    end = time.monotonic() + grace
    while time.monotonic() < end and (proc.poll() is None or tree.alive()):
        tree.scan()
        if proc.poll() is not None and time.monotonic() > end - grace + 5:
            tree.signal(signal.SIGTERM)     # ranks whose torchrun is gone: ask them directly
        time.sleep(0.1)
    tree.scan(force=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    tree.signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _drain(stream, lines, tail, echo, seconds: float = 2.0):
    """Read what is left in the ranks' pipe (their last words) for up to `seconds`."""
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    end = time.monotonic() + seconds
    while time.monotonic() < end and sel.select(timeout=0.2):
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        tail.append(line)
        if echo and not _noise(line):
            echo(line.rstrip("\n"))


def _sweep_private_dirs():
    """Remove zerolab-run-PID-* temp folders of launchers that died without cleaning up."""
    root = tempfile.gettempdir()
    for entry in os.listdir(root):
        if entry.startswith("zerolab-run-"):
            pid, path = entry.split("-")[2], os.path.join(root, entry)
            try:                                # only real folders of this user: never a link
                st = os.lstat(path)
            except OSError:
                continue
            if (pid.isdigit() and not os.path.exists(f"/proc/{pid}") and os.path.isdir("/proc")
                    and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()):
                shutil.rmtree(path, ignore_errors=True)


def _is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    import ipaddress
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


# --- torchrun with loopback-only rendezvous stores ------------------------------------------------
def loopback_torchrun(argv=None) -> None:
    """`torch.distributed.run` (torchrun), except that a TCPStore server whose host is a loopback
    name listens on 127.0.0.1 only. torch's TCPStore binds every interface (`*:PORT`) whatever
    host it is given, and the store is unauthenticated; a single-node run needs no outside peer.
    The socket is bound here and handed over through TCPStore's `master_listen_fd`."""
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    base = dist.TCPStore

    class TCPStore(base):
        def __init__(self, host_name, port, world_size=None, is_master=False, *args,
                     master_listen_fd=None, **kw):
            if is_master and master_listen_fd is None and _is_loopback(host_name):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind(("127.0.0.1", int(port)))
                except OSError as err:          # torchrun then joins as a client, or says why
                    sock.close()
                    raise RuntimeError(f"cannot listen on 127.0.0.1:{port}: {err}") from None
                sock.listen(512)
                port, master_listen_fd = sock.getsockname()[1], sock.detach()
            super().__init__(host_name, port, world_size, is_master, *args,
                             master_listen_fd=master_listen_fd, **kw)

    dist.TCPStore = c10d_rendezvous_backend.TCPStore = TCPStore
    torchrun.main(argv)


# how a Python traceback starts (torchrun prefixes a rank's lines with "[rank1]: ")
_TRACEBACK = re.compile(r"^(\[rank\d+\]:\s*)?Traceback \(most recent call last\):")
# what gloo / the TCP store report when a rank of another process or node has gone away
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Connection refused")
_NOISE = ("*****", "Setting OMP_NUM_THREADS", "further tune the variable")
# torchrun's log header on a line of its own (its warning's text follows on the next lines)
_BARE_LOG_HEADER = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]\s*$")


def _noise(line: str) -> bool:
    return any(s in line for s in _NOISE) or bool(_BARE_LOG_HEADER.match(line))


if __name__ == "__main__":
    loopback_torchrun()
