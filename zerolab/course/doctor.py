"""`zerolab doctor`: is this machine ready for the course? One line per check, OK or the fix.

For a learner before a workshop, and for the instructor walking round the room: in well under
30 s it checks the Python, the torch build, that the current folder shadows no module Python
would import (e.g. the clone's parent, which holds the checkout `zerolab/`), that gloo ranks
start under torchrun and exchange an all_reduce, a free local port, that the Jupyter kernel the
notebooks ask for ("python3") runs THIS interpreter (the one zerolab is installed in),
ipywidgets with its JupyterLab extension, JupyterLab itself, and the packages the labs need.
Exit status 0 when every line is OK, else 1.

    zerolab doctor                 # or: python -m zerolab doctor
"""
from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETUP = 'pip install -e ".[cpu,dev]"  (in the zerolab checkout)'


def _ok(text):
    return True, text


def _fix(text):
    return False, text


def check_python():
    v = sys.version_info
    if v < (3, 10):
        return _fix(f"Python {v.major}.{v.minor} is too old: zerolab needs 3.10 or newer")
    return _ok(f"Python {v.major}.{v.minor}.{v.micro} at {sys.executable}")


def check_module(name: str, minimum: str | None = None, fix: str = SETUP):
    """OK with the version when `name` imports (and is >= minimum), else the fix."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return _fix(f"{name} is not installed: {fix}")
    version = getattr(module, "__version__", "?")
    if minimum is not None and version != "?":
        have = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
        want = tuple(int(p) for p in minimum.split("."))
        if have < want:
            return _fix(f"{name} {version} is older than {minimum}: {fix}")
    return _ok(f"{name} {version}")


def check_torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return _fix(f"torch is not installed: {SETUP}")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    if not dist.is_available() or not dist.is_gloo_available():
        return _fix(f"torch {torch.__version__} ({build} build) has no gloo backend: "
                    f"install the CPU build, {SETUP}")
    gpus = torch.cuda.device_count() if torch.version.cuda else 0   # NVML count: no CUDA context
    return _ok(f"torch {torch.__version__} ({build} build, {gpus} GPU(s) visible), gloo available")


def check_zerolab():
    import zerolab
    here = Path(zerolab.__file__).resolve().parent
    return _ok(f"zerolab {zerolab.__version__} from {here}")


def check_here(folder=None):
    """The current folder (or `folder`) holds no file or folder that Python started there would
    import instead of zerolab, a module it needs or a standard module (`preflight.import_shadows`):
    e.g. the clone's parent, which holds the checkout `zerolab/` - a folder that `python -m`
    imports as an empty namespace package, ahead of an editable install."""
    from ..run.preflight import import_shadows, shadow_line
    folder = Path(folder or os.getcwd()).resolve()
    shadows = import_shadows(folder)
    if shadows:
        return _fix(shadow_line(shadows, folder))
    return _ok(f"the current folder ({folder}) shadows no module Python or zerolab imports")


def check_port():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    except OSError as err:
        return _fix(f"cannot open a local TCP port ({err}): gloo ranks talk over 127.0.0.1; "
                    f"check the firewall / sandbox")
    return _ok(f"a free local port ({port}); launches pick their own (torchrun --standalone)")


def check_ranks(nproc: int = 2, timeout: float = 60.0):
    """torchrun starts `nproc` gloo ranks on CPU that all_reduce a tensor (this module, --rank).
    `timeout` (s) is generous: on a loaded 2-core machine starting two ranks took up to ~20 s."""
    from ..run.launch import LaunchError, _noise, run_torchrun
    t0 = time.monotonic()
    try:
        out = run_torchrun(["--rank"], nproc, module="zerolab.course.doctor", timeout=timeout,
                           echo=lambda line: None)
    except LaunchError as err:          # the launcher's reason, then the ranks' last real line
        said = [line for arg in err.args for line in str(arg).splitlines()
                if line.strip() and not _noise(line)]
        last = "; ".join(dict.fromkeys([said[0], said[-1]])) if said else "no output"
        return _fix(f"{nproc} gloo ranks did not start or all_reduce ({last}); rerun "
                    f"`zerolab train --stage 0 --nproc 2 --preset nano --steps 1` to see why")
    if f"all_reduce ok on {nproc} ranks" not in out:
        return _fix(f"the ranks ran but did not report their all_reduce: {out.strip()[-200:]}")
    return _ok(f"{nproc} gloo ranks started under torchrun and all_reduced "
               f"({time.monotonic() - t0:.1f} s)")


def check_kernel(timeout: float = 20.0):
    """The notebooks' kernel ("python3") runs this interpreter and imports this zerolab. It is
    started in an empty temporary folder, as the notebooks' kernels start in notebooks/: what the
    current folder holds is `check_here`'s to tell, not the kernel's fault."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
        from jupyter_client.manager import start_new_kernel
    except ImportError:
        return _fix(f"jupyter_client is not installed: {SETUP}")
    fix = (f"make it this Python's: {sys.executable} -m ipykernel install --user --name python3 "
           f"--display-name 'Python 3 (zerolab)'")
    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        return _fix(f"no 'python3' Jupyter kernel: {fix}")
    code = "import sys, zerolab; print(sys.executable + '|' + zerolab.__file__)"
    km = kc = None
    empty = tempfile.TemporaryDirectory(prefix="zerolab-doctor-")
    try:
        km, kc = start_new_kernel(kernel_name="python3", startup_timeout=timeout,
                                  stderr=subprocess.DEVNULL, cwd=empty.name)
        seen = []
        kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: seen.append(msg))
        text = "".join(m["content"].get("text", "") for m in seen if m["msg_type"] == "stream")
        errors = [m["content"] for m in seen if m["msg_type"] == "error"]
    except Exception as err:  # noqa: BLE001 - any failure to start is the finding
        return _fix(f"the 'python3' kernel ({spec.argv[0]}) did not start: {err}; {fix}")
    finally:
        if kc is not None:
            kc.stop_channels()
        if km is not None:
            km.shutdown_kernel(now=True)
        empty.cleanup()
    if errors:
        return _fix(f"the 'python3' kernel ({spec.argv[0]}) cannot import zerolab "
                    f"({errors[0]['ename']}): {fix}")
    exe, _, path = text.strip().partition("|")
    import zerolab
    if Path(path).resolve() != Path(zerolab.__file__).resolve():
        return _fix(f"the kernel imports another zerolab ({path}, interpreter {exe}): {fix}")
    return _ok(f"the notebooks' kernel 'python3' runs {exe} and imports this zerolab")


def check_widgets():
    ok, text = check_module("ipywidgets", "8.0")
    if not ok:
        return ok, text
    try:
        import jupyterlab_widgets  # noqa: F401 - ships the JupyterLab extension
    except ImportError:
        return _fix(f"ipywidgets' JupyterLab extension (jupyterlab_widgets) is missing: {SETUP}")
    ext = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter-widgets" / "jupyterlab-manager"
    if not ext.is_dir():
        return _fix(f"the widgets extension is not where JupyterLab looks ({ext}): {SETUP}")
    return _ok(f"{text}, with its JupyterLab extension (the calculator's controls)")


def check_jupyterlab():
    ok, text = check_module("jupyterlab", "4.0")
    if ok:
        text += "; open the course with: jupyter lab --notebook-dir=. notebooks/01_welcome.ipynb"
    return ok, text


CHECKS = [
    ("python", check_python),
    ("torch", check_torch),
    ("zerolab", check_zerolab),
    ("here", check_here),
    ("port", check_port),
    ("ranks", check_ranks),
    ("kernel", check_kernel),
    ("widgets", check_widgets),
    ("jupyterlab", check_jupyterlab),
    ("papermill", lambda: check_module("papermill")),
    ("matplotlib", lambda: check_module("matplotlib", "3.7")),
]


def run(checks=CHECKS, echo=print) -> bool:
    """Run every check, print one line each ("OK   ..." or "FIX  ..."); True when all are OK."""
    from concurrent.futures import ThreadPoolExecutor

    def guarded(name, check):
        try:
            return check()
        except Exception as err:  # noqa: BLE001 - a crashing check is a finding, not a traceback
            return False, f"{name}: the check itself failed ({type(err).__name__}: {err})"

    t0, all_ok = time.monotonic(), True
    echo(f"zerolab doctor: {os.cpu_count()} CPU core(s); each line OK or the fix")
    slow = {"ranks", "kernel"}              # subprocesses: run them side by side, in threads
    with ThreadPoolExecutor(max_workers=len(slow)) as pool:
        futures = {name: pool.submit(guarded, name, check) for name, check in checks
                   if name in slow}
        for name, check in checks:
            ok, text = futures[name].result() if name in futures else guarded(name, check)
            all_ok &= ok
            echo(f"{'OK ' if ok else 'FIX'}  {text}")
    echo(f"{'all OK' if all_ok else 'fix the lines marked FIX, then run zerolab doctor again'} "
         f"({time.monotonic() - t0:.1f} s)")
    return all_ok


def main() -> int:
    return 0 if run() else 1


def _rank_main():
    """`python -m zerolab.course.doctor --rank` under torchrun: gloo init + one all_reduce."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert torch.equal(t, torch.full((4,), float(n))), t
    if dist.get_rank() == 0:
        print(f"all_reduce ok on {n} ranks", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if "--rank" in sys.argv:
        from ..run.rank import rank_entry
        rank_entry(_rank_main)
    else:
        sys.exit(main())
