"""Figures in the committed course: every cell that draws is committed with its picture.

Policy (with scripts/nb_policy.py, which keeps these outputs): a code cell that draws a figure is
tagged `figure` and keeps its image/png outputs, nothing else (no `<Figure ...>` repr, no progress
line, no widget), unless it is also tagged `nbval-check-output` (then every output is kept and
nbval compares the text ones; nbval never compares image/png). A cell whose code draws but that
shows no figure on the CPU reference run (lab 3's CUDA allocator snapshot, a GPU-only figure) is
tagged `no-figure`. The pictures are rendered by one execution on the CPU reference machine, so
they are deterministic:

  - labs/ (and any notebook whose name starts with `lab`): executed in reference mode
    (ZEROLAB_REFERENCE=1, what `zerolab labs --reference` does): every launch returns the
    committed CPU reference run (zerolab/course/reference_runs/), so figures of measured things
    (times, losses) show that run, not this machine's;
  - notebooks/: executed as they are; their figures draw formulas and exact byte counts of their
    own launches (the same on every machine), except 11's loss curves, which are those of the
    machine that regenerates them (bit-identical from one execution to the next there).

Rendering: matplotlib's inline backend (Agg) at figure.dpi = 100 (plots.save's dpi), PNG, whose
only metadata is matplotlib's "Software" string (no timestamp); then `compact` stores each as a
256-colour palette PNG (Pillow's median cut, no dithering: a figure's flat colours and their
antialiased edges fit; measured on the 12 committed figures: 2.8 times fewer bytes, mean pixel
error 0.03/255, 0.07 % of the pixels off by more than 8/255, none by more than 65/255). Two
executions give the same bytes with the same matplotlib, FreeType and Pillow; the notebook's
metadata records them (`zerolab_figures`), so that tests/test_figures.py compares bytes when
they match, pixels when not.

The executed copy's outputs go only into the cells that drew (matched by cell id; papermill's
injected parameters cell and its metadata never reach the committed notebook, whose parameters
cell is unchanged); every other cell keeps its committed outputs; then nb_policy's `clean` runs.
Each execution writes its runs under a temporary folder (the `out` / `OUT` parameter), never
under runs/.

    python scripts/nb_figures.py notebooks/06_zero2.ipynb labs/*.ipynb   # execute, write figures
    python scripts/nb_figures.py --check notebooks/*.ipynb notebooks/exercises/*.ipynb labs/*.ipynb
    python scripts/nb_figures.py --dry-run --pngs /tmp/figs notebooks/02_memory.ipynb  # only look

`--check` executes nothing: every cell that draws (by its code, see `drawing_cells`) is tagged
`figure` or `no-figure`, and every `figure` cell holds a non-empty PNG. Exit 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nb_policy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURE, NO_FIGURE = nb_policy.FIGURE_TAG, nb_policy.NO_FIGURE_TAG
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INLINE = "module://matplotlib_inline.backend_inline"
# modules whose figure functions the notebooks call, by the name they are called through
FIGURE_MODULES = {"plots": "zerolab/course/plots.py", "timeplots": "zerolab/course/timeplots.py",
                  "wrappers": "zerolab/course/wrappers.py", "make_images": "scripts/make_images.py"}
PYPLOT_DRAWS = {"show", "subplots", "figure", "subplot", "subplot_mosaic", "plot", "bar", "barh",
                "step", "imshow", "hist", "scatter", "fill_between"}


# --- which cells draw (static: no execution) ----------------------------------------------------
def _call_name(node: ast.Call) -> tuple[str | None, str]:
    """(object name or None, function name) of a call: plt.show() -> ("plt", "show")."""
    f = node.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name):
            return f.value.id, f.attr
        if isinstance(f.value, ast.Attribute):      # zerolab.course.plots.x -> ("plots", "x")
            return f.value.attr, f.attr
        return None, f.attr
    return None, ""


def _is_primitive(node: ast.Call, drawers: set[str], module_drawers: dict[str, set[str]]) -> bool:
    obj, name = _call_name(node)
    if obj in ("plt", "pyplot") and name in PYPLOT_DRAWS:
        return True
    if obj in module_drawers and name in module_drawers[obj]:
        return True
    if obj is None and name in drawers | {"Figure"}:
        return True
    if obj is None and name == "display" and node.args:
        arg = node.args[0]                           # display(fig), display(Image(...))
        return ((isinstance(arg, ast.Name) and arg.id.startswith("fig"))
                or (isinstance(arg, ast.Call) and _call_name(arg)[1] == "Image"))
    return False


def _calls(nodes, top_level_only: bool):
    """Every Call node under `nodes`; with top_level_only, none inside a def, class or lambda."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _functions_that_draw(tree: ast.Module, known: set[str], module_drawers) -> set[str]:
    """Names of the functions defined in `tree` that draw (directly, or through another one)."""
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = set(known)
    changed = True
    while changed:
        changed = False
        for name, node in defs.items():
            if name not in found and any(_is_primitive(c, found, module_drawers)
                                         for c in _calls(node.body, False)):
                found.add(name)
                changed = True
    return found - set(known)


def module_drawers() -> dict[str, set[str]]:
    """{module name: its functions that build a figure}: plots.memory_by_stage, ..."""
    out = {}
    for name, rel in FIGURE_MODULES.items():
        tree = ast.parse((ROOT / rel).read_text())
        out[name] = _functions_that_draw(tree, set(), {})
    return out


def _parse(source: str) -> ast.Module | None:
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        source = TransformerManager().transform_cell(source)     # %magics, !shell
    except ImportError:
        source = "\n".join(line for line in source.splitlines() if not line.lstrip()[:1] in "%!")
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def drawing_cells(nb: dict, modules: dict[str, set[str]] | None = None) -> list[int]:
    """Indices of the code cells that draw: their top-level code (not a function body) calls
    pyplot (show, subplots, ...), a figure function of plots / timeplots / wrappers /
    make_images (one that builds a Figure), `Figure(...)`, `display(fig...)` /
    `display(Image(...))`, or a function defined earlier in the notebook that does."""
    modules = module_drawers() if modules is None else modules
    drawers: set[str] = set()
    imported = set().union(*modules.values())       # `from zerolab.course.plots import x`
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        tree = _parse("".join(cell["source"]))
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                drawers |= {a.asname or a.name for a in node.names if a.name in imported}
        drawers |= _functions_that_draw(tree, drawers, modules)
        if any(_is_primitive(c, drawers, modules) for c in _calls(tree.body, True)):
            out.append(i)
    return out


def pngs(cell: dict) -> list[bytes]:
    """The decoded image/png outputs of a cell, in order."""
    out = []
    for o in cell.get("outputs", []):
        data = o.get("data", {}).get("image/png")
        if data:
            out.append(base64.b64decode("".join(data) if isinstance(data, list) else data))
    return out


def check(paths) -> list[str]:
    """Problems of the committed notebooks' figures (empty: all good). Executes nothing."""
    modules = module_drawers()
    problems = []
    for path in paths:
        nb = json.loads(Path(path).read_text())
        draws = set(drawing_cells(nb, modules))
        for i, cell in enumerate(nb["cells"]):
            tags = cell.get("metadata", {}).get("tags", [])
            where = f"{path} cell {i} ({cell.get('id', '?')})"
            if FIGURE in tags and NO_FIGURE in tags:
                problems.append(f"{where}: tagged both {FIGURE!r} and {NO_FIGURE!r}")
            elif FIGURE in tags:
                images = pngs(cell)
                if not images or not all(p.startswith(PNG_MAGIC) and len(p) > 100 for p in images):
                    problems.append(f"{where}: tagged {FIGURE!r} but holds no PNG")
            elif i in draws and NO_FIGURE not in tags:
                problems.append(f"{where}: draws a figure but has none: run "
                                f"scripts/nb_figures.py {path} (or tag it {NO_FIGURE!r} if it draws "
                                "nothing on the CPU reference run)")
    return problems


# --- executing and writing ----------------------------------------------------------------------
def is_lab(path) -> bool:
    return Path(path).name.startswith("lab")


def renderer() -> dict:
    """What rendered the PNGs: byte-identical output needs the same matplotlib, FreeType and
    Pillow (`compact`)."""
    import matplotlib
    import PIL
    from matplotlib import ft2font
    return {"dpi": 100, "freetype": ft2font.__freetype_version__, "matplotlib": matplotlib.__version__,
            "pillow": PIL.__version__, "png": "256-colour palette"}


def compact(png: bytes) -> bytes:
    """`png` as a 256-colour palette PNG (median cut, no dithering, optimized): about a third of
    the bytes of matplotlib's RGBA PNG, the same picture to the eye. A picture with transparent
    pixels, or already a palette, is returned unchanged."""
    import io

    from PIL import Image
    image = Image.open(io.BytesIO(png))
    if image.mode == "P" or (image.mode == "RGBA" and image.getchannel("A").getextrema()[0] < 255):
        return png
    quantized = image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT,
                                              dither=Image.Dither.NONE)
    out = io.BytesIO()
    quantized.save(out, "PNG", optimize=True)
    return out.getvalue() if len(out.getvalue()) < len(png) else png


def _compact_outputs(outputs: list) -> list:
    outputs = json.loads(json.dumps(outputs))
    for o in outputs:
        data = o.get("data", {})
        if data.get("image/png"):
            raw = base64.b64decode("".join(data["image/png"]) if isinstance(data["image/png"], list)
                                   else data["image/png"])
            data["image/png"] = base64.b64encode(compact(raw)).decode("ascii")
    return outputs


def _out_parameter(nb: dict) -> str | None:
    for cell in nb["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tree = _parse("".join(cell["source"]))
            names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name)} if tree else set()
            return next((n for n in ("out", "OUT") if n in names), None)
    return None


def execute(path, workdir, timeout: float = 1200) -> dict:
    """Execute notebook `path` with papermill (from its own folder, on this interpreter's kernel,
    inline backend, labs in reference mode, its `out`/`OUT` under `workdir`); return the executed
    notebook. RuntimeError with papermill's message when a cell fails."""
    from zerolab.course.nb import own_kernel
    path, workdir = Path(path).resolve(), Path(workdir)
    nb = json.loads(path.read_text())
    kernel, env = own_kernel(workdir / ".jupyter")
    env = {**env, "MPLBACKEND": INLINE, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("ZEROLAB_REFERENCE", None)
    if is_lab(path):
        env["ZEROLAB_REFERENCE"] = "1"
    executed = workdir / f"{path.stem}.executed.ipynb"
    cmd = [sys.executable, "-m", "papermill", str(path), str(executed), "--cwd", str(path.parent),
           "-k", kernel, "--no-progress-bar", "--execution-timeout", str(int(timeout))]
    name = _out_parameter(nb)
    if name:
        cmd += ["-p", name, str(workdir / "runs" / path.stem)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 60,
                          check=False)
    if proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{path.name}: execution failed\n{tail}")
    return json.loads(executed.read_text())


def merge(committed: dict, executed: dict, name: str = "notebook") -> tuple[dict, list[str]]:
    """The committed notebook with the figures of `executed` (cells matched by id): each cell
    that showed a PNG is tagged `figure` and takes the executed outputs, PNGs `compact`ed
    (nb_policy.clean then keeps only the images, or everything in an `nbval-check-output` cell).
    Returns (notebook, problems): a `figure` cell or a drawing cell (not `no-figure`) that showed
    no PNG."""
    nb = json.loads(json.dumps(committed))
    ran = {c.get("id"): c for c in executed["cells"] if c.get("id")}
    draws = set(drawing_cells(nb))
    problems = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        meta = cell.setdefault("metadata", {})
        tags = list(meta.get("tags", []))
        other = ran.get(cell.get("id"))
        if other is None:
            problems.append(f"{name} cell {i}: not in the executed copy (id {cell.get('id')!r})")
            continue
        if pngs(other):
            tags = [t for t in tags if t != NO_FIGURE] + ([] if FIGURE in tags else [FIGURE])
            cell["outputs"] = _compact_outputs(other["outputs"])
        elif FIGURE in tags:
            tags.remove(FIGURE)
            problems.append(f"{name} cell {i}: tagged {FIGURE!r} but drew nothing")
        elif i in draws and NO_FIGURE not in tags:
            problems.append(f"{name} cell {i}: its code draws but it showed no figure "
                            f"(tag it {NO_FIGURE!r} if that is right on the CPU reference run)")
        if tags != meta.get("tags", []):
            meta["tags"] = tags
    nb["metadata"]["zerolab_figures"] = renderer()
    return nb_policy.clean(nb), problems


def regenerate(path, workdir=None, write: bool = True, pngs_to=None) -> list[str]:
    """Execute `path` and write its figure outputs into it in place (with write=False, only
    report); with `pngs_to`, also write each figure as PNGS_TO/<stem>_cell<i>.png (to look at);
    returns the problems."""
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="nb_figures_") as tmp:
        executed = execute(path, Path(workdir or tmp))
    committed = json.loads(path.read_text())          # read after the execution: the newest text
    new, problems = merge(committed, executed, str(path))
    if not any(FIGURE in c.get("metadata", {}).get("tags", []) for c in new["cells"]):
        new["metadata"].pop("zerolab_figures", None)   # nothing drawn: nothing to record
    if pngs_to:
        Path(pngs_to).mkdir(parents=True, exist_ok=True)
        for i, cell in enumerate(new["cells"]):
            for k, png in enumerate(pngs(cell)):
                (Path(pngs_to) / f"{path.stem}_cell{i}{f'_{k}' if k else ''}.png").write_bytes(png)
    if write and new != committed:
        nb_policy.write(path, new)
    if not write:
        n = sum(FIGURE in c.get("metadata", {}).get("tags", []) for c in new["cells"])
        print(f"nb_figures: {path}: would hold {n} figure cell(s) (not written)")
    return problems


def main(argv=None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("notebooks", nargs="+", help="notebooks / labs (.ipynb)")
    cli.add_argument("--check", action="store_true",
                     help="execute nothing; exit 1 if a drawing cell has no committed figure")
    cli.add_argument("--dry-run", action="store_true",
                     help="execute and report, write nothing")
    cli.add_argument("--pngs", metavar="DIR", default=None,
                     help="also write every figure as DIR/<notebook>_cell<i>.png")
    args = cli.parse_args(argv)
    if args.check:
        problems = check(args.notebooks)
        if problems:
            print("figures missing (scripts/nb_figures.py):", *problems, sep="\n  ")
        return 1 if problems else 0
    problems = []
    for path in args.notebooks:
        print(f"nb_figures: {path} ...", flush=True)
        try:
            found = regenerate(path, write=not args.dry_run, pngs_to=args.pngs)
        except RuntimeError as err:
            found = [str(err)]
        if args.dry_run:
            print("".join(f"  {p}\n" for p in found), end="")
            problems += found
            continue
        nb = json.loads(Path(path).read_text())
        n = sum(FIGURE in c.get("metadata", {}).get("tags", []) for c in nb["cells"])
        print(f"nb_figures: {path}: {n} figure cell(s), {sum(len(p) for c in nb['cells'] for p in pngs(c)):,} "
              "PNG bytes" + "".join(f"\n  {p}" for p in found), flush=True)
        problems += found
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
