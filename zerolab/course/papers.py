"""The papers, reproduced on a laptop: every published number the course can check, checked.

Idea: a learner trusts a course that shows its sources agreeing with it, and learns
most where they do not. Each `Row` puts one published figure next to zerolab's prediction (the
formulas of `theory` / `tiers` / `offload`, the cost model of `timing`) and this laptop's
measurement (zerolab's own strategies, one step on torch's fake process group: the ledger's bytes
and the memory meter's bytes, exact and deterministic; two rows are timed: prefetch on the
emulated link, the host's AdamW under ZeRO-Offload's delayed update), scaled
where the paper's size cannot run here (`scaling` says how). The verdict is computed: "agrees"
when the prediction and the measurement are both within the row's stated relative tolerance of
the published value, else "disagrees" naming the column(s) off; a row that disagrees carries a
line saying why, and every row a "predict, then measure" question.

    zerolab papers                                    # the table (6-15 s on 2 cores)
    zerolab papers --markdown --out site/papers.md    # the site's page (committed)
    zerolab papers --json                             # every row as JSON

`build()` returns the rows; `zerolab.course.papermeasure` takes the laptop's measurements and
`zerolab.course.papertable` writes the rows as text, markdown or JSON.

Sources, each number checked in the text where it could be reached here (`rechecked` says where
not): ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054: Figure 1, Tables 1-2, section 7), FSDP
(Zhao et al. 2023, arXiv:2304.11277), ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840), ZeRO++
(Wang et al. 2023, arXiv:2306.10209), "How to Scale Your Model" (Austin et al. 2025, "How to Think
About GPUs", Data Parallelism), and the course's seed notes (../shared/seeds/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import theory
from ..variants import offload, tiers
from ..comm import Comm
from ..variants.compose import make_strategy
from ..model import GPT, get_config
from ..variants.prefetch import DEFAULT_PREFETCH
from ..timing import costmodel, hardware, whatif
from .papermeasure import held_elements, host_adamw_seconds, one_step, prefetch_gain

GB, BILLION = 1e9, 1e9
V100 = 32e9                     # the ZeRO paper's GPU memory (Table 2): 32 GB V100
#: `Row.rechecked` where the paper's own text could not be read here (no network to its PDF):
#: whose quotation the value is
ISSUE = ("not rechecked against the paper's own text (its PDF could not be reached offline): "
         "the value as the course's planning notes quote it")
TABLE2 = ("checked against a transcription of Table 2 (values and MP / GPU rows), not the paper's "
          "PDF")
COURSE = "not rechecked in the paper here (its text could not be reached): as the course quotes it"


@dataclass
class Row:
    """One published figure. Values are tuples of floats in `unit`; `measured` None: this
    laptop cannot measure it (yet: `hook` names what is missing). `tolerance`: accepted relative
    error against `published` (absolute where the published value is 0). `timed`: the measured
    (and predicted) values are times, so they vary between runs."""
    key: str
    claim: str
    source: str
    published: tuple
    predicted: tuple
    measured: tuple | None
    unit: str
    scaling: str
    tolerance: float
    why: str = ""
    question: str = ""
    rechecked: str = "yes"
    timed: bool = False
    hook: str = ""
    verdict: str = field(default="", init=False)

    def __post_init__(self):
        self.verdict = verdict(self)


def _close(got, want, tol: float) -> bool:
    return len(got) == len(want) and all(
        abs(g - w) <= tol * (abs(w) if w else 1.0) for g, w in zip(got, want))


def verdict(row: Row) -> str:
    """"agrees" when the predicted and (if any) measured values are within `row.tolerance` of
    the published ones, else "disagrees (predicted, measured)" naming the columns off; a timed
    row on a busy machine is "not judged (why)"."""
    busy = busy_machine() if row.timed else ""
    if busy:
        return f"not judged ({busy})"
    off = [name for name, got in (("predicted", row.predicted), ("measured", row.measured))
           if got is not None and not _close(got, row.published, row.tolerance)]
    return "agrees" if not off else f"disagrees ({', '.join(off)})"


def busy_machine() -> str:
    """Why a timed row cannot be judged here now ("" when it can): other work keeps more than one
    process per usable core running (1-minute load average), so step times are the scheduler's,
    not the model's (measured: the prefetch gain read 0.165, -0.004, 0.017, -0.025 in four runs
    at load 7 on 2 cores)."""
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (f"timed, and the machine is busy: load average {load:.1f} on {cores} core(s); run "
            "it again on an idle machine") if load > cores else ""


def _per_param(report: dict, key: str = "model_states_total") -> float:
    return report[key] / report["num_params_padded"]


_traffic = (lambda ledger: sum(ledger.values()))


# --- the rows ----------------------------------------------------------------------------------
def seed_notes() -> list[Row]:
    """The notes' 16 / 5.5 / 3.75 / 2 bytes per parameter at N = 8 and ZeRO-3's 1.5x traffic."""
    pub = (16, 5.5, 3.75, 2)
    reps = [one_step(8, s) for s in theory.STAGES]
    ratio = _traffic(reps[3][1]) / _traffic(reps[0][1])
    return [
        Row("notes-bytes", "model-state bytes per parameter per rank, DDP / ZeRO-1 / -2 / -3, N = 8",
            "seed notes (fsdp_zero123_sharding_notes.md, 每卡显存 at 8 cards: 16N / 5.5N / "
            "3.75N / 2N)", pub,
            tuple(theory.model_state_total(1.0, 8, s) for s in theory.STAGES),
            tuple(_per_param(r) for r, _ in reps), "bytes/param",
            "GPT nano (Ψ = 34,688 padded), rank 0 of a fake world of 8: the meter's bytes / Ψ",
            0.001, question="ZeRO-2 at N = 16: bytes per parameter? (then `zerolab whatif "
            "--preset nano --world-size 16`)"),
        Row("notes-1.5x", "ZeRO-3's bytes sent per step / DDP's", "seed notes, 通信代价的直觉 "
            "(ZeRO-3: two all_gathers and a reduce_scatter; the 1.5x as notebook 07 derives it)",
            (1.5,), (sum(theory.traffic_bytes(1.0, 8, 3).values())
                     / sum(theory.traffic_bytes(1.0, 8, 0).values()),), (ratio,), "x",
            "ledger of rank 0, GPT nano, fake world of 8", 0.001,
            question="With 4 micro-steps of gradient accumulation, ZeRO-3 over DDP? "
                     "(theory.traffic_bytes(grad_accum=4))"),
    ]


def zero_memory() -> list[Row]:
    """ZeRO Table 1 / Figure 1 at Ψ = 7.5B, N = 4 and 64; Table 2's largest models."""
    rows = []
    for n, pub, src, tol in ((4, (120, 52.5, 41.3, 30), "ZeRO, Table 1 (7.5B, DP 4)", 0.005),
                             (64, (120, 31.4, 16.6, 1.9), "ZeRO, Figure 1 (7.5B, N_d = 64)", 0.02)):
        reps = [one_step(n, s)[0] for s in theory.STAGES]
        rows.append(Row(
            f"zero-gb-{n}", f"per-rank model states at Ψ = 7.5B, N = {n}, DDP / P_os / P_os+g / "
            f"P_os+g+p", src, pub,
            tuple(theory.model_state_total(7.5e9, n, s) / GB for s in theory.STAGES),
            tuple(_per_param(r) * 7.5e9 / GB for r in reps), "GB",
            f"the meter's bytes per parameter on GPT nano, rank 0 of a fake world of {n}, "
            "x 7.5e9", tol, rechecked=ISSUE if n == 4 else COURSE + " (theory.py)",
            question=f"ZeRO-2 over DDP at N = {n}: predict the ratio, then divide the measured "
                     "column's third value by its first"))
    n = 64
    reps = [one_step(n, s)[0] for s in theory.STAGES]
    states = tuple(V100 / theory.model_state_total(1.0, n, s) / BILLION for s in theory.STAGES)
    rows.append(Row(
        "zero-table2-theory", "largest model on 64 V100s (32 GB), MP 1: DDP / P_os / P_os+g / "
        "P_os+g+p, from the memory analysis", "ZeRO, Table 2 (left; section 5.4)",
        (2, 7.6, 14.4, 128), states, tuple(V100 / _per_param(r) / BILLION for r in reps),
        "B params", "32 GB / the meter's model-state bytes per parameter (GPT nano, fake world "
        "of 64)", 0.01, rechecked=TABLE2,
        question="P_os+g at 1024 GPUs (MP 16): predict, then check Table 2's 230.4B"))
    peak = tuple(V100 / _per_param(r, "peak_total") / BILLION for r in reps[:2])
    gap = [(reps[s]["peak_total"] - reps[s]["model_states_total"]) / reps[s]["num_params_padded"]
           for s in (0, 1)]
    rows.append(Row(
        "zero-table2-measured", "largest model measured on 64 V100s: DDP / P_os",
        "ZeRO, Table 2 (right: measured)", (1.3, 6.2), states[:2], peak, "B params",
        "32 GB / the meter's peak bytes per parameter inside the step (states + transients), "
        "GPT nano, fake world of 64; activations not counted", 0.05, rechecked=TABLE2,
        why=(f"The memory analysis counts model states only. The meter's peak adds the step's "
             f"transients, {gap[0]:.2f} bytes/param in DDP and {gap[1]:.2f} in P_os (the fp32 "
             f"gradient copies AdamW reads: `theory.peak_step_bytes`): that explains "
             f"{states[0] - peak[0]:.2f}B of DDP's {states[0] - 1.3:.2f}B gap and "
             f"{states[1] - peak[1]:.2f}B of P_os's {states[1] - 6.2:.2f}B. The rest is what the "
             "paper calls residual memory (section 3.2). It is activations (batch x sequence x "
             "width x layers, not Ψ), temporary buffers and fragmented free blocks. A meter of "
             "states cannot see them (notebook 10 measures activations with the allocator)."),
        question="A 1.3B GPT-2 in the paper's run: with 16 + 4 bytes/param at the peak, how "
                 "many GB are left on 32 GB for activations and fragmentation?"))
    return rows


def zero_traffic() -> list[Row]:
    """ZeRO section 7: P_os and P_os+g move what DDP moves, P_os+g+p 1.5x."""
    n = 8
    ddp = _traffic(one_step(n, 0)[1])
    pred = lambda s, op="reduce_scatter": (sum(theory.traffic_bytes(1.0, n, s, zero1_grad_op=op)
                                                .values()) / sum(theory.traffic_bytes(1.0, n, 0)
                                                                 .values()))
    meas = (_traffic(one_step(n, 1, grad_op="reduce_scatter")[1]) / ddp,
            _traffic(one_step(n, 2)[1]) / ddp, _traffic(one_step(n, 3)[1]) / ddp)
    notes = _traffic(one_step(n, 1)[1]) / ddp
    where = "ledger of rank 0, GPT nano, fake world of 8, bytes sent per step / DDP's"
    return [
        Row("zero-s7", "bytes sent per step over DDP's: P_os (reduce_scatter) / P_os+g / P_os+g+p",
            "ZeRO, section 7 (7.2.1, 7.2.2)", (1, 1, 1.5),
            (pred(1), pred(2), pred(3)), meas, "x", where, 0.001, rechecked=COURSE,
            question="P_os+g+p with 2 micro-steps of gradient accumulation: bytes per step "
                     "over DDP's? (theory.traffic_bytes(grad_accum=2))"),
        Row("zero-s7-notes", "zerolab's default ZeRO-1 (the notes' all_reduce) over DDP",
            "ZeRO, section 7.2.1 (P_os: same volume as DDP)", (1,), (pred(1, "all_reduce"),),
            (notes,), "x", where, 0.001, rechecked=COURSE,
            why="The paper's P_os reduce-scatters the gradients ((N-1)/N·2Ψ) and all-gathers the "
                "weights ((N-1)/N·2Ψ): DDP's 2(N-1)/N·2Ψ. The seed notes' ZeRO-1 all-reduces the "
                "whole gradient and then all-gathers: 3(N-1)/N·2Ψ, 1.5x. `--zero1-grad-op "
                "reduce_scatter` is the paper's (the row above).",
            question="ZeRO-1 with --zero1-grad-op all_reduce at N = 2: bytes per step over DDP's?"),
    ]


def fsdp_rows() -> list[Row]:
    """FSDP: padding (flat vs dim-0), hybrid sharding's cross-host bytes, the rate limiter, and
    backward prefetch on the emulated link."""
    f = 16
    flat_max = max(theory.padded_numel(k, f) - k for k in range(1, 2 * f + 1))
    allocated = {layout: held_elements(layout, (4, 3), f) for layout in ("flat", "dim0")}
    worst = held_elements("flat", (f + 1,), f) - (f + 1)
    rep, led = one_step(8, 3, hybrid="hsdp", ranks_per_node=4)
    m = 2 * rep["num_params_padded"]                     # M: the bf16 gradient bytes
    w, g = 8, 4
    hyb = tiers.hybrid_traffic_bytes(1.0, w, g, "hsdp")["inter"]["all_reduce"] / 2
    depth = {d: one_step(2, 3, "tiny", prefetch=d)[0] for d in (0, DEFAULT_PREFETCH, -1)}
    block = 2 * next(k for name, k in depth[0]["units"] if name.startswith("block."))
    gathered = {d: r["peak"]["gathered_params"] for d, r in depth.items()}
    in_flight = 1 + (gathered[DEFAULT_PREFETCH] - gathered[0]) / block
    saved = gathered[-1] - gathered[DEFAULT_PREFETCH]
    gain = prefetch_gain()
    return [
        Row("fsdp-pad-flat", f"most padding of a flat unit on F = {f} ranks (at most F - 1)",
            "FSDP, Figure 3 (FlatParameter padding)", (f - 1,), (flat_max,),
            (worst,), "elements", f"fully_shard(layout='flat') of a {f + 1}-element parameter, "
            f"rank 0 of a fake world of {f}: held elements x {f} - {f + 1}", 0,
            rechecked=ISSUE, question=f"A 4 x 3 weight on {f} ranks, flat: padded "
                                              "elements?"),
        Row("fsdp-pad-dim0", f"elements allocated for a 4 x 3 weight sharded on dim 0 over {f} "
            "ranks (its 12 elements sit on 4 of them)", "FSDP2 per-parameter dim-0 sharding (as "
            "the planning notes quote the FSDP paper's padding discussion)", (48,),
            (f * math.ceil(4 / f) * 3,), (allocated["dim0"],), "elements",
            f"fully_shard(layout='dim0'), rank 0 of a fake world of {f}: held elements x {f} "
            f"(flat: {allocated['flat']:.0f})", 0, rechecked=ISSUE,
            question="The same weight as 3 x 4 (transposed): elements allocated on dim 0?"),
        Row("fsdp-hybrid", "hybrid sharding's cross-host bytes per GPU, W = 8, G = 4, in M "
            "(the gradient bytes)", "FSDP, section 3.2.2: 2M(W-1)/(GW)", (2 * (w - 1) / (g * w),),
            (hyb,), (led[("all_reduce", "backward", "inter")] / m,), "M",
            "ledger of rank 0, zerolab's HSDP (`--hybrid hsdp`), GPT nano, fake world of 8 in "
            "nodes of 4", 0.01, rechecked=COURSE + " (tiers.py, notebook 13)",
            why="Each of the G shard positions all-reduces its 1/G shard (M/G bytes) across the "
                "W/G replicas: a ring of W/G ranks sends 2(W/G-1)/(W/G)·M/G = 2M(W-G)/(GW). The "
                "paper's formula has W-1 where the ring has W-G; the two meet only as W/G grows.",
            question="W = 64, G = 8: the ledger's cross-host bytes in M, and the paper's?"),
        Row("fsdp-limiter", "all-gathers in flight under FSDP's rate limiter (zerolab: prefetch "
            "depth 1)", "FSDP, the rate limiter (at most two all-gathers in flight)", (2,),
            (DEFAULT_PREFETCH + 1,), (in_flight,), "blocks",
            f"the meter's gathered blocks at the peak, GPT tiny, ZeRO-3, fake world of 2; "
            f"unlimited (depth -1) holds {saved:,.0f} bytes more ({saved / block:.0f} blocks)",
            0, rechecked=ISSUE,
            question="GPT small (6 blocks) with --zero3-prefetch-depth -1: blocks gathered at "
                     "the peak?"),
        Row("fsdp-prefetch", "step time saved by backward prefetch", "FSDP, evaluation of "
            "backward prefetching (~18 %)", (0.18,), (gain["predicted"],), (gain["measured"],),
            "fraction", gain["scaling"], 0.35, rechecked=ISSUE, timed=True,
            why="The gain is the share of the step the next block's all_gather can hide behind "
                "compute. It grows with the link's time over the compute's. So it is the paper's "
                "~18 % only on a link as slow, relative to compute, as the paper's.",
            question="On a 10x faster emulated link (--link-gbps 10), predict the gain, then "
                     "`zerolab time` it"),
    ]


def offload_rows() -> list[Row]:
    """ZeRO-Offload: 4Ψ bytes over PCIe per step (fp16 gradients down, fp16 weights up), and
    what the one-step delayed parameter update (DPU) leaves of the host's update in the step."""
    cfg = get_config("nano")
    with whatif.fake_world(1):
        torch.manual_seed(0)
        s = make_strategy(2, GPT(cfg).to(torch.bfloat16), Comm(), offload=offload.Offload())
        x = torch.zeros(1, cfg.block_size, dtype=torch.long)
        s.backward(s.forward(x, x))
        s.step()
        moved = sum(s.offload.step_bytes(0).values()) / sum(u.padded_numel for u in s.units)
        s.close()
    host = host_adamw_seconds()
    psi, tokens, achieved = 10e9, 4096, 40e12       # the paper's 10B on one V100 at 40 TFLOP/s
    device_s = 6 * psi * tokens / achieved
    cpu_s = host * psi + offload.link_seconds(4 * psi, hardware.get_link("pcie4"), 2)
    dpu = max(device_s, cpu_s)                      # DPU: the update overlaps the next step
    hide = cpu_s * achieved / (6 * psi)
    return [Row("offload-pcie", "bytes over PCIe per step, per parameter (L2L moves 28Ψ)",
                "ZeRO-Offload, section 4 and Table 1 (the least CPU-GPU volume of any offload "
                "strategy, 4M)", (4,), (sum(offload.transfer_bytes(1.0, 1).values()),),
                (moved,), "bytes/param", "zerolab's offload ledger (down + up), ZeRO-2 + "
                "--offload-optimizer on GPT nano, one rank (the device emulated on the CPU)", 0.001,
                rechecked="4M checked against transcriptions of the paper's Table 1, not its PDF; "
                          "L2L's 28Ψ as the planning notes quote it",
                question="At N = 8 ranks, bytes over each rank's PCIe per step per parameter?"),
            Row("offload-dpu", "share of the step the host's update still adds with DPU",
                "ZeRO-Offload, one-step delayed parameter update (hides the CPU's update behind "
                "the GPU's forward and backward)", (0,), ((dpu - device_s) / dpu,), None,
                "fraction", f"cost model: 10B on one V100 at the paper's 40 TFLOP/s, {tokens} "
                f"tokens a step (the course's default; the paper's batch not quoted here). GPU "
                f"{device_s:.1f} s. Host: this machine's AdamW as the offload runs it (one flat "
                f"fp32 buffer, {host * 1e9:.1f} ns/param) x 10B + 4Ψ over PCIe 4 = {cpu_s:.1f} s. "
                f"Step "
                f"{device_s + cpu_s:.1f} s without DPU, {dpu:.1f} s with", 0.05,
                rechecked=ISSUE, timed=True,
                why=f"DPU hides the update only while the GPU's step is the longer: at this "
                    f"machine's AdamW speed that takes {hide:,.0f} tokens a step, not {tokens}. "
                    "The paper's host runs a vectorised CPU-Adam (SIMD, unrolled, OpenMP) on "
                    "server cores, several times faster than torch's AdamW on a laptop.",
                question="How many tokens per step hide the host's update at this machine's "
                         "speed? Then on a host 6x faster?")]


def _cross_node_m(step, k: int) -> float:
    """Bytes one node sends across per step (`tiers.cross_node_bytes`: a world ring once per NIC,
    an inter-node group k times), in M = 2Ψ, the fp16 model's bytes, from a `one_step` ledger."""
    rep, ledger = step
    by_group: dict = {}
    for (op, _, tier), b in ledger.items():
        by_group.setdefault(tier, {})
        by_group[tier][op] = by_group[tier].get(op, 0.0) + b
    return tiers.cross_node_bytes(by_group, k) / (2 * rep["num_params_padded"])


def _zeropp_cross(step) -> float:
    """Bytes a rank sends across nodes per step (rings through the whole world, and the inter
    tier's), in M·(N-1)/N, M = 2Ψ (fp16/bf16 bytes of the model)."""
    rep, ledger = step
    n = rep["world_size"]
    world = sum(b for (_, _, tier), b in ledger.items() if tier in ("world", "inter"))
    return world / (2 * rep["num_params_padded"] * (n - 1) / n)


def _op_bytes(ledger: dict, op: str) -> float:
    return sum(b for (o, _, _), b in ledger.items() if o == op)


def zeropp_rows() -> list[Row]:
    """ZeRO++: cross-node 3M -> 0.75M with the three, and each one's own reduction."""
    n, k = 8, 4
    shards = [u / n for _, u in one_step(n, 3)[0]["units"]]
    plain = theory.quantized_traffic_bytes(shards, n)
    q = theory.quantized_traffic_bytes(shards, n, "int8", "int4")
    qw, qg = q["all_gather"] / plain["all_gather"], q["reduce_scatter"] / plain["reduce_scatter"]
    base = one_step(n, 3)[1]
    mw = one_step(n, 3, quantize={"weights": "int8"})[1]
    mg = one_step(n, 3, quantize={"grads": "int4"})[1]
    hp = _zeropp_cross(one_step(n, 3, hybrid="hpz", ranks_per_node=k))
    hp_model = sum(tiers.hybrid_traffic_bytes(1.0, n, k, "hpz")["world"].values()) / (2 * (n - 1) / n)
    big_n, big_k = 64, 8                    # the paper's limit needs many nodes: N = 64, k = 8
    combined = _cross_node_m(one_step(big_n, 3, hybrid="hpz", ranks_per_node=big_k,
                                      quantize={"weights": "int8", "grads": "int4"}), big_k)
    src = "ZeRO++ (arXiv:2306.10209)"
    where = f"ledger of rank 0, GPT nano, fake world of {n}"
    return [
        Row("zeropp-all", "bytes a node sends across per step with hpZ + qwZ + qgZ, in M "
            "(ZeRO-3: 3M)", src + ", abstract and section 3: 3M -> 0.75M", (0.75,),
            (tiers.zeropp_cross_node_in_m(big_n, big_k, 256)["zero++"],), (combined,), "M",
            f"ledger of rank 0, GPT nano, fake world of {big_n} in nodes of {big_k}, --hybrid "
            "hpz --quantize-weights int8 --quantize-grads int4 (qgZ in two hops). Prediction: "
            "tiers.zeropp_cross_node_in_m, (N-1)/N(1/2 + 2/B) + (m-1)/m(1/4 + 2/B) with m nodes "
            "and an fp32 scale per B = 256 values. The paper's 0.75M is its limit for many nodes",
            0.05, question="At N = 8 in nodes of 4 (two nodes): predict the M, then run "
                           "tiers.zeropp_cross_node_in_m(8, 4, 256)"),
        Row("zeropp-qwz", "qwZ: weight all_gather bytes, int8 over fp16",
            src + ": qwZ halves the all-gather (fp16 -> int8)", (0.5,), (qw,),
            (_op_bytes(mw, "all_gather") / _op_bytes(base, "all_gather"),), "x",
            where + ", --quantize-weights int8", 0.05,
            question="Block 64 instead of 256: predict qwZ's ratio (theory.quantized_bytes)"),
        Row("zeropp-qgz", "qgZ: gradient reduce bytes, int4 over fp16",
            src + ": qgZ's int4 gradients", (0.25,), (qg,),
            (_op_bytes(mg, "reduce_scatter") / _op_bytes(base, "reduce_scatter"),),
            "x", where + ", --quantize-grads int4 (one hop)", 0.05, rechecked=ISSUE,
            question="qgZ with int8 codes: predict the ratio"),
        Row("zeropp-hpz", "hpZ: cross-node bytes per step in M (the backward gathers inside a "
            "node)", src + ": hpZ, no inter-node backward all-gather", (2,), (hp_model,), (hp,),
            "M", where + " in nodes of 4, --hybrid hpz", 0.001,
            question="hpZ's extra memory per rank at N = 64, k = 8, in bytes per parameter?"),
    ]


def scaling_book_rows() -> list[Row]:
    """Tokens per GPU above which FSDP is compute-bound on H100s, from the cost model with the
    book's inputs: 990e12 FLOP/s, 450 GB/s inside a node, 400 GB/s a node across, α = 0, MFU 1."""
    h100 = hardware.Device("h100 (the book's 990e12)", 990e12)
    nvlink, nic = hardware.parse_link("3600"), hardware.parse_link("400")     # Gb/s, α = 0
    inside = costmodel.zero3_comm_bound_tokens(1e9, 8, nvlink, h100, mfu=1.0)
    topo = hardware.get_topology(8, nvlink, nic, 1024)
    across = costmodel.zero3_comm_bound_tokens(1e9, 1024, topo, h100, mfu=1.0)
    src = "How to Scale Your Model, \"How to Think About GPUs\", Data Parallelism"
    return [
        Row("book-node", "tokens per GPU for compute-bound FSDP inside an 8-GPU H100 node",
            src + ": 990e12 / 450e9", (2200,), (inside,), None, "tokens",
            "cost model only (`costmodel.zero3_comm_bound_tokens`, N = 8): a laptop has no H100",
            0.05, why="The book drops the ring's (X-1)/X: at X = 8 GPUs a gather sends 7/8 of the "
                      "block, so the threshold is 7/8 x 2200 = 1925 (the book's own 'What happens "
                      "when X is small?' keeps the factor).",
            question="2 nodes of 8 (X = 2 across): the book's small-X threshold?"),
        Row("book-nodes", "tokens per GPU for compute-bound FSDP across nodes (8 NDR NICs a node)",
            src + ": 990e12 / 400e9", (2475,), (across,), None, "tokens",
            "cost model only, N = 1024 in nodes of 8, one ring per NIC (8 x 50 GB/s a node)",
            0.05, question="With one NIC a node (--nics-per-node 1): predict the threshold"),
    ]


SECTIONS = (seed_notes, zero_memory, zero_traffic, fsdp_rows, offload_rows, zeropp_rows,
            scaling_book_rows)


def build() -> list[Row]:
    """Every row, in the order of SECTIONS."""
    return [row for section in SECTIONS for row in section()]
