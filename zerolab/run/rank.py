"""The rank side of a launch: how a torchrun rank program starts and how it ends.

Idea: every program torchrun starts (`zerolab.run.train`, `zerolab.course.bench`, the demos, the
doctor's probe) runs its `main()` through `rank_entry`, which makes the rank die with its agent
(torchrun) even when the agent is SIGKILLed, lets torchrun report a raising rank's traceback, and
ends the process without interpreter finalization, where gloo's worker threads can abort a rank
that has finished. `setup` initialises the process group from torchrun's environment.

    if __name__ == "__main__":
        from zerolab.run.rank import rank_entry
        rank_entry(main)
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist

from ..comm import Comm
from .launch import linux_prctl


def rank_entry(main) -> None:
    """Run a rank program's `main()` (returns an exit code) and exit.

    First the rank asks Linux for SIGTERM when its parent (torchrun's agent) dies, even by
    SIGKILL, so that no rank trains on without its agent (`die_with_parent`).

    torchrun's `@record` writes a raising rank's traceback where the launcher shows it as the
    root cause. On success the process ends with os._exit after flushing, skipping interpreter
    finalization: there gloo's worker threads can abort an otherwise finished rank with
    "terminate called without an active exception" (pytorch/pytorch#179291), which we saw
    intermittently on torch 2.13 CPU even after destroy_process_group.
    """
    from torch.distributed.elastic.multiprocessing.errors import record
    die_with_parent()
    code = record(main)()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def die_with_parent(sig=signal.SIGTERM) -> None:
    """In a rank: receive `sig` when the parent process dies (Linux PR_SET_PDEATHSIG); exit at
    once if it died before the request was made. No-op elsewhere."""
    prctl = linux_prctl()
    if prctl is None:
        return
    parent = os.getppid()
    prctl(1, sig)
    if os.getppid() != parent:              # re-parented already: the parent is gone
        os._exit(128 + sig)


def check_device(args):
    """Raise ValueError (one line) when --device / --backend cannot run on this machine."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (use --device cpu)")
    if args.backend == "nccl" and args.device != "cuda":
        raise ValueError("--backend nccl needs --device cuda (use gloo on CPU)")


def setup(args):
    """Initialise the process group from torchrun's environment (args.backend, args.device,
    args.timeout in seconds); return (comm.Comm, torch.device). ValueError as check_device."""
    check_device(args)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.backend == "nccl":              # per-op durations from NCCL's own events (comm.py)
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    kwargs = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout), **kwargs)
    return Comm(), device


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port) -> bool:
    """True when `port` (a number or its text) can be bound on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", int(port)))
        except (OSError, ValueError, OverflowError):
            return False
    return True
