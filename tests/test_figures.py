"""What a learner sees: figures readable on a projector (every text >= 8 pt, legends off the
data), one colour per collective across the course, help texts and `zerolab labs` output
without noise. References: matplotlib's own artist properties; the `COLLECTIVE_COLORS` table."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from zerolab import theory
from zerolab.course import timeplots
from zerolab.course import plots  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _texts(fig):
    return [t for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]


def _check_fonts(fig, name):
    small = [(t.get_text()[:30], t.get_fontsize()) for t in _texts(fig) if t.get_fontsize() < 8]
    assert not small, f"{name}: text below 8 pt: {small}"


def _rows():
    rows = []
    for stage in theory.STAGES:
        f = theory.traffic_bytes(1000, 2, stage)
        rows.append({"stage": stage, "name": theory.STAGE_NAMES[stage], "world_size": 2,
                     "num_params_padded": 1000, "backend": "gloo", "measured": dict(f), "formula": dict(f),
                     "timing": {op: {"seconds_per_step": 1e-3, "per_step_s": [1e-3, 2e-3, 4e-3]}
                                for op, b in f.items() if b}})
    return rows


def test_traffic_figure_colours_fonts_and_legends_off_the_data():
    fig = plots.traffic_by_stage(_rows())
    fig.canvas.draw()
    _check_fonts(fig, "traffic_by_stage")
    for ax in fig.axes:
        for patch in ax.patches:
            op = patch.get_label()
            if op in plots.COLLECTIVE_COLORS:
                assert patch.get_facecolor()[:3] == to_rgba(plots.COLLECTIVE_COLORS[op])[:3], op
        legend = ax.get_legend()
        renderer = fig.canvas.get_renderer()
        assert legend is not None
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.y1 <= area.y0 + 1, "the legend sits on the plotting area"
    plt.close(fig)


def test_one_colour_per_collective_everywhere():
    """make_images and report take their colours from plots; nothing else defines them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_images
    assert make_images.COLORS is plots.STATE_COLORS
    assert set(plots.COLLECTIVE_COLORS) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                            "all_to_all"}
    assert len(set(plots.COLLECTIVE_COLORS.values())) == 5
    for path in (ROOT / "zerolab").rglob("*.py"):
        if path.name != "plots.py":
            assert "OP_COLORS = " not in path.read_text() and "COLLECTIVE_COLORS = " not in path.read_text(), path


@pytest.mark.parametrize("name", ["memory_7p5b_n64.png", "memory_7p5b_n8.png", "zero_stages.png",
                                  "ring_allreduce.png", "nics_busbw.png", "two_tiers.png"])
def test_course_images_fonts(name):
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_images
    fig = make_images.FIGURES[name]()
    _check_fonts(fig, name)
    plt.close(fig)


def test_help_texts_name_each_default_once():
    from zerolab.cli import build_parser
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if action.help and action.option_strings:
                entry = " ".join(action.help.split())
                at = text.find(entry)
                assert at >= 0, (name, entry)
                tail = text[at + len(entry):at + len(entry) + 12]
                assert not ("default" in entry and tail.startswith(" (default")), (name, action.dest)


def test_labs_echo_drops_kernel_noise(capsys):
    from zerolab.course.labs import _lab_echo
    _lab_echo("[IPKernelApp] WARNING | Kernel is running over TCP without encryption. All communication")
    _lab_echo("2026-01-01 10:00:00,000 [INFO] <Figure size 1500x560 with 2 Axes>")
    _lab_echo("[stage 0] step 1/2  loss 5.51")
    out = capsys.readouterr().out
    assert "encryption" not in out and "<Figure" not in out and "loss 5.51" in out


@pytest.mark.parametrize("allocator", ["MemTracker (CPU)", "CUDA peak only"])
def test_lab1_memory_figure_legends_below_the_data(allocator):
    """Lab 1's figure on the committed CPU reference run (and the same run as a GPU would report
    it: an absolute peak, no split by type): every legend lies under its axes' plotting area and
    clear of the tick labels, every text >= 8 pt."""
    import copy

    from zerolab import nb
    runs = nb.load_run(Path(plots.__file__).parent / "reference_runs" / "lab1_memory_by_stage")
    if allocator == "CUDA peak only":
        runs = copy.deepcopy(runs)
        for rows in runs.values():
            for r in rows:
                r["memory"]["allocator"] = {"source": "torch.cuda.max_memory_allocated",
                                            "peak_absolute": r["memory"]["allocator"]["peak_absolute"]}
    fig = plots.memory_by_stage(runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    _check_fonts(fig, "memory_by_stage")
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.y1 <= area.y0 + 1, f"{ax.get_title()!r}: the legend sits on the plotting area"
        for label in ax.get_xticklabels():
            assert not box.overlaps(label.get_window_extent(renderer)), \
                f"{ax.get_title()!r}: the legend covers the tick label {label.get_text()!r}"
    plt.close(fig)


def test_lab3_trace_figure_colours_fonts_and_legend_below():
    """Lab 3's Gantt chart on the committed reference traces: one bar per collective where it ran
    (trace.spans' "run" ranges), each in its op's colour; each wait hatched in its op's colour;
    every text >= 8 pt; the legend under the lowest axes and clear of its x label."""
    from zerolab.timing import trace
    out = Path(plots.__file__).parent / "reference_runs" / "lab3_step_timeline"
    fig = timeplots.step_trace(out, stages=(2, 3))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    _check_fonts(fig, "step_trace")
    colours = {to_rgba(c)[:3]: op for op, c in plots.COLLECTIVE_COLORS.items()}
    for ax, stage in zip(fig.axes, (2, 3)):
        spans = [s for p in sorted((out / f"stage{stage}").glob("trace_rank*.json"))
                 for s in trace.spans(p)]
        filled = sorted(colours[p.get_facecolor()[:3]] for p in ax.patches
                        if p.get_facecolor()[:3] in colours)
        assert filled == sorted(s.op for s in spans if s.kind == "run") and filled
        hatched = sorted(colours[p.get_edgecolor()[:3]] for p in ax.patches if p.get_hatch())
        assert hatched == sorted(s.op for s in spans if s.kind == "wait")
    ax = fig.axes[-1]
    legend = ax.get_legend()
    box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert box.y1 <= area.y0 + 1 and not box.overlaps(ax.xaxis.label.get_window_extent(renderer))
    plt.close(fig)



def _legend_under(fig, ax, name):
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend()
    assert legend is not None, name
    box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert box.y1 <= area.y0 + 1, f"{name}: the legend sits on the plotting area"
    for label in [*ax.get_xticklabels(), ax.xaxis.label]:
        assert not box.overlaps(label.get_window_extent(renderer)), \
            f"{name}: the legend covers {label.get_text()!r}"


def test_lab7_held_figure_legend_below_the_bars():
    """Lab 7's bytes-held bars on the committed CPU reference run: the legend under the axes,
    clear of the wrapper names; every text >= 8 pt."""
    import json

    from zerolab.course import wrappers
    ref = Path(plots.__file__).parent / "reference_runs" / "lab7_bring_your_own_model" / "transformer"
    ranks = [json.loads(p.read_text()) for p in sorted(ref.glob("rank*.json"))]
    fig = wrappers.plot_held(wrappers.held_rows(ranks))
    fig.canvas.draw()
    _check_fonts(fig, "plot_held")
    _legend_under(fig, fig.axes[0], "plot_held")
    plt.close(fig)


def test_lab9_sweep_figure_one_colour_per_collective_and_legends_below():
    """Lab 9's bytes-by-collective bars on the committed CPU reference run: each segment in its
    collective's course colour (all_to_all too), every text >= 8 pt, both legends under their
    axes."""
    import json

    from zerolab.course import wholematrix as wm
    ref = Path(plots.__file__).parent / "reference_runs" / "lab9_whole_matrix"
    sweep = {n: wm.layout_rows([json.loads(p.read_text())
                                for p in sorted((ref / f"n{n}").glob("rank*.json"))]) for n in (2, 4)}
    fig = wm.figure(sweep)
    fig.canvas.draw()
    _check_fonts(fig, "whole_matrix_sweep")
    colours = {to_rgba(c)[:3]: op for op, c in plots.COLLECTIVE_COLORS.items()}
    seen = {colours[p.get_facecolor()[:3]] for p in fig.axes[0].patches
            if p.get_facecolor()[:3] in colours}
    assert seen == {"reduce_scatter", "all_to_all", "all_gather"}, seen
    for ax in fig.axes:
        _legend_under(fig, ax, "whole_matrix_sweep")
    plt.close(fig)


def test_08b_scale_figure_one_colour_per_collective_and_legends_below():
    """Notebook 08b's 7.5B figure (one panel per quantity): the bytes bars in the collectives'
    course colours, every text >= 8 pt, the legends under their axes."""
    from zerolab.course import wholematrix as wm
    fig = wm.scale_figure(wm.scale_costs())
    fig.canvas.draw()
    _check_fonts(fig, "whole_matrix_7_5b")
    colours = {to_rgba(c)[:3]: op for op, c in plots.COLLECTIVE_COLORS.items()}
    seen = {colours[p.get_facecolor()[:3]] for p in fig.axes[0].patches
            if p.get_facecolor()[:3] in colours}
    assert seen == {"reduce_scatter", "all_to_all", "all_gather"}, seen
    assert len(fig.axes) == 3 and fig.axes[1].get_legend() is None    # FLOPs: one grey, no key
    for ax in (fig.axes[0], fig.axes[2]):
        _legend_under(fig, ax, "whole_matrix_7_5b")
    plt.close(fig)


def test_comm_bound_says_its_mfu_and_keeps_the_legend_off_the_data():
    from zerolab.timing import costmodel
    from zerolab.timing.hardware import DEVICES, LINKS
    for mfu, shown in ((None, costmodel.MFU), (0.5, 0.5)):
        fig = timeplots.comm_bound(2e8, 64, LINKS["ib-ndr"], DEVICES["h100"], mfu=mfu)
        fig.canvas.draw()
        ax = fig.axes[0]
        _check_fonts(fig, "comm_bound")
        assert f"MFU {shown:g}" in ax.get_title()
        t_star = costmodel.zero3_comm_bound_tokens(2e8, 64, LINKS["ib-ndr"], DEVICES["h100"], mfu=shown)
        assert any(f"{t_star:,.0f}" in t for t in ax.get_legend_handles_labels()[1])
        _legend_under(fig, ax, "comm_bound")
        plt.close(fig)

# --- the committed figures (scripts/nb_figures.py, scripts/nb_policy.py) --------------------------
def _nb_scripts():
    sys.path.insert(0, str(ROOT / "scripts"))
    import nb_figures
    import nb_policy
    return nb_figures, nb_policy


def _books():
    return sorted([*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "notebooks" / "exercises").glob("*.ipynb"),
                   *(ROOT / "labs").glob("*.ipynb")])


def test_every_drawing_cell_is_committed_with_its_figure():
    """A learner browsing the course sees every figure: each cell whose code draws (pyplot, a
    figure function of plots / timeplots / wrappers / make_images, or a notebook function that
    calls one) is tagged `figure` and holds a PNG, or is tagged `no-figure` (draws nothing on the
    CPU reference run). Static: nothing is executed. Fix: python scripts/nb_figures.py BOOK."""
    nb_figures, _ = _nb_scripts()
    problems = nb_figures.check(_books())
    assert not problems, "\n".join(problems)


def _code(*sources, tags=()):
    return {"cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {"tags": list(tags)},
                       "source": s, "outputs": [], "execution_count": None}
                      for i, s in enumerate(sources)], "metadata": {}}


def test_which_cells_draw():
    nb_figures, _ = _nb_scripts()
    nb = _code("import matplotlib.pyplot as plt\nfrom zerolab.course.timeplots import ring_latency",
               "def table(x):\n    return str(x)\n\ndef draw(x):\n    fig = Figure()\n    return fig",
               "print(table(1))",                                  # calls a function that does not draw
               "def show(x):\n    display(Image(draw(x)))",         # defines, does not draw
               "show(3)",                                          # draws through two functions
               "widgets.interactive(lambda n: show(n), n=1)",     # draws only when a slider moves
               "%matplotlib inline\nfig = plots.memory_by_stage(runs)\nplots.save(fig, out, 'm')",
               "plots.save(fig, out, 'again')",                    # saves, shows nothing
               "ring_latency(link)\nplt.show()",
               "for p in snapshots:\n    fig = timeplots.cuda_snapshot(p)")
    assert nb_figures.drawing_cells(nb) == [4, 6, 8, 9]


def test_policy_keeps_a_figure_cells_png_only():
    """`figure`: the PNG stays (as display_data, its own metadata only), the `<Figure ...>` repr
    and the progress lines go; with `nbval-check-output` too, every output stays."""
    _, nb_policy = _nb_scripts()
    outputs = [{"output_type": "stream", "name": "stdout", "text": ["step 1/2 loss 5.5\n"]},
               {"output_type": "display_data", "metadata": {"image/png": {"width": 500}, "x": 1},
                "data": {"image/png": "iVBORw0KGgo=", "text/plain": ["<Figure size 1400x500>"]}}]
    for tags, kept in ((["figure"], [{"output_type": "display_data", "metadata": {"image/png": {"width": 500}},
                                      "data": {"image/png": "iVBORw0KGgo="}}]),
                       (["figure", "nbval-check-output"], outputs), ([], [])):
        nb = _code("plt.show()", tags=tags)
        nb["cells"][0]["outputs"] = outputs
        cell = nb_policy.clean(nb)["cells"][0]
        assert cell["outputs"] == kept and cell["execution_count"] == (1 if kept else None)


def test_a_committed_figure_is_reproduced_by_executing_its_lab(tmp_path):
    """Determinism: lab 1, executed on its committed CPU reference run (no rank starts) and
    merged as scripts/nb_figures.py merges it, holds the very PNG its committed notebook holds.
    Byte for byte with the matplotlib, FreeType and Pillow that rendered the committed one (the
    notebook's `zerolab_figures` metadata; the PNGs carry no timestamp); with other versions glyphs
    rasterise differently (and a tight bounding box can move by a pixel), so then the decoded
    pixels are compared, within a small tolerance."""
    import io
    import json

    import numpy as np
    from PIL import Image
    nb_figures, _ = _nb_scripts()
    path = ROOT / "labs" / "lab1_memory_by_stage.ipynb"
    committed = json.loads(path.read_text())
    merged, problems = nb_figures.merge(committed, nb_figures.execute(path, tmp_path, timeout=300))
    assert not problems
    pairs = [(nb_figures.pngs(a), nb_figures.pngs(b)) for a, b in zip(committed["cells"], merged["cells"])
             if "figure" in a["metadata"].get("tags", [])]
    assert pairs and all(old and len(old) == len(new) for old, new in pairs)
    if committed["metadata"].get("zerolab_figures") == nb_figures.renderer():
        assert all(old == new for old, new in pairs), "a figure's PNG differs from the committed one"
        return
    for old, new in pairs:
        for a, b in zip(old, new):
            a, b = (np.asarray(Image.open(io.BytesIO(x)).convert("RGB"), dtype=float) / 255 for x in (a, b))
            if a.shape != b.shape:
                pytest.skip(f"rendered at {b.shape} here, {a.shape} committed: another renderer "
                            f"({nb_figures.renderer()} vs {committed['metadata'].get('zerolab_figures')})")
            assert np.abs(a - b).mean() < 0.01 and (np.abs(a - b).max(axis=2) > 0.25).mean() < 0.02
