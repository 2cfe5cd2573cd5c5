"""What if N = 1024? One rank of a large world, run by zerolab's own code, without the hardware.

Idea: the per-rank bytes of `theory.model_state_bytes` are a formula; this module gets them from
the code instead. It starts torch's fake process group (every collective returns at once and moves
nothing) in this process, builds the GPT on the meta device (shapes and dtypes, no storage), wraps
it in the real strategy, which builds its units and shards exactly as on a cluster, runs one
training step (forward, backward, AdamW on meta tensors) and reads what the rank holds by state
and what its ledger says it moved. Its "peak" is the largest total the memory meter saw during
the step: the five model states plus the transients (ZeRO-3's gathered blocks, gradient buckets
in flight, reduce_scatter outputs, the fp32 gradient copies of the optimizer step); activations
are not counted. The time comes from `costmodel.step_time` replaying that step's units on a named
link and device: (6Ψ_u + 12·L_u·d·T) FLOPs per token at the device's peak x MFU (0.4 unless
given), all_reduces as rings unless `algorithm` says "tree" or "auto".

    python -m zerolab whatif --preset 1b --world-size 1024
    python -m zerolab whatif --preset 1b --ranks-per-node 8 --intra nvlink4 --inter ib-ndr

With two tiers (a `hardware.Topology`) the time replays each collective flat over all N ranks
(one ring per NIC when N spans nodes, as fast as a node's NICs together: `costmodel.flat_leg`),
and a column says which tier the step's collectives paid.

The fake process group is torch's test utility (torch.testing._internal.distributed.fake_pg), the
one torch's own FSDP tests use for large worlds; it is private API and may move between releases.
"""
from __future__ import annotations

import sys
import textwrap

import torch
import torch.distributed as dist

from .. import theory
from ..variants.compose import make_strategy
from . import costmodel, hardware
from ..comm import Comm
from ..memory import TRANSIENT, MemoryMeter
from ..model import GPT, get_config

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: the largest world one process fakes: the fake process group and Comm keep a table of every
#: rank (N = 1e6: ~0.4 GB and ~10 s; 1e8 would take ~13 GB and minutes)
MAX_WORLD = 1_000_000


def state_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`, on meta as on real devices.

    Meta storages all report data_ptr 0, so storages are told apart by their StorageImpl."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def grad_copies(units) -> list:
    """The fp32 gradient copies (master.grad) that are not views of a gradient buffer, told apart
    by StorageImpl: `sharding.grad_copies` compares data_ptr, which is 0 for every meta storage,
    so on meta it would take every copy for a view and count none."""
    bufs = {t.untyped_storage()._cdata for u in units
            for t in (u.grad_flat, u.grad_shard, u.bucket) if t is not None}
    return [u.master.grad for u in units if u.master is not None and u.master.grad is not None
            and u.master.grad.untyped_storage()._cdata not in bufs]


class _MetaMeter(MemoryMeter):
    """MemoryMeter that counts meta storages too (same samples, same peaks)."""

    def sample(self, strategy, tag: str = ""):
        held = strategy.state_tensors()
        if "grad_fp32" in held:
            held["grad_fp32"] = grad_copies(strategy.units)
        self.current = {cat: state_bytes(ts) for cat, ts in held.items()}
        for cat, b in self.current.items():
            self.peak[cat] = max(self.peak.get(cat, 0), b)
        self.peak_total = max(self.peak_total, sum(self.current.values()))


def fake_world(world_size: int, rank: int = 0):
    """Start torch's fake process group of `world_size` in this process (context manager)."""
    from contextlib import contextmanager

    from torch.testing._internal.distributed.fake_pg import FakeStore

    @contextmanager
    def world():
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process; "
                               "whatif needs its own fake process group")
        hook = sys.excepthook       # torch wraps it at every init ("[rank0]: " once more)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook
    return world()


def rank_report(stage: int, model: torch.nn.Module, comm: Comm, *, precision="bf16",
                tokens: int = 1, zero3_prefetch=False, zero1_grad_op="all_reduce",
                bucket_mb: float | None = None, **options) -> dict:
    """Run one training step of `stage` on `model` (meta or real) with `comm`; return what rank
    holds after the step (bytes by state), its peak within the step, and its ledger's bytes.

    tokens: the sequence length of the single row fed through (meta: no cost). bucket_mb:
    gradient bucket cap in MiB for stages 0-2 (None: one bucket per block; stage 3 ignores it).
    options: further variants for `make_strategy` (hybrid, quantize, ...; zerolab.course.papers)."""
    kwargs = {"prefetch": zero3_prefetch} if stage == 3 else (
        {"grad_op": zero1_grad_op, "bucket_mb": bucket_mb} if stage == 1
        else {"bucket_mb": bucket_mb})
    kwargs.update(options)
    meter = _MetaMeter()
    comm.records.clear()
    comm.step = 0
    strategy = make_strategy(stage, model, comm, meter=meter, **kwargs)
    device = next(model.parameters()).device
    x = torch.zeros(1, tokens, dtype=torch.long, device=device)
    meter.sample(strategy, "step start")
    loss = strategy.forward(x, x)
    strategy.backward(loss)
    strategy.step()
    meter.sample(strategy, "step done")
    psi = sum(u.numel for u in strategy.units)
    psi_padded = sum(u.padded_numel for u in strategy.units)
    current = {s: meter.current.get(s, 0) for s in theory.STATES}
    return {"stage": stage, "name": theory.STAGE_NAMES[stage], "rank": comm.rank,
            "world_size": comm.world_size, "num_params": psi, "num_params_padded": psi_padded,
            "model_states": current, "model_states_total": sum(current.values()),
            "peak": dict(meter.peak), "peak_total": meter.peak_total,
            "transient_peak": {c: meter.peak.get(c, 0) for c in TRANSIENT},
            "traffic_per_step": {op: b for op, b in comm.bytes_by_op(step=0).items()
                                 if op != "broadcast"},
            "collectives_per_step": sum(r.what in ("grads", "params") for r in comm.records),
            "grad_collectives_per_step": sum(r.what == "grads" for r in comm.records),
            "units": [(u.name, u.numel) for u in strategy.units]}


def whatif(preset: str = "1b", world_size: int = 1024, stages=(0, 1, 2, 3), *, rank: int = 0,
           precision: str = "bf16", zero3_prefetch: bool = False) -> list[dict]:
    """One report per stage (see `rank_report`) for `rank` of a fake world of `world_size`, the
    preset's GPT built on the meta device, plus the formula at the padded Ψ for comparison."""
    theory.check_world_size(world_size)
    if world_size > MAX_WORLD:
        raise ValueError(f"world_size {world_size:,} is more than whatif's {MAX_WORLD:,} ranks (a "
                         f"fake world keeps a table of every rank); zerolab memory and zerolab "
                         f"time take any N")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(DTYPES)}")
    cfg = get_config(preset)
    reports = []
    with fake_world(world_size, rank):
        comm = Comm()
        for stage in stages:
            theory.check_stage(stage)
            with torch.device("meta"):
                model = GPT(cfg).to(DTYPES[precision])
            r = rank_report(stage, model, comm, precision=precision, tokens=cfg.block_size,
                            zero3_prefetch=zero3_prefetch)
            r["formula"] = theory.model_state_bytes(r["num_params_padded"], world_size, stage, precision)
            r["formula_traffic"] = theory.traffic_bytes(r["num_params_padded"], world_size, stage,
                                                        precision)
            r["preset"] = preset
            r["shape"] = {"n_layer": cfg.n_layer, "d_model": cfg.n_embd, "seq_len": cfg.block_size}
            reports.append(r)
    return reports


def unit_layers(name: str) -> int:
    """Transformer layers in a unit: "block.3" 1, a merged bucket "block.0-2" 3, "root" 0."""
    if not name.startswith("block."):
        return 0
    first, _, last = name.split(".", 1)[1].partition("-")
    return int(last) - int(first) + 1 if last else 1


def step_times(report: dict, link: hardware.Link | hardware.Topology, device: hardware.Device,
               tokens_per_rank: float, precision: str = "bf16", mfu: float = costmodel.MFU,
               algorithm: str = "ring") -> dict:
    """Cost-model step time (seconds) of a report's stage on its real units, with and without
    overlap (and with ZeRO-3 prefetch). Compute per unit: (6Ψ_u + 12·L_u·d·T) FLOPs per token at
    F · MFU, L_u the unit's layers (0 for the root: embeddings, head), d and T from the report's
    preset ("shape"; without one, 6Ψ_u alone). algorithm: how the all_reduces are modelled.
    link: one Link or a Topology of two tiers (`costmodel.step_time`)."""
    shape = report.get("shape", {})
    units = []
    for name, numel in report["units"]:
        kw = dict(mfu=mfu, n_layer=unit_layers(name), d_model=shape.get("d_model", 0),
                  seq_len=min(shape.get("seq_len", 0), tokens_per_rank))
        units.append(costmodel.Unit(name, numel,
                                    costmodel.compute_time(numel, tokens_per_rank, device,
                                                           passes="fwd", **kw),
                                    costmodel.compute_time(numel, tokens_per_rank, device,
                                                           passes="bwd", **kw)))
    n, s = report["world_size"], report["stage"]
    kw = dict(precision=precision, algorithm=algorithm)
    out = {"no_overlap": costmodel.step_time(s, units, n, link, overlap=False, **kw),
           "overlap": costmodel.step_time(s, units, n, link, **kw)}
    if s == 3:
        out["prefetch"] = costmodel.step_time(s, units, n, link, prefetch=True, **kw)
    return out


PEAK_NOTE = ("peak: the largest total the memory meter saw during the step: the five model states "
             "plus the transients - ZeRO-3's gathered blocks, gradient buckets in flight, "
             "reduce_scatter outputs, the fp32 gradient copies AdamW reads inside the optimizer "
             "step; activations are not counted (notebook 10)")


def format_whatif(reports: list[dict], link, device, tokens_per_rank, precision="bf16",
                  mfu: float = costmodel.MFU, algorithm: str = "ring") -> str:
    """The table `zerolab whatif` prints: bytes by state (code vs formula), the step's peak
    (`PEAK_NOTE`) and the modelled time (at F · MFU, all_reduces by `algorithm`) on `link`, one
    Link or a hardware.Topology of two tiers ("pays": the tiers its collectives paid)."""
    costmodel.check_mfu(mfu)
    two = isinstance(link, hardware.Topology)
    r0 = reports[0]
    gb = 1e9
    shape = r0.get("shape")
    lines = [f"preset {r0['preset']}: Ψ = {r0['num_params']:,} (padded {r0['num_params_padded']:,}), "
             f"rank {r0['rank']} of N = {r0['world_size']} on a fake process group, {precision}",
             "per-rank bytes after the step, from the code (formula at the padded Ψ in brackets), GB"]
    head = f"{'stage':<8}" + "".join(f"{s:>22}" for s in (*theory.STATES, "total")) + f"{'peak':>10}"
    lines.append(head)
    for r in reports:
        cells = [f"{r['model_states'][s] / gb:.4g} ({r['formula'][s] / gb:.4g})" for s in theory.STATES]
        cells.append(f"{r['model_states_total'] / gb:.4g} ({sum(r['formula'].values()) / gb:.4g})")
        lines.append(f"{r['name']:<8}" + "".join(f"{c:>22}" for c in cells)
                     + f"{r['peak_total'] / gb:>10.4g}")
    lines += textwrap.wrap(PEAK_NOTE, 110)
    attn = (f"6Ψ + 12·L·d·s FLOPs per token (L = {shape['n_layer']}, d = {shape['d_model']}, "
            f"s = {min(shape['seq_len'], tokens_per_rank):g})" if shape else "6Ψ FLOPs per token")
    lines += ["", f"bytes per step from the ledger (formula), GB; time from the cost model: "
              f"{tokens_per_rank:g} tokens/rank, {device.name} at MFU {mfu:g} ({attn}), "
              + (f"link {link.name}, ms" if not two else
                 f"two tiers: {link.describe(r0['world_size'])}; each collective flat over all N "
                 "ranks, one ring per NIC, ms"),
              costmodel.latency_note(r0["world_size"], link, algorithm),
              f"{'stage':<8}{'moved':>18}{'collectives':>13}{'no overlap':>12}{'overlap':>10}"
              f"{'prefetch':>10}" + (f"{'pays':>8}" if two else "")]
    for r in reports:
        t = step_times(r, link, device, tokens_per_rank, precision, mfu, algorithm)
        moved = f"{sum(r['traffic_per_step'].values()) / gb:.4g} ({sum(r['formula_traffic'].values()) / gb:.4g})"
        pre = f"{t['prefetch'].total * 1e3:.4g}" if "prefetch" in t else "-"
        lines.append(f"{r['name']:<8}{moved:>18}{r['collectives_per_step']:>13}"
                     f"{t['no_overlap'].total * 1e3:>12.4g}{t['overlap'].total * 1e3:>10.4g}{pre:>10}"
                     + (f"{'+'.join(t['overlap'].tiers()):>8}" if two else ""))
    return "\n".join(lines)
