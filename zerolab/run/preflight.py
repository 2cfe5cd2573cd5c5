"""Checks of this machine made before any rank starts: the data file, the rendezvous endpoint,
and whether one step can fit in memory (the options' own values: `options.check`). Each raises
ValueError with one line naming the bad value and what is accepted, so that `zerolab` exits 2
within a second instead of failing inside a rank minutes later.

    check_data_path("corpus.txt")
    check_rdzv_endpoint("10.0.0.1:29500")
    check_fits_memory(get_config("tiny"), batch_size=8, nproc=2, world_size=2, grad_accum=1)
"""
from __future__ import annotations

import errno
import socket
import stat
from pathlib import Path

_KINDS = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a directory"}


def check_data_path(path) -> Path:
    """`path` as a Path, unless it is missing, not a regular file (FIFO, device, socket, folder:
    never opened, so a FIFO cannot block) or unreadable."""
    p = Path(path)
    hint = "give a readable text file, or omit --data to use the standard library sources"
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"data file {str(path)!r} does not exist ({hint})") from None
    except OSError as err:
        raise ValueError(f"data file {str(path)!r} cannot be read: {err.strerror} ({hint})") from None
    for test, kind in _KINDS.items():
        if test(mode):
            raise ValueError(f"data file {str(path)!r} is {kind}, not a regular file ({hint})")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as err:
        raise ValueError(f"data file {str(path)!r} is not readable: {err.strerror} ({hint})") from None
    return p


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError for anything else."""
    host, sep, port = str(endpoint).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--rdzv-endpoint {endpoint!r} must look like HOST:PORT with a port "
                         "1-65535 (the first node's address)")
    return host, int(port)


def check_rdzv_endpoint(endpoint: str, probe_seconds: float = 2.0) -> tuple[str, int]:
    """(host, port) of a torchrun rendezvous endpoint, unless the host does not resolve, or the
    port is on this machine and held by a program that is not a torch rendezvous store (torchrun
    would wait silently until its timeout)."""
    host, port = parse_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: host {host!r} does not resolve "
                         f"({reason})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(addr)
            return host, port                   # free here: torchrun can host the store
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return host, port               # another machine's address: nothing to check here
    if not _is_rendezvous_store(host, port, probe_seconds):
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: port {port} is already held by another "
                         "program (not a torch rendezvous store); choose a free port")
    return host, port


def _is_rendezvous_store(host: str, port: int, seconds: float) -> bool:
    """Whether a TCPStore client can set and get a key at host:port within `seconds` (after
    importing torch). Run in a child process that is killed then: against a listener that is not a
    store, the client's handshake waits without honouring its own timeout."""
    import subprocess
    import sys
    code = ("import datetime, sys, torch.distributed as d; print('ready', flush=True); "
            f"s = d.TCPStore({host!r}, {port}, is_master=False, "
            f"timeout=datetime.timedelta(seconds={seconds})); "
            "s.set('zerolab_probe', '1'); sys.exit(0 if s.get('zerolab_probe') == b'1' else 1)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdout.readline()              # torch imported: now the probe itself
        return proc.wait(timeout=seconds) == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# --- memory ----------------------------------------------------------------------------------------
def activation_bytes(cfg, rows: int, precision: str = "bf16") -> int:
    """Bytes of activations one forward saves for backward on `rows` sequences of cfg.block_size
    tokens, per Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", eq. 1: s·b·h·(34 + 5·a·s/h) per layer at 2 bytes per element), scaled to the element
    size, plus the logits (model dtype), their fp32 copy for the loss and its gradient."""
    es = 2 if precision == "bf16" else 4
    s, b, h, a = cfg.block_size, rows, cfg.n_embd, cfg.n_head
    per_layer = s * b * h * (34 + 5 * a * s / h) * es / 2
    logits = b * s * cfg.vocab_size * (es + 4 + 4)
    return int(cfg.n_layer * per_layer + logits)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_memory(cfg, *, batch_size: int, nproc: int, world_size: int, grad_accum: int,
                      stages=(0,), precision: str = "bf16", device: str = "cpu",
                      available: int | None = None) -> int:
    """Estimated bytes per rank (activations of one micro-batch + model states of the largest
    stage); ValueError when the `nproc` ranks on this node (CPU) cannot hold them in the memory
    available. CUDA memory is not checked here (asking would initialise CUDA in this process)."""
    import torch

    from .. import theory
    from ..model import GPT, num_params
    rows = batch_size // (world_size * grad_accum)
    with torch.device("meta"):
        psi = num_params(GPT(cfg))
    states = max(theory.model_state_total(psi, world_size, s, precision) for s in stages)
    acts = activation_bytes(cfg, rows, precision)
    need = acts + states
    available = available_bytes() if available is None else available
    if device == "cpu" and available and need * nproc > available:
        raise ValueError(
            f"--batch-size {batch_size}: each rank needs about {acts / 1e9:,.3g} GB of activations "
            f"({rows} rows of {cfg.block_size} tokens) + {states / 1e9:.3g} GB of model states, "
            f"x {nproc} rank(s) = {need * nproc / 1e9:,.3g} GB, but {available / 1e9:.3g} GB is "
            "available; lower --batch-size or raise --grad-accum")
    return need
