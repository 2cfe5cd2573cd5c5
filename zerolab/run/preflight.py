"""Checks of this machine made before any rank starts: the data file, the rendezvous endpoint,
the cores, and the memory figures whether one step fits uses (`fit.check_fits`; the options'
own values: `options.check`); and the environment every launched process gets (`child_env`,
`nccl_watch`). Each check raises
ValueError with one line naming the bad value and what is accepted, so that `zerolab` exits 2
within a second instead of failing inside a rank minutes later.

    check_data_path("corpus.txt")
    check_rdzv_endpoint("10.0.0.1:29500")
    activation_bytes(get_config("tiny"), rows=4)    # Korthikanti et al.'s estimate, bytes
"""
from __future__ import annotations

import contextlib
import errno
import importlib.machinery
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
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
    store, the client's handshake waits without honouring its own timeout. The child imports
    this torch and zerolab wherever it starts (`child_env`: a torch.py here is not taken)."""
    code = ("import datetime, sys, torch.distributed as d; print('ready', flush=True); "
            f"s = d.TCPStore({host!r}, {port}, is_master=False, "
            f"timeout=datetime.timedelta(seconds={seconds})); "
            "s.set('zerolab_probe', '1'); sys.exit(0 if s.get('zerolab_probe') == b'1' else 1)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=child_env(os.environ))
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


# --- cores ---------------------------------------------------------------------------------------
#: ranks per CPU core: up to QUIET_PER_CORE nothing is said (the README's `zerolab compare`: 4
#: ranks on a 2-core laptop), up to MAX_PER_CORE one line warns, beyond that the run is refused.
#: Measured on 2 cores (nano, 2 steps): 2 ranks 10 s, 4 ranks 13 s, 8 ranks 25 s, 16 ranks 51 s -
#: each rank beyond the cores adds ~2.6 s of starting alone (a process that imports torch)
QUIET_PER_CORE, MAX_PER_CORE = 2, 8
#: seconds of a core that starting one rank costs (torch's import, the rendezvous; measured above)
START_PER_RANK = 2.6


def cgroup_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's control group in cores (a container's `docker run
    --cpus 2`: 2.0), from cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us;
    None when there is no quota (or no cgroup file to read)."""
    base = Path(root)
    try:
        quota, period = (base / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask (a Slurm task's or taskset's share,
    else os.cpu_count()), lowered to a container's CPU quota (`cgroup_cpus`, rounded up)."""
    import math
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpus()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def check_cores(nproc: int, device: str = "cpu", cores: int | None = None,
                flag: str = "--nproc") -> str:
    """"" when `nproc` ranks on this node fit its cores (at most QUIET_PER_CORE per core), a
    one-line warning up to MAX_PER_CORE per core, ValueError (one line: the cores and the accepted
    range) beyond. Every rank is a process of its own whatever the device, so `device` only
    words the advice."""
    cores = usable_cores() if cores is None else cores
    most, quiet = MAX_PER_CORE * cores, QUIET_PER_CORE * cores
    if nproc > most:
        larger = ("use `zerolab whatif --world-size N` (one rank of a fake world of N) or more "
                  "nodes (--nnodes)")
        raise ValueError(f"{flag} {nproc} is more than {MAX_PER_CORE} ranks per CPU core: this "
                         f"process may use {cores} core(s), so {flag} 1-{most} is accepted here "
                         f"(1-{quiet} runs at full pace); for a larger world {larger}")
    if nproc > quiet:
        return (f"{flag} {nproc} puts {nproc / cores:.2g} ranks on each of the {cores} CPU "
                f"core(s): it runs, slowly (starting each rank takes ~{START_PER_RANK:g} s of a "
                f"core); {flag} 1-{quiet} runs at full pace" +
                (" (the bytes are the same at any pace)" if device == "cpu" else ""))
    return ""


# --- the children import what this process imported -------------------------------------------
#: Python 3.11+ has PYTHONSAFEPATH: `python -m` and `python -c` then leave the current folder off
#: sys.path (on 3.10 it stays first, and `child_env` refuses a folder that would shadow a module)
SAFE_PATH = sys.version_info >= (3, 11)
#: what the ranks, papermill and the notebooks' kernels import besides the standard library:
#: a file or folder of one of these names (or of a standard module) in the current folder
#: would be imported in their place by `python -m ...` started there (`import_shadows`)
IMPORTED = ("zerolab", "torch", "numpy", "matplotlib", "papermill", "ipykernel", "IPython",
            "jupyter_client", "nbformat", "ipywidgets", "safetensors", "yaml")


def package_root() -> Path:
    """The folder that holds the `zerolab` package this process runs (a checkout's root for an
    editable install, site-packages for a plain one)."""
    return Path(__file__).resolve().parents[2]


def _site_dirs() -> set[Path]:
    import site
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    with contextlib.suppress(Exception):
        dirs.append(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs}


def child_env(env: dict) -> dict:
    """`env` for a process a launch starts (torchrun and its ranks, papermill and its kernels),
    so that it imports the very zerolab this process imported, wherever it is started from:
    PYTHONSAFEPATH=1 (Python 3.11+: `python -m` does not put the current folder first on
    sys.path, where a checkout's `zerolab/` folder, a learner's `torch.py` or `random.py` would be
    imported instead), and the folder holding this zerolab (`package_root`) first on PYTHONPATH,
    unless it is a site-packages folder (every child finds it there anyway; first, it would put
    every installed package ahead of the standard library). Returns a new dict. On Python 3.10,
    which cannot keep the current folder off a child's sys.path, a current folder that would
    shadow a module (`import_shadows`) is a ValueError, one line."""
    env = dict(env)
    if SAFE_PATH:
        env["PYTHONSAFEPATH"] = "1"
    root = package_root()
    if root not in _site_dirs():
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(root)]
        env["PYTHONPATH"] = os.pathsep.join([str(root), *rest])
    shadows = [] if SAFE_PATH else import_shadows(os.getcwd(), env=env)
    if shadows:
        raise ValueError(shadow_line(shadows, os.getcwd(), launching=True))
    return env


def _module_entry(entry: os.DirEntry) -> tuple[str, str] | None:
    """(module name, "module" | "package" | "namespace") that a folder entry provides to an import
    with its folder on sys.path, or None."""
    if entry.is_dir():
        if not entry.name.isidentifier():
            return None
        init = any(os.path.exists(os.path.join(entry.path, "__init__" + s))
                   for s in importlib.machinery.all_suffixes())
        return entry.name, "package" if init else "namespace"
    for suffix in sorted(importlib.machinery.all_suffixes(), key=len, reverse=True):
        name = entry.name[:-len(suffix)]
        if entry.name.endswith(suffix) and name.isidentifier():
            return name, "module"
    return None


def _find(name: str, search: list[str]):
    """The spec `import name` would use with sys.path = `search`: the meta path in its order, as
    the import system asks it (a namespace package from the path finder ends the search)."""
    for finder in sys.meta_path:
        try:
            if finder is importlib.machinery.PathFinder:
                spec = importlib.machinery.PathFinder.find_spec(name, search)
            elif hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, None)
            else:
                continue
        except Exception:  # noqa: BLE001 - a third-party finder that fails: ask the next one
            continue
        if spec is not None:
            return spec
    return None


def _where(spec) -> list[Path]:
    """The files or folders a spec imports from."""
    if spec is None:
        return []
    places = list(spec.submodule_search_locations or [])
    if spec.origin and spec.origin not in ("built-in", "frozen") and not places:
        places = [spec.origin]
    return [Path(p).resolve() for p in places]


def fresh_python(folder, env: dict | None = None) -> tuple[list[str], set[str]]:
    """(sys.path, the modules already imported) of a Python started in `folder` with `python -c`
    and the environment `env` (default: this one without PYTHONSAFEPATH, as a user's shell has
    it): '' (the folder) first on the path, then PYTHONPATH, the standard library,
    site-packages and their .pth entries; a module imported while starting (by site and the .pth
    files: os, often re, pathlib, random ...) is taken from there, whatever the folder holds.
    Asked of such a Python (stdlib only, ~0.1 s): this process's may differ (pytest, a kernel)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = "import json, sys; print(json.dumps([sys.path, sorted(sys.modules)]))"
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, timeout=60,
                             capture_output=True, text=True)
        path, loaded = json.loads(res.stdout)
        return path, set(loaded) - {"json", "json.decoder", "json.scanner", "json.encoder"}
    except (OSError, ValueError, subprocess.SubprocessError):
        return ["", *sys.path[0 if sys.flags.safe_path else 1:]], set(sys.builtin_module_names)


def import_shadows(folder, names=None, env: dict | None = None) -> list[tuple[str, Path, str]]:
    """What Python started in `folder` with `python -m` or `-c` (which put the folder first on
    sys.path) would import from `folder` instead of what it imports elsewhere: [(module name,
    the file or folder in `folder`, where the module is otherwise found or "nowhere")], by name.

    names: the modules checked (default: the standard library's, sys.stdlib_module_names, and
    IMPORTED). env: that Python's environment (`fresh_python`; e.g. a child's PYTHONPATH). A
    module that Python imports while starting, a builtin or frozen one, or one a finder ahead of
    the path finder provides cannot be shadowed; a folder without __init__.py (a namespace
    package) shadows only a module that no regular file on the path provides, e.g. one from a
    setuptools editable install (`pip install -e .`, found by a finder after the path finder).
    The folder's own entry is no shadow when it is what is imported anyway (a checkout's root
    holding the installed zerolab). Never raises: an unreadable folder shadows nothing.
    """
    folder = Path(folder).resolve()
    names = {*IMPORTED, *sys.stdlib_module_names} if names is None else set(names)
    try:
        entries = [e for e in os.scandir(folder) if (_module_entry(e) or ("",))[0] in names]
    except OSError:
        return []
    if not entries:
        return []
    path, loaded = fresh_python(folder, env)
    first = [str(folder) if p == "" else p for p in path]
    search = [p for p in path if p and Path(p).resolve() != folder]
    found = {}
    for entry in entries:
        name = _module_entry(entry)[0]
        if name in found or name in loaded:
            continue
        here = _where(_find(name, first))
        if not any(p == folder or folder in p.parents for p in here):
            continue                            # imported from elsewhere even with it first
        elsewhere = _where(_find(name, search))
        if elsewhere and elsewhere == here:
            continue                            # it is the module imported anyway
        found[name] = (name, Path(entry.path), str(elsewhere[0]) if elsewhere else "nowhere")
    return [found[n] for n in sorted(found)]


def shadow_line(shadows, folder, launching: bool = False) -> str:
    """One line for `import_shadows`' findings in `folder`: what shadows what, where the real
    module is (zerolab's, else the first), and the fix."""
    def kind(p: Path) -> str:
        if not p.is_dir():
            return p.name
        return f"{p.name}/" + ("" if (p / "__init__.py").exists() else " (no __init__.py)")
    name, _, where = next((s for s in shadows if s[0] == "zerolab"), shadows[0])
    checkout = next((p for _, p, _ in shadows if (p / "zerolab" / "__init__.py").is_file()), None)
    other = next((p for n, p, _ in shadows if n == "zerolab" and (p / "__init__.py").is_file()
                  and (p.parent / "pyproject.toml").is_file()), None)
    if checkout:
        fix = f"cd {checkout} (the checkout's root, where the README's commands run)"
    elif other:                             # the root of a checkout that is not the one installed
        fix = f"pip install -e {other.parent} to use this checkout, or cd to another folder"
    else:
        fix = "cd to another folder, or rename " + ("it" if len(shadows) == 1 else "them")
    who = ("a launch's processes would import" if launching else
           "`python -m`, `python -c` and kernels started here import")
    line = (f"the current folder {folder} holds {', '.join(kind(p) for _, p, _ in shadows)}, which "
            f"{who} instead of the installed {'module' if len(shadows) == 1 else 'ones'} "
            f"({name} is found at {where})")
    if launching:
        line += (f"; Python {sys.version_info.major}.{sys.version_info.minor} puts the current "
                 "folder first, 3.11+ does not")
    elif SAFE_PATH:
        line += "; zerolab's own launches are safe, their children skip the current folder"
    return f"{line}: {fix}"


#: where the NCCL flight recorder writes each rank's last collectives when one times out (one file
#: per rank, nccl_trace_rank_<r>); read them with `torchfrtrace FOLDER`
TRACE_DIR = os.path.join(tempfile.gettempdir(), "zerolab-nccl-traces")


def nccl_watch() -> dict[str, str]:
    """What torch offers to find a stuck NCCL collective, for every launch (a variable the user
    set wins): on a timeout the watchdog names the ranks out of step (TORCH_NCCL_DESYNC_DEBUG),
    and each rank's flight recorder - its last 2000 collectives, with sizes, states and stacks
    (TORCH_FR_BUFFER_SIZE) - is written to TRACE_DIR (TORCH_NCCL_DUMP_ON_TIMEOUT). The
    timeout itself is the run's --timeout (seconds), given to init_process_group. gloo ignores
    them all (zerolab.loop.order watches gloo)."""
    with contextlib.suppress(OSError):
        os.makedirs(TRACE_DIR, exist_ok=True)
    return {"TORCH_NCCL_DESYNC_DEBUG": "1", "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(TRACE_DIR, "nccl_trace_rank_")}
