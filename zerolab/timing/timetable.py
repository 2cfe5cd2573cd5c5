"""The table `zerolab time` prints: every stage's step time from the cost model, and ZeRO-3's T*.

Idea: one place says what the model assumed, in the table's header (the width from Ψ ≈ 12·L·d²
when not given, the sequence length for attention's FLOPs, the MFU and its source, ring or tree
all_reduces), then replays each stage with and without overlap (`costmodel.step_time`) and prints
the threshold T* below which ZeRO-3 is communication-bound, at the MFU given and at `SENSITIVITY`'s.

    python -m zerolab time --params 7.5e9 --world-size 64 --tokens-per-rank 4096 --mfu 0.4
    python -m zerolab time --world-size 64 --ranks-per-node 8 --intra nvlink4 --inter ib-ndr

With two tiers (a `hardware.Topology`) the header shows both links and the NICs per node, every
stage's collectives run flat over all N ranks (one ring per NIC when N spans nodes: as fast as a
node's NICs together, `collectives.flat_leg`), an extra row replays
DDP with hierarchical all_reduces, two more replay ZeRO-3's hybrids (HSDP and hpZ,
zerolab.variants.hybrid: gathers inside a node), and the last column tags each op's milliseconds with the tier
they were paid at: "all_reduce 93.99 [inter]", "all_reduce 127.1 [intra 59.23 + inter 67.87]".
"""
from __future__ import annotations

import math
import numbers

from .. import theory
from . import costmodel
from .hardware import Device, Link, Topology

SENSITIVITY = (0.3, 0.4, 0.5, 1.0)          # the MFUs the threshold is also printed at


def _link_lines(name: str, link: Link, indent: str = "", per: str = "rank") -> list[str]:
    return [f"{indent}{name} {link.name}: β = {link.bandwidth / 1e9:.4g} GB/s per {per} per direction "
            f"({link.gbps:.4g} Gb/s), α = {link.latency * 1e6:.3g} us per ring step",
            f"{indent}  source: {link.source}"]


def network_lines(world_size: int, link: Link | Topology) -> list[str]:
    """The header lines that describe the network: one link, or two tiers, the NICs, and what a
    flat ring over all world_size ranks runs at."""
    if not isinstance(link, Topology):
        return _link_lines("link", link)
    k, n, c = link.ranks_per_node, world_size, link.nics
    nodes = -(-n // k)
    lines = [f"network: {nodes} node(s) x {k} ranks per node, {c} NIC{'s' if c > 1 else ''} per "
             "node (intra per GPU, inter per NIC)"]
    lines += _link_lines("intra", link.intra, "  ", "GPU") + _link_lines("inter", link.inter, "  ", "NIC")
    if nodes > 1:
        flat = costmodel.flat_link(link, n)
        how = (f"so a GPU sends 1/{k} of its ring bytes on a NIC and {k - 1}/{k} on {link.intra.name}"
               if link.nic_share == 1 else
               f"so a node's ring bytes leave through its {c} NIC{'s' if c > 1 else ''}")
        lines.append(f"  every stage's collectives are flat over all N = {n} ranks through {nodes} "
                     f"nodes: NCCL runs one ring per NIC, {how}; the ring runs at {flat.name}, "
                     f"{flat.bandwidth / 1e9:.4g} GB/s (2(m-1)·α_inter + 2(n-m)·α_intra "
                     "+ 2(n-1)/n·S·max(1/(k·β_nic), (k-1)/(k·β_intra)) for an all_reduce on m "
                     "nodes with a NIC per GPU); 'hierarchical' "
                     "all_reduces reduce_scatter intra, all_reduce S/k inter, all_gather intra")
    else:
        lines.append(f"  all N = {n} ranks fit in one node: every collective pays intra")
    return lines


def tagged_ops(st: costmodel.StepTime) -> str:
    """"all_reduce 611 [inter], all_gather 12 [intra 5 + inter 7]": ms by op, tagged by tier
    (untagged on one link)."""
    parts = []
    for op, tiers in st.by_op_tier().items():
        total = sum(tiers.values())
        if not total:
            continue
        if list(tiers) == ["link"]:
            parts.append(f"{op} {total * 1e3:.4g}")
        elif len(tiers) == 1:
            parts.append(f"{op} {total * 1e3:.4g} [{next(iter(tiers))}]")
        else:
            split = " + ".join(f"{t} {v * 1e3:.4g}" for t, v in tiers.items())
            parts.append(f"{op} {total * 1e3:.4g} [{split}]")
    return ", ".join(parts)


def format_time_table(psi: float, world_size: int, tokens_per_rank: float, link: Link | Topology,
                      device: Device, n_blocks: int = 32, precision: str = "bf16",
                      mfu: float = costmodel.MFU, *, d_model: int | None = None, seq_len: float = 2048,
                      algorithm: str = "ring") -> str:
    """The per-stage step time table that `zerolab time` prints (seconds shown as ms).

    Each of the n_blocks equal blocks is one transformer layer; its width d_model defaults to
    `shape_from_params` (Ψ ≈ 12·L·d²). seq_len: tokens per sequence for attention's FLOPs (at
    most tokens_per_rank; 0: the 6Ψ rule alone). mfu and algorithm: see `compute_time` and
    `collective_time`. link: one Link, or a hardware.Topology of two tiers (`network_lines`,
    `tagged_ops`)."""
    costmodel.check_mfu(mfu)
    costmodel.check_algorithm(algorithm)
    if not (isinstance(seq_len, numbers.Real) and 0 <= seq_len < math.inf):
        raise ValueError(f"seq_len {seq_len!r} must be a number of tokens >= 0")
    seq = min(seq_len, tokens_per_rank)
    d = costmodel.shape_from_params(psi, n_blocks) if d_model is None else d_model
    units = costmodel.uniform_units(psi, n_blocks, tokens_per_rank, device, mfu, d_model=d, seq_len=seq)
    attn = 12 * n_blocks * d * seq
    share = attn / (6 * psi + attn)
    given = "given" if d_model is not None else "from Ψ ≈ 12·L·d²"
    seqs = ("attention not counted (s = 0)" if not seq else f"in sequences of s = {seq:g}"
            + (" (capped at the tokens per rank)" if seq < seq_len else ""))
    lines = [f"Ψ = {psi:.4g} parameters in {n_blocks} equal blocks (one layer each, width d = {d:,} "
             f"{given}), N = {world_size} ranks, {tokens_per_rank:g} tokens per rank per step "
             f"{seqs}, {precision}",
             *network_lines(world_size, link),
             f"device {device.name}: {device.flops / 1e12:.4g} TFLOP/s peak x MFU {mfu:g} = "
             f"{device.flops * mfu / 1e12:.4g} TFLOP/s reached",
             f"  source: {device.source}; MFU {costmodel.MFU:g} (the default) from {costmodel.MFU_SOURCE}",
             f"compute: 6Ψ + 12·L·d·s FLOPs per token (PaLM appendix B); attention's 12·L·d·s is "
             f"{share:.1%} of them",
             costmodel.latency_note(world_size, link, algorithm), "",
             f"{'stage':<24}{'compute':>10}{'comm':>10}{'no overlap':>12}{'overlap':>10}"
             f"{'exposed':>10}   comm by op (ms)"]
    variants = [(s, False, False, None) for s in (0, 1, 2)] + [(3, False, False, None),
                                                              (3, True, False, None)]
    if isinstance(link, Topology) and 1 < link.ranks_per_node < world_size \
            and not world_size % link.ranks_per_node:
        variants.insert(1, (0, False, True, None))  # DDP with hierarchical all_reduces
        variants += [(3, True, False, "hsdp"), (3, True, False, "hpz")]    # zerolab.variants.hybrid
    for stage, prefetch, hier, hybrid in variants:
        ops = ("all_reduce", "reduce_scatter") if stage == 1 else (None,)
        for op in ops:
            kw = dict(prefetch=prefetch, precision=precision, zero1_grad_op=op or "all_reduce",
                      algorithm=algorithm, hierarchical=hier, hybrid=hybrid)
            serial = costmodel.step_time(stage, units, world_size, link, overlap=False, **kw)
            over = costmodel.step_time(stage, units, world_size, link, overlap=True, **kw)
            name = {"hsdp": "HSDP", "hpz": "ZeRO-3 hpZ"}.get(hybrid, theory.STAGE_NAMES[stage]) + (
                f" ({op})" if op else "") + (" +prefetch" if prefetch else "") + (
                " hierarchical" if hier else "")
            parts = tagged_ops(over)
            lines.append(f"{name:<24}{over.compute * 1e3:>10.4g}{over.comm * 1e3:>10.4g}"
                         f"{serial.total * 1e3:>12.4g}{over.total * 1e3:>10.4g}"
                         f"{over.exposed_comm * 1e3:>10.4g}   {parts}")
    block = psi / n_blocks
    shape = dict(d_model=d, seq_len=seq)
    t_star = costmodel.zero3_comm_bound_tokens(block, world_size, link, device, precision, mfu, **shape)
    bound = "communication-bound" if tokens_per_rank < t_star else "compute-bound"
    w = theory.bytes_per_param(precision)["params"]
    flat = costmodel.flat_link(link, world_size)
    bw_term = (world_size - 1) / world_size * w / 2 * device.flops * mfu / flat.bandwidth
    by_mfu = ", ".join(f"{m:g}: {costmodel.zero3_comm_bound_tokens(block, world_size, link, device, precision, m, **shape):,.0f}"
                       for m in SENSITIVITY)
    lines += ["", "times in ms per optimizer step; 'exposed' = overlap - compute (comm not hidden)",
              f"ZeRO-3 threshold: a block's all_gather equals its forward compute at T* = "
              f"{t_star:,.0f} tokens per rank; at {tokens_per_rank:g} tokens per rank ZeRO-3 is {bound}",
              f"  T* = all_gather x F·MFU / ((2Ψ_u + 4·d·s) FLOPs per token); its bandwidth part "
              f"without attention, (n-1)/n · (w/2) · F·MFU/β = {bw_term:,.0f} (w = {w} bytes per param, "
              f"β = {flat.bandwidth / 1e9:.4g} GB/s, {flat.name})",
              f"  T* at MFU {by_mfu} tokens per rank (T* grows with MFU: faster compute needs more "
              f"tokens to hide the same gather)"]
    return "\n".join(lines)
