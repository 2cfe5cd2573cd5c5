"""The labs themselves: each lab's parameters, checked before any rank starts, and `zerolab labs`,
which executes every lab notebook with papermill and writes one report.

Idea: a lab notebook (labs/lab*.ipynb) keeps only prose, a `parameters` cell and short calls into
the course's modules - `checks` (measured == formula, and the tables), `results` (reading runs
back), `plots` and `timeplots` - so that each number it prints comes from one place and is checked
against `zerolab.theory` in one place. `check_parameters` stops a lab with one clear line before
any rank starts; `save_summary` hands `zerolab labs` the lab's key numbers for its report.

    zerolab labs                                    # every lab, parameters that fit this machine
    zerolab labs --only memory,traffic -p steps=3   # some labs, with a papermill override
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from ..run import bounds

LAB_DIR = Path(__file__).resolve().parents[2] / "labs"


# --- parameters --------------------------------------------------------------------------------
class LabParameterError(ValueError):
    """A lab parameter no run could use. In a notebook it prints as one line, no traceback."""

    def _render_traceback_(self):          # IPython: show the message only
        return [f"LabParameterError: {self}"]


def _bad(message):
    raise LabParameterError(message)


def _int(name, value):
    """A whole-number lab parameter within its range (`zerolab.run.bounds`)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _within(name, value, whole=True)


def _within(name, value, whole=None):
    """`value` (a number or a list of numbers) within lab parameter `name`'s range
    (`zerolab.run.bounds`), else LabParameterError naming both and the range."""
    try:
        return bounds.check(name, value, whole)
    except ValueError as err:
        _bad(str(err))


def _numbers(default) -> bool:
    """A parameter whose default is a number or a list of numbers (not true / false)."""
    items = default if isinstance(default, list) and default else [default]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items)


def batch_size_for(world_size: int, base: int = 8) -> int:
    """The smallest multiple of `world_size` that is >= `base` (rows of one global batch)."""
    return math.ceil(base / world_size) * world_size


def check_parameters(*, nproc="auto", backend="auto", device="auto", stages="0,1,2,3",
                     preset="nano", steps=2, out=None, world_sizes=None, gpus=None,
                     **extra) -> SimpleNamespace:
    """Check a lab's papermill parameters before any process starts; return them resolved.

    nproc: an int >= 1, or "auto" (one rank per GPU when >= 2 GPUs are usable, else 2 CPU ranks).
    backend / device: "auto", or as zerolab.run.launch.resolve accepts (NCCL needs one GPU per rank).
    stages: "0,1,2,3", a list of ints, or one int. preset: a zerolab.model preset. steps: int >= 1.
    world_sizes (scaling lab): "auto" or a list of ints >= 1. Raises LabParameterError (one line)
    naming the bad value and what is accepted. Returns nproc, backend, device, stages (text),
    stage_list, preset, steps, batch_size, out (Path or None), world_sizes, gpus.
    """
    from ..run.launch import cuda_device_count, resolve
    from ..model import get_config
    from ..run.options import parse_stages

    gpus = cuda_device_count() if gpus is None else gpus
    if nproc == "auto":
        nproc = min(gpus, 8) if (gpus >= 2 and device in ("auto", "cuda")
                                 and backend in ("auto", "nccl")) else 2
    nproc = _int("nproc", nproc)
    steps = _int("steps", steps)
    if isinstance(stages, bool):
        _bad(f"stages = {stages!r} must be text like '0,1,2,3', a list of ints or one int")
    if isinstance(stages, int):
        stages = str(stages)
    elif isinstance(stages, (list, tuple)):
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in stages):
            _bad(f"stages = {stages!r} must hold integers 0-3")
        stages = ",".join(str(s) for s in stages)
    if not isinstance(stages, str):
        _bad(f"stages = {stages!r} must be text like '0,1,2,3', a list of ints or one int")
    try:
        stage_list = parse_stages(stages)
    except ValueError as err:
        _bad(str(err))
    if not isinstance(preset, str):
        _bad(f"preset = {preset!r} must be a preset name (text)")
    try:
        get_config(preset)
    except ValueError as err:
        _bad(str(err))
    if isinstance(world_sizes, str) and world_sizes != "auto":     # "1,2,4" from a command line
        try:
            world_sizes = [int(w) for w in world_sizes.split(",") if w.strip()]
        except ValueError:
            _bad(f"world_sizes = {world_sizes!r} must be 'auto' or a list of integers >= 1")
    if world_sizes in (None, "auto"):
        world_sizes = _auto_world_sizes(nproc, backend, device, gpus) if world_sizes else None
    else:
        if not isinstance(world_sizes, (list, tuple)) or not world_sizes:
            _bad(f"world_sizes = {world_sizes!r} must be 'auto' or a list of integers >= 1")
        world_sizes = [_int("world_sizes", w) for w in world_sizes]
    try:
        for n in sorted({nproc, *(world_sizes or [])}):
            backend_n, device_n = resolve(n, backend, device, gpus=gpus)
            if n == nproc:
                resolved = backend_n, device_n
    except ValueError as err:
        _bad(str(err))
    if out is not None and not isinstance(out, (str, Path)):
        _bad(f"out = {out!r} must be a folder path (text)")
    unknown = ", ".join(sorted(extra))
    if unknown:
        _bad(f"unknown lab parameter(s): {unknown}")
    return SimpleNamespace(nproc=nproc, backend=resolved[0], device=resolved[1], stages=stages,
                           stage_list=stage_list, preset=preset, steps=steps,
                           batch_size=batch_size_for(max([nproc, *(world_sizes or [])])),
                           out=Path(out) if out is not None else None, world_sizes=world_sizes,
                           gpus=gpus)


def _auto_world_sizes(nproc, backend, device, gpus):
    """CPU: 1, 2, 4 ranks (8 CPU ranks on 2 cores take too long for a lab); GPU: powers of two
    up to the GPU count (at most 8)."""
    if gpus >= 2 and device in ("auto", "cuda") and backend in ("auto", "nccl"):
        return [w for w in (1, 2, 4, 8) if w <= gpus]
    return [1, 2, 4]


def describe(p: SimpleNamespace) -> str:
    """One line: what will run."""
    where = f"{p.backend} on {p.device}"
    return (f"{p.nproc} rank(s), {where}, stages {p.stages}, preset {p.preset}, {p.steps} step(s), "
            f"global batch {p.batch_size} rows" + (f", out {p.out}" if p.out else ""))


# --- summaries and the `zerolab labs` report -----------------------------------------------------
def save_summary(out, lab: str, numbers: dict, notes: list[str] | None = None) -> Path:
    """Write OUT/summary.json: the lab's key measured-vs-formula numbers for `zerolab labs`."""
    from ..run.folders import atomic_json, read_manifest
    out = Path(out)
    run_id = (read_manifest(out) or {}).get("run_id")
    return atomic_json(out / "summary.json", {"lab": lab, "run_id": run_id, "numbers": numbers,
                                              "notes": notes or []}, default=float)


def lab_notebooks(labs_dir: Path | None = None, only: str | None = None) -> list[Path]:
    """labs/lab*.ipynb (LAB_DIR, read at call time) in order, filtered by `only` (comma list of
    name fragments)."""
    labs_dir = LAB_DIR if labs_dir is None else labs_dir
    if not labs_dir.is_dir():
        raise FileNotFoundError(f"no labs folder at {str(labs_dir)!r}: run from a zerolab checkout "
                                "(pip install -e .)")
    books = sorted(labs_dir.glob("lab*.ipynb"))
    if only:
        frags = [f.strip() for f in only.split(",") if f.strip()]
        books = [b for b in books if any(f in b.stem for f in frags)]
        if not books:
            raise ValueError(f"--only {only!r} matches no lab in {labs_dir} "
                             f"({', '.join(b.stem for b in sorted(labs_dir.glob('lab*.ipynb')))})")
    return books


def _load(text: str):
    """The value of one -p NAME=VALUE as papermill reads it: YAML's safe loader, dates left as
    text (papermill's NoDatesSafeLoader)."""
    import yaml

    class NoDates(yaml.SafeLoader):
        yaml_implicit_resolvers = {c: [r for r in rs if r[0] != "tag:yaml.org,2002:timestamp"]
                                   for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    return yaml.load(text, Loader=NoDates)


def _not_plain(value) -> str:
    """"" for a number, text, true/false, null, or a list / text-keyed mapping of them: what
    papermill writes into a notebook as a Python literal (anything else - bytes, sets, pairs -
    it pastes in as text that may run as code); else the type of the first part that is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return ""
    if type(value) is list:
        return next(filter(None, map(_not_plain, value)), "")
    if type(value) is dict:
        return next(filter(None, (_not_plain(v) if isinstance(k, str) else type(k).__name__
                                  for k, v in value.items())), "")
    return type(value).__name__


def papermill_yaml(name: str, text: str) -> str:
    """The `-y` argument for papermill: {name: value} written back as one line of plain YAML, so
    that papermill reads exactly the value checked here (data, never code)."""
    import yaml
    return yaml.safe_dump({name: _load(text)}, default_flow_style=True, width=float("inf")).strip()


def _parse_overrides(items) -> list[tuple[str, str]]:
    """[(name, value text)] from "NAME=VALUE" items. papermill writes names and values into the
    parameters cell as code, so a name must be a Python identifier (ASCII), a value one line of
    valid YAML holding plain data (`_not_plain`: a YAML tag such as !!binary or !!set is refused);
    ValueError (one line) otherwise."""
    import yaml
    out = []
    for item in items or []:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"--parameter {item!r} must look like NAME=VALUE with NAME a Python "
                             "identifier (e.g. steps=3)")
        if any(c in value for c in "\r\n\x0b\x0c\x85\u2028\u2029") or not value.isprintable():
            raise ValueError(f"--parameter {name}: the value {value!r} must be one line of "
                             "printable text")
        try:
            data = _load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"--parameter {name}={value!r} is not valid YAML ({problem}); "
                             "quote text, e.g. stages='0,1'") from None
        bad = _not_plain(data)
        if bad:
            raise ValueError(f"--parameter {name}={value!r} holds YAML of type {bad} (a tag such "
                             "as !!binary, !!set or !!omap): a lab parameter is data - a number, "
                             f"text, true/false, null, or a list of them; quote text, e.g. "
                             f"{name}='...'")
        out.append((name, value))
    return out


COMMON = ("nproc", "backend", "device", "stages", "preset", "steps", "world_sizes")


def lab_parameters(book: Path) -> dict:
    """{name: default} of a lab's parameters cell (None where the default is not a literal)."""
    import ast
    cells = json.loads(Path(book).read_text()).get("cells", [])
    source = next(("".join(c.get("source", "")) for c in cells
                   if "parameters" in c.get("metadata", {}).get("tags", [])), "")
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                out[node.targets[0].id] = None
    return out


def _kind(value) -> str:
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true or false"
    return ("a number" if isinstance(value, (int, float)) else "text" if isinstance(value, str)
            else "a list" if isinstance(value, list) else "a mapping")


def _check_overrides(overrides, books=()):
    """Check the overrides before any lab starts, read as papermill reads them: each names a
    parameter of a lab to run (its parameters cell, `lab_parameters`), of the kind of that
    lab's default (a list may also be given as text, "0.1,1"); the ones the labs share with
    `check_parameters`; size_preset a preset. LabParameterError (one line) names the bad one."""
    from ..model import get_config
    values = {name: _load(text) for name, text in overrides}
    cells = {book.stem: lab_parameters(book) for book in books}
    for name, value in values.items():
        having = {lab: d[name] for lab, d in cells.items() if name in d}
        if cells and not having:
            known = sorted({n for d in cells.values() for n in d})
            _bad(f"--parameter {name}: no lab to run has a parameter {name} (theirs: "
                 f"{', '.join(known)})")
        for lab, default in having.items():
            if name not in COMMON and default is not None and _numbers(default):
                numbers = value
                if isinstance(default, list) and isinstance(value, str):   # "0.1,1"
                    numbers = [_load(v) for v in value.split(",") if v.strip()]
                _within(name, numbers, whole=isinstance((default or [0])[0] if isinstance(
                    default, list) else default, int))
            kind, want = _kind(value), _kind(default)
            if name not in COMMON and default is not None and kind != want \
                    and not (want == "a list" and kind == "text"):
                _bad(f"{name} = {value!r} must be {want}, as {lab}'s default {default!r}")
    if "size_preset" in values:
        try:
            get_config(values["size_preset"])
        except (ValueError, TypeError, KeyError) as err:
            _bad(f"size_preset = {values['size_preset']!r}: {str(err).split(' is ', 1)[-1]}")
    common = {name: value for name, value in values.items() if name in COMMON}
    if common:
        check_parameters(**common)


def _error_text(err: Exception) -> str:
    text = str(err)
    hit = [h for h in re.findall(r"(?m)^\s*\w*(?:Error|Exception)\w*:? .*$", text)
           if "ChildFailedError" not in h]
    return hit[-1].strip() if hit else text.strip().splitlines()[-1][:300] if text.strip() else repr(err)


def run_labs(args) -> int:
    """`zerolab labs`: execute each lab with papermill into OUT/, then write OUT/report.md.

    args.out: output folder; args.only: comma list of name fragments; args.parameter: list of
    "NAME=VALUE" papermill overrides for every lab; args.timeout: seconds per lab. Every lab
    runs even when one fails; returns 1 when any failed, else 0.
    """
    from ..run.folders import start_run
    out = Path(args.out).resolve()
    books = lab_notebooks(only=args.only)
    overrides = _parse_overrides(args.parameter)
    _check_overrides(overrides, books)
    with start_run(out, command="labs", args=vars(args), world_size=0,
                   overwrite=getattr(args, "overwrite", False)) as run:
        code = _run_books(books, out, overrides, args.timeout, run.run_id)
    return code


def _run_books(books, out, overrides, timeout, run_id) -> int:
    from ..run.launch import TERMINATED, LaunchError, LaunchInterrupted, run
    from .nb import own_kernel
    kernel, env = own_kernel(out / ".jupyter")      # this interpreter, whatever kernelspecs exist
    results = []
    t_all = time.perf_counter()
    interrupted = None
    for book in books:
        lab_out = out / book.stem
        cmd = [sys.executable, "-m", "papermill", str(book), str(out / book.name),
               "--cwd", str(book.parent), "-p", "out", str(lab_out), "--log-output",
               "--no-progress-bar", "-k", kernel]
        for name, value in overrides:           # YAML: 4 -> int, [1, 2] -> list, tiny -> text
            cmd += ["-y", papermill_yaml(name, value)]
        print(f"zerolab labs: {book.stem} ...", flush=True)
        t0 = time.perf_counter()
        status, error = "ok", ""
        try:
            run(cmd, timeout=timeout, echo=_lab_echo, env=env)
        except LaunchInterrupted as err:    # Ctrl-C / SIGTERM: stop the whole `zerolab labs`
            interrupted = str(err).splitlines()[0]
            status, error = "interrupted", interrupted
        except LaunchError as err:
            status, error = "FAILED", _error_text(err)
        if TERMINATED and not interrupted:  # a signal whose exception was lost: stop anyway
            interrupted = f"terminated ({TERMINATED[-1]}): all ranks were stopped"
            status, error = "interrupted", interrupted
        _tag_notebook(out / book.name, run_id)
        seconds = time.perf_counter() - t0
        summary = {}
        if (lab_out / "summary.json").exists():
            summary = json.loads((lab_out / "summary.json").read_text())
        results.append({"lab": book.stem, "status": status, "error": error, "seconds": seconds,
                        "summary": summary, "pngs": sorted(p.name for p in lab_out.glob("*.png"))
                        if lab_out.exists() else [], "notebook": book.name})
        print(f"zerolab labs: {book.stem} {status} in {seconds:.0f} s" + (f": {error}" if error else ""),
              flush=True)
        if interrupted:
            break
    report = write_report(out, results, time.perf_counter() - t_all, overrides, run_id,
                          interrupted=interrupted, planned=len(books))
    print(f"zerolab labs: report at {report}")
    if interrupted:
        raise LaunchInterrupted(f"{interrupted}; report at {report}")
    return 1 if any(r["status"] != "ok" for r in results) else 0


_NOISE = re.compile(r"Executing Cell|Ending Cell|Kernel is running over TCP without encryption"
                    r"|^\s*(\S+ \S+ \[\w+\]\s*)?<Figure size [^>]*>\s*$")


def _tag_notebook(path: Path, run_id: str):
    """Record the run id in an executed notebook's metadata (metadata.zerolab.run_id)."""
    from ..run.folders import atomic_json
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    nb.setdefault("metadata", {})["zerolab"] = {"run_id": run_id}
    atomic_json(path, nb)


def _lab_echo(line: str):
    """papermill's log: keep the ranks' progress and the lab's own prints, drop kernel chatter
    (cell markers, the kernel's TCP-encryption warning, `<Figure ...>` reprs of plotted cells)."""
    if not line.strip() or _NOISE.search(line):
        return
    print("   ", re.sub(r"^\S+ \S+ \[\w+\]\s*", "", line), flush=True)


def write_report(out: Path, results: list[dict], seconds: float, overrides=(), run_id=None,
                 interrupted: str | None = None, planned: int | None = None) -> Path:
    """OUT/report.md: status, runtime, key numbers and figures of every lab; says "interrupted"
    first when the run was stopped before its last lab."""
    from ..run.folders import atomic_write
    ok = sum(r["status"] == "ok" for r in results)
    head = ([f"**Run interrupted** ({interrupted}) after {len(results)} of {planned or len(results)} "
             "labs; the labs after it did not run.", ""] if interrupted else [])
    lines = ["# ZeroLab labs report", "", *head,
             f"{ok} of {len(results)} labs passed in {seconds:.0f} s"
             + (f"; overrides: {', '.join(f'{k}={v}' for k, v in overrides)}" if overrides else "")
             + "." + (f" Run {run_id}." if run_id else ""), "",
             "| lab | status | seconds | executed notebook |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['lab']} | {r['status']} | {r['seconds']:.0f} | [{r['notebook']}]({r['notebook']}) |")
    for r in results:
        lines += ["", f"## {r['lab']}: {r['status']}", ""]
        if r["error"]:
            lines += [f"Error: `{r['error'].replace('`', chr(39))}`", ""]
        numbers = (r["summary"] or {}).get("numbers", {})
        if numbers:
            lines += ["| quantity | value |", "|---|---|"]
            lines += [f"| {k.replace('|', chr(92) + '|')} | {_fmt(v)} |"      # escape | in cells
                      for k, v in numbers.items()]
            lines.append("")
        for note in (r["summary"] or {}).get("notes", []):
            lines.append(f"- {note}")
        if (r["summary"] or {}).get("notes"):
            lines.append("")
        for png in r["pngs"]:
            lines += [f"![{r['lab']}: {png}]({r['lab']}/{png})", ""]
    return atomic_write(out / "report.md", "\n".join(lines) + "\n")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:,.6g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
