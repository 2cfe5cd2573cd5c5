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
    assert set(plots.COLLECTIVE_COLORS) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    assert len(set(plots.COLLECTIVE_COLORS.values())) == 4
    for path in (ROOT / "zerolab").rglob("*.py"):
        if path.name != "plots.py":
            assert "OP_COLORS = " not in path.read_text() and "COLLECTIVE_COLORS = " not in path.read_text(), path


@pytest.mark.parametrize("name", ["memory_7p5b_n64.png", "memory_7p5b_n8.png", "zero_stages.png",
                                  "ring_allreduce.png"])
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
