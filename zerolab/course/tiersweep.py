"""Tiers x strategies, measured: flat ZeRO-3, HSDP, hpZ and ZeRO++'s quantized gathers on
emulated nodes, next to the cost model (lab 8, notebook 13).

Idea: a laptop has no second node, but the link emulator (`--ranks-per-node K --intra SPEC
--inter SPEC`, zerolab/timing/linkemu.py) makes each collective last as long as the cost model
says for the tiers its ranks cross, sleeping so that compute overlaps it as on real links. Each
variant is a real `zerolab train` run of ZeRO-3 on N ranks in nodes of K:

    ZeRO-3       flat: every gather and reduce_scatter a ring through all N ranks (one ring per NIC across nodes)
    HSDP         --hybrid hsdp: sharded inside a node, each gradient shard all-reduced across
    hpZ          --hybrid hpz: the backward's gathers inside the node, from secondary shards
    qwZ          --quantize-weights int8: flat, each gather carries int8 codes + fp32 scales
    qwZ+qgZ      ... and the gradient reduce_scatter as an all_to_all of int4 codes
    ZeRO++       hpZ + qwZ + qgZ, qgZ in two hops (inside the node, then across)

and one more, "compute", flat ZeRO-3 with no emulated link: its step time is this machine's
compute (plus gloo's own time) with N ranks sharing the cores. The model's units
(`costmodel.measure_units`, one process) are scaled so that their compute adds up to it, then
`costmodel.step_time` replays every variant on the emulated Topology. Per variant `table` gives
the measured step time (median, min-max of the slowest rank; the first step and the last,
measured one, left out), the model's, their ratio, the ledger's bytes per rank per tier next to
the formula (`tiers.hybrid_traffic_bytes`, `theory.quantized_traffic_bytes`,
`tiers.zeropp_traffic_bytes`), the model states
per rank (measured = formula) with hpZ's secondary shards, and the final loss against flat
ZeRO-3's (HSDP sums in another order; qwZ / qgZ round).

    python -m zerolab.course.tiersweep --out runs/tiersweep          # ~1-3 min on 2 cores
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from .. import theory
from ..variants import quant, tiers
from ..model import GPT, get_config
from ..timing import costmodel, hardware

VARIANTS = {"ZeRO-3": {}, "HSDP": {"hybrid": "hsdp"}, "hpZ": {"hybrid": "hpz"},
            "qwZ": {"quantize_weights": "int8"},
            "qwZ+qgZ": {"quantize_weights": "int8", "quantize_grads": "int4"},
            "ZeRO++": {"hybrid": "hpz", "quantize_weights": "int8", "quantize_grads": "int4"}}
INTRA, INTER = "2@20", "0.005@500"      # Gb/s @ us: inside a node 400x the link between nodes


def sweep(out, *, nproc: int = 4, ranks_per_node: int = 2, intra: str = INTRA,
          inter: str = INTER, preset: str = "nano", steps: int = 6, batch_size: int = 8,
          variants=None, launch=None, echo=print) -> dict:
    """Launch "compute" and every variant (names of VARIANTS) into OUT/<name>; return
    {name: [rank JSON, ...]}. launch: `nb.launch` (default) or a stand-in with its signature."""
    if launch is None:
        from .nb import launch
    names = list(VARIANTS) if variants is None else list(variants)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variant {unknown[0]!r} is not one of {', '.join(VARIANTS)}")
    runs = {}
    common = dict(stages="3", nproc=nproc, preset=preset, steps=steps, backend="gloo",
                  device="cpu", batch_size=batch_size, no_allocator=True, echo=None)
    runs["compute"] = launch(out=str(Path(out) / "compute"), **common)[3]
    for name in names:
        if echo:
            echo(f"{name}: {nproc} ranks in nodes of {ranks_per_node}, intra {intra}, inter {inter}")
        runs[name] = launch(out=str(Path(out) / name.replace("+", "_")), ranks_per_node=ranks_per_node,
                            intra=intra, inter=inter, **common, **VARIANTS[name])[3]
    return runs


def step_times(ranks: list[dict]) -> list[float]:
    """The slowest rank's seconds per step, without the first (warm-up) and the last (measured
    with the memory meter on) step."""
    n = len(ranks[0]["step_times_s"])
    return [max(r["step_times_s"][i] for r in ranks) for i in range(1, n - 1)] or \
        [max(r["step_times_s"][0] for r in ranks)]


def model_units(preset: str, nproc: int, batch_size: int, compute_s: float) -> list:
    """`costmodel.measure_units` of one rank's micro-batch, scaled so that forward + backward of
    all units take `compute_s` seconds (what N ranks sharing this machine's cores measured)."""
    torch.manual_seed(0)
    cfg = get_config(preset)
    model = GPT(cfg).to(torch.bfloat16)
    x = torch.randint(0, cfg.vocab_size, (max(1, batch_size // nproc), cfg.block_size))
    units = costmodel.measure_units(model, x, x, nproc, repeats=3)
    scale = compute_s / max(sum(u.fwd_s + u.bwd_s for u in units), 1e-12)
    return [costmodel.Unit(u.name, u.numel, u.fwd_s * scale, u.bwd_s * scale) for u in units]


def _model_kwargs(name: str) -> dict:
    spec = VARIANTS[name]
    b = quant.DEFAULT_BLOCK                 # bytes per element of one block, codes + its scale
    per = {state: theory.quantized_bytes(b, theory.QUANT_BITS[spec[key]], b) / b
           for state, key in (("params", "quantize_weights"), ("grads", "quantize_grads"))
           if spec.get(key)}
    return {"hybrid": spec.get("hybrid"), "bytes_per_param": per or None,
            "two_hop_grads": spec.get("hybrid") == "hpz" and bool(spec.get("quantize_grads"))}


def measured_tiers(r0: dict) -> dict[str, dict[str, float]]:
    """Ledger bytes of the last step by group ("world", "intra", "inter") and op (rank 0)."""
    return r0["comm"].get("bytes_per_tier") or {"world": {
        op: b for op, b in r0["comm"]["bytes_per_step"].items() if b}}


def formula_tiers(r0: dict) -> dict[str, dict[str, float]]:
    """The formula for the same, at the run's padded Ψ (and shard sizes, when quantized)."""
    if r0["theory"].get("traffic_per_tier_padded"):
        return r0["theory"]["traffic_per_tier_padded"]
    return {"world": {op: b for op, b in r0["theory"]["traffic_per_step_padded"].items() if b}}


def table(runs: dict, topology: hardware.Topology, units: list) -> list[dict]:
    """One row per variant: measured and modelled seconds, bytes by tier, states, loss."""
    flat = runs.get("ZeRO-3")
    rows = []
    for name, ranks in runs.items():
        if name == "compute":
            continue
        r0, n = ranks[0], ranks[0]["world_size"]
        ts = step_times(ranks)
        kw = _model_kwargs(name)
        over = costmodel.step_time(3, units, n, topology, prefetch=r0.get("zero3_prefetch") or 1, **kw)
        serial = costmodel.step_time(3, units, n, topology, prefetch=0, overlap=False, **kw)
        got, want = measured_tiers(r0), formula_tiers(r0)
        loss = r0["losses"][-1]
        rows.append({
            "name": name, "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
            "model_s": over.total, "serial_s": serial.total,
            "model_by_tier": over.by_op_tier(),
            "bytes": {t: sum(ops.values()) for t, ops in got.items()}, "bytes_by_op": got,
            "bytes_formula": {t: sum(ops.values()) for t, ops in want.items()},
            "bytes_exact": all(abs(got.get(t, {}).get(op, 0.0) - b) <= 1e-6 * max(b, 1)
                               for t, ops in want.items() for op, b in ops.items())
            and set(got) == set(want),
            "states": max(r["memory"]["model_states_total"] for r in ranks),
            "states_formula": sum(r0["theory"]["model_states_padded"].values()),
            "secondary": r0["theory"].get("secondary_params_padded") or 0.0,
            "peak": max(r["memory"]["peak_total"] for r in ranks),
            "final_loss": loss,
            "loss_vs_flat": (loss - flat[0]["losses"][-1]) if flat else float("nan"),
            "max_loss_diff": (max(abs(a - b) for a, b in zip(r0["losses"], flat[0]["losses"]))
                              if flat else float("nan")),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as text: ms, bytes (KB) by tier, states (KB), loss differences."""
    head = (f"{'variant':<10}{'measured ms':>12}{'min-max':>12}{'model':>8}{'ratio':>7}"
            f"{'world KB':>10}{'intra KB':>10}{'inter KB':>10}{'=formula':>9}{'states KB':>10}"
            f"{'2nd KB':>8}{'loss-flat':>11}")
    lines = [head]
    for r in rows:
        kb = {t: r["bytes"].get(t, 0.0) / 1e3 for t in ("world", "intra", "inter")}
        spread = f"{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}"
        lines.append(
            f"{r['name']:<10}{r['median_s'] * 1e3:>12.0f}{spread:>12}{r['model_s'] * 1e3:>8.0f}"
            f"{r['median_s'] / r['model_s']:>7.2f}{kb['world']:>10.1f}{kb['intra']:>10.1f}"
            f"{kb['inter']:>10.1f}{str(r['bytes_exact']):>9}{r['states'] / 1e3:>10.1f}"
            f"{r['secondary'] / 1e3:>8.1f}{r['loss_vs_flat']:>+11.2e}")
    return "\n".join(lines)


# --- ZeRO++ whole (hpZ + qwZ + qgZ in two hops): the bytes that leave a node, from the ledger ----
ZEROPP = {"hybrid": "hpz", "quantize": {"weights": "int8", "grads": "int4"}}


def zeropp_cross_node(worlds=((4, 2), (8, 4), (64, 8)), preset: str = "nano") -> list[dict]:
    """For each (N, k): one training step of flat ZeRO-3 and of ZeRO++ (`ZEROPP`) on rank 0 of a
    fake world of N ranks in nodes of k (`whatif.fake_world`, the model on the meta device: the
    ledger's bytes without the arithmetic), and the bytes that leave a node
    (`tiers.cross_node_bytes`) in M = 2Ψ (the model in bf16, Ψ padded), next to the formula at the
    run's shard sizes (`tiers.zeropp_traffic_bytes`) and its closed form
    (`tiers.zeropp_cross_node_in_m`, no scales: the paper's count)."""
    from ..comm import Comm
    from ..variants.compose import make_strategy
    from ..timing import whatif
    cfg, rows = get_config(preset), []
    for n, k in worlds:
        row = {"N": n, "k": k}
        for name, opts in (("zero3", {}), ("zero++", dict(ZEROPP, ranks_per_node=k))):
            with whatif.fake_world(n):
                comm = Comm()
                with torch.device("meta"):
                    model = GPT(cfg).bfloat16()
                s = make_strategy(3, model, comm, **opts)
                x = torch.zeros(1, cfg.block_size, dtype=torch.long, device="meta")
                s.backward(s.forward(x, x))
                s.step()
                by = {}
                for r in comm.records:
                    if r.what in ("grads", "params"):
                        by.setdefault(r.tier or "world", {}).setdefault(r.op, 0.0)
                        by[r.tier or "world"][r.op] += r.bytes
                shards = [u.shard_numel for u in s.units]
                m_bytes = 2 * n * sum(shards)
                s.close()
            q = ZEROPP["quantize"]
            want = (tiers.zeropp_traffic_bytes(shards, n, k, q["weights"], q["grads"])
                    if name == "zero++" else tiers.hybrid_traffic_bytes(n * sum(shards), n, k))
            row[name] = tiers.cross_node_bytes(by, k) / m_bytes
            row[name + " formula"] = tiers.cross_node_bytes(want, k) / m_bytes
            row[name + " closed"] = tiers.zeropp_cross_node_in_m(n, k)[name]
        rows.append(row)
    return rows


def format_zeropp(rows: list[dict]) -> str:
    """The rows as text, in M; the paper's limit last."""
    lines = [f"{'N':>4}{'k':>3}{'ZeRO-3 ledger':>15}{'formula':>9}{'ZeRO++ ledger':>15}"
             f"{'formula':>9}{'no scales':>11}{'ZeRO-3 / ZeRO++':>17}"]
    for r in rows:
        lines.append(f"{r['N']:>4}{r['k']:>3}{r['zero3']:>14.4f}M{r['zero3 formula']:>8.4f}M"
                     f"{r['zero++']:>14.4f}M{r['zero++ formula']:>8.4f}M{r['zero++ closed']:>10.4f}M"
                     f"{r['zero3'] / r['zero++']:>16.2f}x")
    lines.append(f"{'N, m -> inf':<11}{3:>10.4f}M{'':>33}{0.75:>10.4f}M{4:>16.2f}x"
                 "   (the paper: 3M -> 0.75M)")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerolab.course.tiersweep", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--out", default="runs/tiersweep")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--intra", default=INTRA)
    p.add_argument("--inter", default=INTER)
    p.add_argument("--preset", default="nano")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", default=",".join(VARIANTS))
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        topo = hardware.get_topology(args.ranks_per_node, args.intra, args.inter, args.nproc)
        runs = sweep(args.out, nproc=args.nproc, ranks_per_node=args.ranks_per_node,
                     intra=args.intra, inter=args.inter, preset=args.preset, steps=args.steps,
                     variants=[v for v in args.variants.split(",") if v])
    except ValueError as err:
        print(f"tiersweep: error: {err}", file=sys.stderr)
        return 2
    compute = statistics.median(step_times(runs["compute"]))
    units = model_units(args.preset, args.nproc, 8, compute)
    print(f"compute (flat ZeRO-3, no emulated link): {compute * 1e3:.0f} ms a step")
    print(format_table(table(runs, topo, units)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
