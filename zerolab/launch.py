"""Launching ranks: pick backend and device, build the torchrun command, run it with a timeout.

Idea: the caller (the CLI, a notebook, a lab) never initialises CUDA itself and never runs a
collective: it starts `python -m torch.distributed.run ...` as a subprocess with its own Python,
streams the ranks' output, and kills the whole process group on timeout or interrupt, so nothing
is left behind. A failed run raises `LaunchError` whose message ends with the failing rank's
traceback (torchrun prints it, thanks to `@record` in zerolab.train).

    from zerolab.launch import run_torchrun
    run_torchrun(["--stages", "0,1", "--preset", "nano", "--steps", "2"], nproc=2)
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time


class LaunchError(RuntimeError):
    """A launch that failed: non-zero exit, timeout or interrupt. `.output` holds the last lines."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message + (f"\n--- last output of the ranks ---\n{output}" if output else ""))
        self.output = output


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


def torchrun_command(module_args: list[str], nproc: int, *, module: str = "zerolab.train",
                     nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "zerolab") -> list[str]:
    """The `python -m torch.distributed.run ...` argv: --standalone on one node, else the static
    rendezvous at `rdzv_endpoint` (host:port of node 0): global rank = node_rank x nproc +
    local rank, so each node writes the same rank files every time (c10d would ignore
    --node-rank and number the nodes in order of arrival)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise ValueError("several nodes need rdzv_endpoint HOST:PORT (the first node's address)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return cmd + ["-m", module, *module_args]


def run(cmd: list[str], *, timeout: float = 600, echo=print, env: dict | None = None,
        tail_lines: int = 60) -> str:
    """Run `cmd` in its own process group, echoing each output line; return all output.

    Raises LaunchError on a non-zero exit (with the last `tail_lines` lines, which hold the
    failing rank's traceback), on timeout (seconds) and on KeyboardInterrupt; in every case
    the whole process group is killed first.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, bufsize=1,
                            preexec_fn=_pdeathsig())
    lines, tail = [], collections.deque(maxlen=tail_lines)
    deadline = time.monotonic() + timeout
    previous = {}
    if threading.current_thread() is threading.main_thread():   # SIGTERM / SIGHUP: clean up too
        previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if time.monotonic() > deadline:
                _kill(proc)
                raise LaunchError(f"timed out after {timeout:.0f} s: {' '.join(cmd[2:])}",
                                  "".join(tail))
            if not sel.select(timeout=0.5):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                if proc.poll() is not None:
                    break
                continue
            lines.append(line)
            tail.append(line)
            if echo and not _noise(line):
                echo(line.rstrip("\n"))
        proc.wait()
    except (KeyboardInterrupt, _Terminated) as err:
        _kill(proc)
        why = "interrupted" if isinstance(err, KeyboardInterrupt) else f"terminated ({err})"
        raise LaunchError(f"{why}: all ranks were stopped", "".join(tail)) from None
    finally:
        if proc.poll() is None:
            _kill(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if proc.returncode != 0:
        lost = [m for m in _PEER_LOST if m in "".join(tail)]
        peer = (f"; a peer rank went away ({lost[0]!r}): did another node's launcher stop?"
                if lost else "")
        raise LaunchError(f"the ranks exited with code {proc.returncode}{peer}: "
                          f"{' '.join(cmd[2:])}", "".join(tail))
    return "".join(lines)


def rank_entry(main) -> None:
    """Run a rank program's `main()` (returns an exit code) and exit.

    torchrun's `@record` writes a raising rank's traceback where the launcher shows it as the
    root cause. On success the process ends with os._exit after flushing, skipping interpreter
    finalization: there gloo's worker threads can abort an otherwise finished rank with
    "terminate called without an active exception" (pytorch/pytorch#179291), which we saw
    intermittently on torch 2.13 CPU even after destroy_process_group.
    """
    from torch.distributed.elastic.multiprocessing.errors import record
    code = record(main)()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_torchrun(module_args: list[str], nproc: int, *, timeout: float = 600, echo=print,
                 **kwargs) -> str:
    """torchrun_command + run: launch `zerolab.train` (or `module=`) on `nproc` local ranks."""
    return run(torchrun_command(module_args, nproc, **kwargs), timeout=timeout, echo=echo)


class _Terminated(Exception):
    """SIGTERM or SIGHUP reached the launching process."""


def _raise_terminated(signum, _frame):
    raise _Terminated(signal.Signals(signum).name)


def _pdeathsig():
    """A function for Popen's preexec_fn that asks Linux to send SIGTERM to the child if the
    launcher dies, even by SIGKILL (prctl PR_SET_PDEATHSIG = 1); torchrun then stops its ranks.
    libc is loaded here, in the parent: the forked child only calls it (no dlopen after fork)."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)


# what gloo / the TCP store report when a rank of another process or node has gone away
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Connection refused")
_NOISE = ("*****", "Setting OMP_NUM_THREADS", "further tune the variable")


def _noise(line: str) -> bool:
    return any(s in line for s in _NOISE)


def _kill(proc: subprocess.Popen):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
