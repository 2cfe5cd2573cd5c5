"""Reading the ranks' JSON files back, the stage-comparison table, and its plot.

Idea: every rank wrote OUT/stage{S}/rank{r}.json; this module turns a run folder into rows
(final loss, measured vs theory model-state bytes per rank, measured vs theory bytes per step)
and into one matplotlib figure. The CLI's `compare`, the labs and the notebooks all read runs
through here.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import theory


def load_run(out_dir, echo=None) -> dict[int, list[dict]]:
    """{stage: [rank0 json, rank1 json, ...]} from OUT/stage*/rank*.json, of one run only.

    The run is the one OUT/run.json names (`zerolab.runs`); files of other runs (a stale rank3
    after a 2-rank rerun, a stage left from an earlier run) are left out, and `echo` (default:
    stderr) says so. Raises FileNotFoundError naming `out_dir` when it holds no results of that
    run, and ValueError when a stage lacks some rank of the run's world size."""
    from .runs import one_run
    out = Path(out_dir)
    items = [(p, json.loads(p.read_text())) for folder in sorted(out.glob("stage[0-3]"))
             for p in folder.glob("rank*.json") if p.stem[4:].isdigit()]
    run_id, items = one_run(out, items, echo)
    runs: dict[int, list[dict]] = {}
    for _, r in sorted(items, key=lambda x: (x[1]["stage"], x[1]["rank"])):
        runs.setdefault(r["stage"], []).append(r)
    if not runs:
        raise FileNotFoundError(f"no stage*/rank*.json of run {run_id} under {str(out)!r}: run "
                                "zerolab train first")
    for stage, ranks in runs.items():
        n = ranks[0]["world_size"]
        if [r["rank"] for r in ranks] != list(range(n)):
            raise ValueError(f"{str(out)!r}: stage {stage} of run {run_id} has rank files "
                             f"{[r['rank'] for r in ranks]}, not 0..{n - 1} (the run did not finish)")
    return runs


def compare_rows(runs: dict[int, list[dict]]) -> list[dict]:
    """One row per stage, from rank 0 (and the max over ranks for the measured bytes).

    Bytes: model_states (measured after the last step, max over ranks), theory_states (the
    formula at the padded Ψ), theory_states_unpadded (at Ψ), traffic (ledger bytes of the last
    step, grads + params), theory_traffic (formula at the padded Ψ)."""
    rows = []
    for stage, ranks in sorted(runs.items()):
        r0 = ranks[0]
        rows.append({
            "stage": stage, "name": r0["name"], "world_size": r0["world_size"],
            "num_params": r0["num_params"], "final_loss": r0["losses"][-1], "losses": r0["losses"],
            "model_states": max(r["memory"]["model_states_total"] for r in ranks),
            "theory_states": sum(r0["theory"]["model_states_padded"].values()),
            "theory_states_unpadded": sum(r0["theory"]["model_states"].values()),
            "traffic": max(sum(r["comm"]["bytes_per_step"].values()) for r in ranks),
            "theory_traffic": sum(r0["theory"]["traffic_per_step_padded"].values()),
            "peak_tracked": max(r["memory"]["peak_total"] for r in ranks),
            "allocator_peak": max(((r["memory"].get("allocator") or {}).get("peak_absolute") or 0)
                                  for r in ranks),
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    """The comparison as a text table (bytes per rank)."""
    head = (f"{'stage':<8}{'final loss':>11}{'model states':>14}{'formula':>12}{'ratio':>7}"
            f"{'bytes/step':>12}{'formula':>12}{'ratio':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['name']:<8}{r['final_loss']:>11.6f}{r['model_states']:>14,.0f}"
                     f"{r['theory_states']:>12,.0f}{_ratio(r['model_states'], r['theory_states']):>7}"
                     f"{r['traffic']:>12,.0f}{r['theory_traffic']:>12,.0f}"
                     f"{_ratio(r['traffic'], r['theory_traffic']):>7}")
    return "\n".join(lines)


def _ratio(a, b):
    return f"{a / b:.3f}" if b else ("1.000" if a == b else "inf")


def plot_compare(runs: dict[int, list[dict]], path) -> Path:
    """Three panels: loss curves, model-state bytes per rank by state (measured vs formula),
    bytes per step by collective (measured vs formula). Colours: `zerolab.plots`. Saves a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import COLLECTIVE_COLORS, FONT, STATE_COLORS, identical_style

    fig, (ax_loss, ax_mem, ax_net) = plt.subplots(1, 3, figsize=(16, 5.2))
    stages = sorted(runs)
    for i, s in enumerate(stages):   # decreasing marker sizes: identical curves stay visible
        losses = runs[s][0]["losses"]
        ax_loss.plot(range(1, len(losses) + 1), losses, label=theory.STAGE_NAMES[s], **identical_style(i))
    steps = len(runs[stages[0]][0]["losses"])
    ax_loss.set_xticks(range(1, steps + 1) if steps <= 12 else range(1, steps + 1, max(1, steps // 10)))
    ax_loss.set_title("loss per step (same data and seed;\nhollow markers: curves on top of each other stay visible)",
                      fontsize=FONT + 1)
    ax_loss.set_xlabel("step", fontsize=FONT)
    ax_loss.set_ylabel("loss", fontsize=FONT)
    width = 0.38
    for i, s in enumerate(stages):
        r0 = runs[s][0]
        bottom_m = bottom_t = 0.0
        for state in theory.STATES:
            m = r0["memory"]["model_states"][state] / 1e6
            t = r0["theory"]["model_states_padded"][state] / 1e6
            ax_mem.bar(i - width / 2, m, width, bottom=bottom_m, color=STATE_COLORS[state],
                       label=state if i == 0 else None)
            ax_mem.bar(i + width / 2, t, width, bottom=bottom_t, color=STATE_COLORS[state], alpha=0.45,
                       hatch="//", edgecolor="white")
            bottom_m, bottom_t = bottom_m + m, bottom_t + t
    ax_mem.set_xticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in stages])
    ax_mem.set_title("model states per rank (rank 0)\nsolid: measured, hatched: formula", fontsize=FONT + 1)
    ax_mem.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    for j, op in enumerate(ops):
        meas = [runs[s][0]["comm"]["bytes_per_step"][op] / 1e6 for s in stages]
        form = [runs[s][0]["theory"]["traffic_per_step_padded"][op] / 1e6 for s in stages]
        base_m = [sum(runs[s][0]["comm"]["bytes_per_step"][o] / 1e6 for o in ops[:j]) for s in stages]
        base_f = [sum(runs[s][0]["theory"]["traffic_per_step_padded"][o] / 1e6 for o in ops[:j])
                  for s in stages]
        xs = range(len(stages))
        ax_net.bar([x - width / 2 for x in xs], meas, width, bottom=base_m, color=COLLECTIVE_COLORS[op],
                   label=op)
        ax_net.bar([x + width / 2 for x in xs], form, width, bottom=base_f, color=COLLECTIVE_COLORS[op],
                   alpha=0.45, hatch="//", edgecolor="white")
    ax_net.set_xticks(range(len(stages)), [theory.STAGE_NAMES[s] for s in stages])
    ax_net.set_title("bytes sent per rank per step (ring, rank 0)\nsolid: measured, hatched: formula",
                     fontsize=FONT + 1)
    ax_net.set_ylabel("MB (1e6 bytes)", fontsize=FONT)
    for ax in (ax_loss, ax_mem, ax_net):
        ax.tick_params(labelsize=FONT)
        ax.legend(fontsize=FONT, ncol=4 if ax is ax_loss else 3, loc="upper center",
                  bbox_to_anchor=(0.5, -0.15 if ax is ax_loss else -0.08), frameon=False)
    n = runs[stages[0]][0]["world_size"]
    fig.suptitle(f"{runs[stages[0]][0]['preset']} GPT, Ψ = {runs[stages[0]][0]['num_params']:,}, "
                 f"N = {n} ranks, {runs[stages[0]][0]['backend']} on {runs[stages[0]][0]['device']}",
                 fontsize=FONT + 2)
    fig.tight_layout()
    from .runs import atomic_path
    path = Path(path)
    with atomic_path(path) as tmp:            # the run id rides in the PNG's metadata
        fig.savefig(tmp, dpi=110, bbox_inches="tight",
                    metadata={"zerolab_run_id": str(runs[stages[0]][0].get("run_id"))})
    plt.close(fig)
    return path
