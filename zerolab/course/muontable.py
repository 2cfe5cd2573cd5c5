"""Distributed Muon's three layouts side by side: bytes, Newton-Schulz FLOPs, memory, time.

    python -m zerolab.course.muontable                   # formulas (course preset, 7.5B / N = 64)
                                                         # and a measured run on 4 gloo ranks
    python -m zerolab.course.muontable --no-run          # the formulas only (instant)
    python -m zerolab.course.muontable --preset small --nproc 2 --link-gbps 1

Formula rows (zerolab.wholematrix.muon_theory.summary, per rank, the busiest rank's): bytes a step (fp32
gradients and weights: halve for bf16), Newton-Schulz FLOPs (5 iterations), FLOPs computed
more than once across the world, imbalance (max/mean of the ranks' Newton-Schulz FLOPs; "load":
of the elements they own, 1 where nothing is owned), held
bytes (Muon's momentum + AdamW's moments + the layout's buffers, fp32) and a modelled step time
of the optimizer (its collectives on `--link`, costmodel.collective_time, plus its Newton-Schulz
at `--device`'s bf16 peak x MFU; the forward / backward are the same for all three and left
out). Parameters: the GPT of zerolab.model (muon_param_groups: hidden 2-D weights to Muon, the
tied embedding / head, norms and biases to AdamW); 7.5B = 36 blocks of width 4096, 32 heads,
vocabulary 50,304 (GPT-2's, padded), context 2048: Ψ = 7.46e9.

Measured rows (the same layouts on `--nproc` gloo ranks, the course's GPT in fp32, `--steps`
steps on an emulated link `--link-gbps` / `--link-latency-us`): the ledger's bytes of the last
step (= the formula, checked), held bytes (`held_bytes()`, = the formula), the step's transient
peak above them (MemTracker: temporaries of the Newton-Schulz and the routing), the median
seconds of `opt.step()` and the emulated link's model of its collectives alone (the floor the
emulator holds them to; the rest is the ranks' CPU, shared by all ranks of this machine).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..wholematrix import muon_theory as mt
from ..model import GPT, GPTConfig, get_config
from ..theory import RING_FACTOR
from ..timing import costmodel, hardware
from ..timing.flops import MFU
from ..wholematrix.wholeopt import muon_param_groups

BIG = GPTConfig(vocab_size=50304, block_size=2048, n_layer=36, n_head=32, n_embd=4096)
LAYOUT_CLASSES = {"owner": "MuonOwner", "a2a": "MuonAllToAll", "replicate": "MuonReplicate"}


def gpt_shapes(cfg: GPTConfig):
    """(shapes, whole, groups) of a GPT's distinct parameters in muon_param_groups' order,
    from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(cfg)
    groups = muon_param_groups(model)
    shapes = [tuple(p.shape) for g in groups for p in g["params"]]
    whole = [g["use_muon"] for g in groups for _ in g["params"]]
    gid = [k for k, g in enumerate(groups) for _ in g["params"]]
    return shapes, whole, gid


def modelled_seconds(layout, shapes, whole, groups, n, link, device, mfu=MFU, elem_bytes=4):
    """The busiest rank's optimizer step: its collectives one after another on `link` (the
    all_to_all timed as the uniform one that moves its busier direction) plus its
    Newton-Schulz FLOPs at device.flops x mfu."""
    per = mt.layout_costs(layout, shapes, whole, n, elem_bytes, groups=groups)
    worst = 0.0
    for p in per:
        t = 0.0
        for op, b in p["bytes"].items():
            if b:
                t += costmodel.collective_time(op, b / RING_FACTOR[op](n), n, link)
        worst = max(worst, t + p["ns_flops"] / (device.flops * mfu))
    return worst


def formula_rows(cfg, n, link, device, elem_bytes=4, mfu=MFU) -> list[dict]:
    shapes, whole, groups = gpt_shapes(cfg)
    rows = []
    for layout in mt.LAYOUTS:
        per = mt.layout_costs(layout, shapes, whole, n, elem_bytes, groups=groups)
        total = sum(mt.ns_flops(s) for s, w in zip(shapes, whole) if w)
        fl = [p["ns_flops"] for p in per]
        rows.append({"layout": layout, "n": n,
                     "bytes": max(sum(p["bytes"].values()) for p in per),
                     "ns_flops": max(fl), "redundant_flops": sum(fl) - total,
                     "imbalance": mt.imbalance(fl),
                     "load": mt.imbalance(mt.loads([mt.numel(x) for x in shapes],
                                                   mt.owners_of(layout, shapes, whole, n, groups),
                                                   n)) if layout != "replicate" else 1.0,
                     "held_bytes": max(p["state_bytes"] + p["buffer_bytes"] for p in per),
                     "seconds": modelled_seconds(layout, shapes, whole, groups, n, link, device,
                                                 mfu, elem_bytes)})
    return rows


def time_table(psi, n, blocks, d_model, link, device, mfu=MFU) -> str:
    """`zerolab time --muon`: the formula rows for a GPT of `blocks` blocks of width `d_model`
    (None: from Ψ ≈ 12·L·d², as `zerolab time` does), vocabulary 50,304 tied, on one `link`
    (a hardware.Link; ValueError for two tiers)."""
    from ..timing.flops import shape_from_params
    if not isinstance(link, hardware.Link):
        raise ValueError("--muon prices the optimizer on one link: drop --ranks-per-node / "
                         "--intra / --inter")
    d = d_model or shape_from_params(psi, blocks)
    cfg = GPTConfig(vocab_size=50304, block_size=2048, n_layer=blocks, n_head=1, n_embd=d)
    return format_formula(f"distributed Muon, a GPT of {blocks} blocks of width {d}, N = {n}, "
                          f"fp32 (muon_theory; {link.name}, {device.name} at MFU {mfu})",
                          formula_rows(cfg, n, link, device, mfu=mfu))


def _measure(rank, n, preset, steps, gbps, latency_us):
    """One rank: each layout on the course's GPT (fp32) for `steps` steps on an emulated link."""
    from ..wholematrix import muon_a2a, muon_owner, muon_replicate
    from ..comm import Comm
    from ..memory import transient_peak
    from ..timing.linkemu import from_args
    classes = {"owner": muon_owner.MuonOwner, "a2a": muon_a2a.MuonAllToAll,
               "replicate": muon_replicate.MuonReplicate}
    out = {}
    cfg = get_config(preset)
    for layout, cls in classes.items():
        torch.manual_seed(0)
        model, comm = GPT(cfg), Comm()
        comm.all_reduce(torch.ones(1), what="metric")        # gloo connects on the first call
        comm.link = from_args(gbps, latency_us, n)
        opt = cls(muon_param_groups(model, muon=dict(lr=0.02), adamw=dict(lr=3e-4)), comm=comm)
        g = torch.Generator().manual_seed(rank)
        times, peak = [], 0
        for step in range(steps):
            comm.step = step
            x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
            model(x, x).backward()
            if step == steps - 1:
                _, peak = transient_peak(opt.step, torch.device("cpu"),
                                         external=(model, *opt.buffers))
            else:
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=True)
        last = [r for r in comm.records if r.step == steps - 1 and r.what in ("grads", "params")]
        held = opt.held_bytes()
        out[layout] = {"bytes": sum(r.bytes for r in last),
                       "formula": sum(opt.costs()[rank]["bytes"].values()),
                       "held": held["state"] + held["buffers"],
                       "held_formula": opt.costs()[rank]["state_bytes"]
                       + opt.costs()[rank]["buffer_bytes"],
                       "peak": peak, "seconds": statistics.median(times) if times else 0.0,
                       "link_s": sum(costmodel.collective_time(op, b / RING_FACTOR[op](n), n,
                                                               comm.link.link)
                                     for op, b in opt.costs()[rank]["bytes"].items() if b)}
    return out


def measured_rows(preset="tiny", nproc=4, steps=5, gbps=1.0, latency_us=100.0) -> list[dict]:
    """The busiest rank's measured row per layout (see the module's docstring)."""
    from .testing import run_ranks
    ranks = run_ranks(_measure, nproc, preset, steps, gbps, latency_us, timeout=600)
    rows = []
    for layout in mt.LAYOUTS:
        per = [r[layout] for r in ranks]
        rows.append({"layout": layout, "n": nproc,
                     "bytes": max(p["bytes"] for p in per),
                     "formula": max(p["formula"] for p in per),
                     "held": max(p["held"] for p in per),
                     "held_formula": max(p["held_formula"] for p in per),
                     "peak": max(p["peak"] for p in per),
                     "seconds": max(p["seconds"] for p in per),
                     "link_s": max(p["link_s"] for p in per)})
    return rows


def _fmt_bytes(b):
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


def format_formula(title, rows) -> str:
    lines = [title, f"{'layout':10}{'bytes/step':>12}{'NS FLOPs':>12}{'redundant':>12}"
             f"{'NS imb.':>8}{'load imb.':>10}{'held':>11}{'opt. step':>11}"]
    for r in rows:
        lines.append(f"{r['layout']:10}{_fmt_bytes(r['bytes']):>12}{r['ns_flops']:>12.3g}"
                     f"{r['redundant_flops']:>12.3g}{r['imbalance']:>8.2f}{r['load']:>10.2f}"
                     f"{_fmt_bytes(r['held_bytes']):>11}{r['seconds'] * 1e3:>9.2f}ms")
    return "\n".join(lines)


def format_measured(title, rows) -> str:
    lines = [title, f"{'layout':10}{'bytes/step':>12}{'formula':>12}{'held':>11}{'formula':>11}"
             f"{'step peak':>11}{'opt. step':>11}{'link model':>12}"]
    for r in rows:
        lines.append(f"{r['layout']:10}{r['bytes']:>12,.0f}{r['formula']:>12,.0f}"
                     f"{r['held']:>11,}{r['held_formula']:>11,}{r['peak']:>11,}"
                     f"{r['seconds'] * 1e3:>9.1f}ms{r['link_s'] * 1e3:>10.1f}ms")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zerolab.course.muontable",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help="the course's GPT preset (default tiny)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks of the course's rows and run")
    ap.add_argument("--world-size", type=int, default=64, help="ranks of the 7.5B rows")
    ap.add_argument("--link", default="ib-ndr", help="link of the modelled times")
    ap.add_argument("--device", default="h100", help="device of the modelled times")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--link-gbps", type=float, default=1.0, help="the measured run's link")
    ap.add_argument("--link-latency-us", type=float, default=100.0)
    ap.add_argument("--no-run", action="store_true", help="formulas only")
    a = ap.parse_args(argv)
    link, device = hardware.get_link(a.link), hardware.get_device(a.device)
    where = f"{a.link}, {a.device} at MFU {MFU}"
    print(format_formula(f"formulas, {a.preset} GPT, N = {a.nproc}, fp32 ({where})",
                         formula_rows(get_config(a.preset), a.nproc, link, device)))
    print()
    print(format_formula(f"formulas, 7.5B GPT (36 x 4096), N = {a.world_size}, fp32 ({where})",
                         formula_rows(BIG, a.world_size, link, device)))
    if not a.no_run:
        print()
        print(format_measured(f"measured, {a.preset} GPT, {a.nproc} gloo ranks, fp32, link "
                              f"{a.link_gbps} Gbit/s + {a.link_latency_us} us (bytes per rank, "
                              "the busiest rank's)",
                              measured_rows(a.preset, a.nproc, a.steps, a.link_gbps,
                                            a.link_latency_us)))


if __name__ == "__main__":
    main()
