"""Helpers for the notebooks and labs: show the package's own code, launch ranks, read results.

Idea: a notebook never keeps a second copy of zerolab's code - it displays the real source with
`show(...)` - and never initialises CUDA or runs a collective in the kernel: `launch(...)` starts
the ranks as a subprocess with the kernel's own Python (torch.distributed.run), streams their
output into the cell, and raises with the failing rank's traceback, killing every rank on error,
timeout or interrupt.

    from zerolab import nb
    nb.show(zerolab.zero2.ZeRO2._grads_ready)
    runs = nb.launch(stages="0,1,2,3", nproc=4, preset="nano", steps=3, out="runs/nb04")
"""
from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

from ..run import job, options
from ..run.folders import check_out_dir
from ..run.launch import auto_note, resolve, run_torchrun
from . import reference
from .results import load_run


def show(obj, *, lines: tuple[int, int] | None = None):
    """Display `obj`'s source (a function, class, method or module) with its file and line."""
    from IPython.display import Markdown, display
    source, start = inspect.getsourcelines(obj)
    start = max(start, 1)                       # a module's source starts at line 1, not 0
    if lines:
        source = source[lines[0]:lines[1]]
        start += lines[0]
    path = inspect.getsourcefile(inspect.unwrap(obj))  # a decorated method's file, not torch's
    short = path[path.rfind("zerolab/"):] if "zerolab/" in path else path
    display(Markdown(f"`{short}`, line {start}:\n\n```python\n{''.join(source).rstrip()}\n```"))


def launch(*, stages="0", nproc=2, preset="nano", steps=3, out="runs/nb", backend="auto",
           device="auto", timeout=600, echo=print, overwrite=True,
           **train_flags) -> dict[int, list[dict]]:
    """Run `zerolab.run.train` on `nproc` local ranks; return {stage: [rank0 json, ...]}.

    train_flags: any option of the ranks (`zerolab.run.options.PROGRAMS["ranks"]`) with
    underscores, e.g. batch_size=8, precision="fp32", zero1_grad_op="reduce_scatter",
    timeline=True, grad_accum=2, zero3_prefetch=False, zero12_gather="before_forward".
    The run owns `out` while it lasts (a lock, a manifest: `zerolab.run.folders`); a run `out`
    already holds is replaced (re-executing a notebook reruns its cells), unless overwrite=False.
    Raises ValueError for bad arguments, a folder in use, or too little memory, before any process
    starts (`zerolab.run.job.check`), and zerolab.run.launch.LaunchError (with the rank's
    traceback) when the run fails.
    """
    if reference.active():              # a class whose launch failed: the committed CPU run
        r0 = load_run(reference.restore(out))
        first = r0[min(r0)][0]
        echo = echo or (lambda _: None)     # echo=None: say nothing, as a launch does
        echo(f"reference results ({first['world_size']} {first['backend']} ranks, preset "
             f"{first.get('preset', '?')}, the reference CPU machine): no ranks launched")
        return r0
    chosen = resolve(nproc, backend, device)
    note = auto_note(nproc, backend, device, *chosen)
    if note and echo:
        echo(note)
    argv = options.argv_for("ranks", stages=str(stages), preset=preset, steps=steps, out=str(out),
                            backend=chosen[0], device=chosen[1], **train_flags)
    args = options.parse("ranks", argv)     # the ranks' own options: a bad one fails here
    args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint = nproc, 1, 0, None
    if train_flags.get("resume"):           # the ranks fill the options from the checkpoint
        check_out_dir(out)
    else:
        job.check(args)
    args.timeout = timeout                  # the launcher's; the ranks keep their own default
    with job.started(args, "train", overwrite=overwrite) as run_id:
        job.start_ranks(args, run_id, *chosen, echo=echo, announce=False, argv=argv)
        return load_run(out)


def use_reference(on: bool = True):
    """From now on `launch` returns the committed CPU reference run for its `out` folder instead
    of starting ranks (zerolab.course.reference); rerun the cell whose launch failed."""
    reference.use_reference(on)


def launch_module(module: str, args: list[str], *, nproc: int, timeout=300, echo=print) -> str:
    """Run any torchrun program (e.g. "zerolab.course.demos.collectives") on `nproc` local CPU ranks."""
    return run_torchrun(list(args), nproc, module=module, timeout=timeout, echo=echo)


def launch_demo(module: str, args: list[str], *, out, nproc: int, timeout=300,
                echo=print) -> list[dict]:
    """Run a demo that writes OUT/rank{r}.json (e.g. "zerolab.course.demos.byom", lab 7) on
    `nproc` local CPU ranks with `--out OUT` added to `args`; return the ranks' JSONs in rank
    order. Rank files an earlier run left in OUT are removed first. In reference mode
    (`use_reference`) no rank starts: the committed run for OUT is copied in instead."""
    out = Path(out)
    if reference.active():
        reference.restore_demo(out)
    else:
        for old in out.glob("rank*.json"):
            old.unlink()
        launch_module(module, [*args, "--out", str(out)], nproc=nproc, timeout=timeout, echo=echo)
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                   key=lambda r: r["rank"])
    if reference.active() and echo:
        echo(f"reference results ({len(ranks)} gloo ranks, the reference CPU machine): no ranks "
             "launched")
    return ranks


KERNEL_NAME = "zerolab-python"


def own_kernel(folder) -> tuple[str, dict]:
    """A Jupyter kernelspec for this very interpreter (sys.executable), so that a notebook runs
    where zerolab is installed whatever `python3` kernelspecs the machine has.

    Writes FOLDER/kernels/zerolab-python/kernel.json and returns (kernel name, environment):
    the environment is os.environ with FOLDER first on JUPYTER_PATH. Give both to papermill
    (`-k NAME`, run with that environment); nbval gets the same from `--nbval-current-env`.
    """
    spec = Path(folder) / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"zerolab ({sys.executable})", "language": "python"}))
    path = os.pathsep.join(p for p in (str(Path(folder).resolve()),
                                       os.environ.get("JUPYTER_PATH")) if p)
    return KERNEL_NAME, {**os.environ, "JUPYTER_PATH": path}
