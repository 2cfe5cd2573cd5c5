"""The time side: α-β cost of each ring collective, compute from FLOPs, step time per ZeRO stage.

Idea: a ring collective on n ranks takes a latency α per ring step plus its per-rank ring bytes
over the link bandwidth β (nccl-tests, scaling-book):

    all_reduce              2(n-1)·α + 2(n-1)/n · S/β
    reduce_scatter          (n-1)·α  +  (n-1)/n · S/β        S = the full (unsharded) array
    all_gather              (n-1)·α  +  (n-1)/n · S/β
    broadcast (pipelined)   (n-1)·α  +            S/β

The ring's latency grows linearly with n. NCCL also has a (double binary) tree for all_reduce,
2·⌈log2 n⌉·α + 2·S/β (reduce up the tree, broadcast down; each rank sends about 2S: NVIDIA's
"Massively scale ... with NCCL 2.4" blog, NVIDIA/nccl#457), and its tuner takes whichever of its
algorithms it estimates fastest for each call. `collective_time(..., algorithm=)`: "ring" (the
default, what every figure of the course uses unless it says otherwise), "tree" or "auto" (the
cheaper of the two). NCCL's tree exists for all_reduce only (NVIDIA/nccl#1473): reduce_scatter and
all_gather stay ring here under every algorithm. Not modelled: NCCL's PAT (2.23+, logarithmic
reduce_scatter / all_gather, one GPU per node only), NVLS / CollNet (in-switch reductions).

Two tiers (a `hardware.Topology`: nodes of k ranks with c NICs each, an intra link per GPU and
an inter link per NIC): a collective is timed by the tiers its group crosses - a flat ring
through several nodes runs one ring per NIC, as fast as the node's NICs together, and NCCL's
tree is a chain inside each node and a tree across nodes -, and a hierarchical all_reduce pays
each tier for its own part - the formulas are in `collectives.py` (with the one-tier ones above,
re-exported here); `step_time` replays a step on either network.

Compute (`flops.py`, re-exported here): (6Ψ + 12·L·d·s) FLOPs per token, attention included,
over the FLOP/s training really reaches, the device's peak x MFU (default 0.4, what large runs
report; 1.0 is the datasheet peak, which no run reaches). A step is then replayed as
zerolab's strategies issue it (`step_time`): the schedule - every compute, collective and wait,
in order - is recorded from the strategy code itself (`schedule.record`: the class
zerolab.variants.compose builds, run on a skeleton of the units; no second copy of any stage here), and
replayed on one compute stream and one link (or one per tier) that serves collectives in the
order they were issued (NCCL runs a communicator's collectives in order on one stream; `linkemu`
does the same). "Without overlap" waits for every collective as soon as it is issued; "with
overlap" lets a bucket's gradient collective run during the rest of backward and, in ZeRO-3
with prefetch, the next block's all_gather during the current block.

ZeRO-3 becomes communication-bound when a block's all_gather takes longer than its forward
compute: (n-1)/n·2Ψ_u/β  >  2Ψ_u·T/(F·MFU), i.e. below T* = (n-1)/n · F·MFU/β tokens per rank
(bf16 params; the 2 bytes per parameter cancel the 2 FLOPs per parameter), plus
(n-1)·α·F·MFU/(2Ψ_u) for latency (on two tiers (m-1)·α_inter + (n-m)·α_intra in place of
(n-1)·α, `ring_latency`; `zero3_comm_bound_tokens`; attention's FLOPs, when the shape is
given, add compute and lower T*). Backward moves twice the bytes (all_gather + reduce_scatter)
for twice the FLOPs: the same T*.

    python -m zerolab time --params 7.5e9 --world-size 64 --tokens-per-rank 4096 --link ib-ndr --device h100

prints `timetable.format_time_table`: this model's replay of every stage, and its T*.

Not modelled: the optimizer step (memory-bound, small next to compute at these token counts),
activation recomputation, stragglers, congestion, a link below its datasheet bandwidth, and what
an overlapped collective takes from compute: NCCL runs each collective as a kernel on some of the
GPU's SMs (2 for one PCIe NIC up to 16 on an 8-NIC DGX; its blocks never share an SM with a
compute kernel, NVIDIA/nccl#689), so the matmuls it overlaps run slower (30-40 % in
pytorch/pytorch#179937, which moves FSDP's collectives on NVLink to copy-engine ones). The
replay's overlapped step is therefore a floor. The links
and devices, with their sources: `hardware.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import theory
from .flops import (MFU, MFU_SOURCE, check_mfu, compute_time,  # noqa: F401 (costmodel.compute_time)
                    flops_per_token, shape_from_params)
from .collectives import (ALGORITHMS, OPS, Clocks, Leg, check_algorithm,  # noqa: F401 (re-exported)
                          collective_time, flat_leg, flat_link, hierarchical_all_reduce, legs,
                          inter_steps, nic_link, nvlink_share, ring_latency, ring_steps,
                          tier_bytes, tree_steps)
from ..variants.compose import TAKES
from ..variants.hybrid import HYBRIDS
from ..variants.placement import GATHER_MODES
from ..variants.prefetch import check_depth
from . import schedule
from .hardware import TIERS, Device, Link, Topology


# --- a step, replayed ----------------------------------------------------------------------
@dataclass
class Unit:
    """One bucket / block as the strategies see it: numel (Ψ_u elements) and compute seconds.

    The root unit (name "root": embeddings, tied head, final norm) spans the whole pass: its
    compute (head + loss) runs after the blocks in forward and before them in backward, and its
    gradients are ready last."""
    name: str
    numel: float
    fwd_s: float = 0.0
    bwd_s: float = 0.0


MAX_BLOCKS = 10_000      # a transformer has tens to hundreds; the replay costs time per block


def uniform_units(psi: float, n_blocks: int, tokens: float, device: Device, mfu: float = MFU,
                  *, d_model: int = 0, seq_len: float = 0) -> list[Unit]:
    """Ψ split into `n_blocks` equal blocks (no root), each one transformer layer with its forward
    (2Ψ_u + 4·d·s)·tokens and backward twice that, at F · MFU (attention only with d_model and
    seq_len). ValueError unless 1 <= n_blocks <= min(Ψ, MAX_BLOCKS)."""
    if not 1 <= n_blocks <= min(psi, MAX_BLOCKS):
        raise ValueError(f"blocks {n_blocks!r} must be between 1 and {min(int(psi), MAX_BLOCKS):,} "
                         "(at most one per parameter, and the replay is per block)")
    b = psi / n_blocks
    shape = dict(mfu=mfu, n_layer=1, d_model=d_model, seq_len=seq_len)
    return [Unit(f"block.{i}", b, compute_time(b, tokens, device, passes="fwd", **shape),
                 compute_time(b, tokens, device, passes="bwd", **shape))
            for i in range(n_blocks)]


@dataclass
class Collective:
    """One collective in a replayed step: issue, start and end times on the link, in seconds."""
    op: str
    unit: str
    phase: str
    size_bytes: float
    issued: float
    start: float
    end: float
    tier: str = "link"      # the tier(s) it paid: "link" (one tier), "intra", "inter", "intra+inter"
    legs: tuple = ()        # its Legs (a hierarchical all_reduce: three)


@dataclass
class StepTime:
    """The replay of one step: total seconds, compute seconds and every collective."""
    stage: int
    overlap: bool
    total: float = 0.0
    compute: float = 0.0
    collectives: list = field(default_factory=list)
    compute_spans: list = field(default_factory=list)     # (start, end) of each compute, seconds

    @property
    def comm(self) -> float:
        """Seconds the link was busy (sum of collective times)."""
        return sum(c.end - c.start for c in self.collectives)

    @property
    def exposed_comm(self) -> float:
        """Seconds of the step not spent computing: communication the compute did not hide."""
        return self.total - self.compute

    def by_op(self) -> dict[str, float]:
        out = {op: 0.0 for op in OPS}
        for c in self.collectives:
            out[c.op] = out.get(c.op, 0.0) + c.end - c.start
        return out

    def by_op_tier(self) -> dict[str, dict[str, float]]:
        """Seconds of the legs by op and by the tier they paid: {op: {tier: s}} (a hierarchical
        all_reduce's legs under "all_reduce"), ops in OPS order."""
        out: dict[str, dict[str, float]] = {op: {} for op in OPS}
        for c in self.collectives:
            for leg in c.legs:
                out.setdefault(c.op, {})
                out[c.op][leg.tier] = out[c.op].get(leg.tier, 0.0) + leg.seconds
        return {op: per for op, per in out.items() if per}

    def tiers(self) -> list[str]:
        """The tiers the step's collectives paid, in TIERS order (["link"] for one tier)."""
        paid = {leg.tier for c in self.collectives for leg in c.legs}
        return [t for t in ("link", *TIERS) if t in paid]


class _Replay:
    """One compute stream and an in-order link per tier (`Clocks`); `blocking` waits for each
    collective at once."""

    def __init__(self, stage, n, link, overlap, algorithm="ring", hierarchical=False):
        self.n, self.link, self.blocking = n, link, not overlap
        self.algorithm = check_algorithm(algorithm)
        self.hierarchical = hierarchical
        self.t = 0.0
        self.clocks = Clocks()
        self.out = StepTime(stage, overlap)
        self.phase = "forward"

    def compute(self, seconds):
        if seconds > 0:
            self.out.compute_spans.append((self.t, self.t + seconds))
        self.t += seconds
        self.out.compute += seconds

    def issue(self, op, size_bytes, unit, group=None, at=None) -> float:
        # group: the global ranks of a sub-group (zerolab.variants.tiers; None: all n); at: issue time
        parts = (legs(op, size_bytes, self.n, self.link, self.algorithm, self.hierarchical)
                 if group is None else [flat_leg(op, size_bytes, group, self.link, self.algorithm)])
        start, end = self.clocks.place(parts, self.t if at is None else at)
        tier = "+".join(t for t in ("link", *TIERS) if any(p.tier == t for p in parts))
        self.out.collectives.append(Collective(op, unit, self.phase, size_bytes, self.t, start, end,
                                               tier, tuple(parts)))
        if self.blocking:
            self.t = end
        return end

    def wait(self, end):
        self.t = max(self.t, end)


def merge_units(units: list[Unit], bucket_numel: float) -> list[Unit]:
    """Merge consecutive blocks into gradient buckets of at most `bucket_numel` elements (a
    block larger than the cap stays alone; the root is never merged), grouped by
    `theory.bucket_groups` as the strategies' `--bucket-mb` groups them. Names become
    "block.0-2"; compute times add up. A bucket's collective is issued when its last block's
    backward ends, so fewer, larger collectives pay fewer α's but start later."""
    if not bucket_numel > 0:
        raise ValueError(f"bucket_numel {bucket_numel!r} must be > 0")
    out: list[Unit] = []
    run: list[Unit] = []

    def close():
        for idx in theory.bucket_groups([u.numel for u in run], bucket_numel):
            group = [run[i] for i in idx]
            out.append(Unit(theory.bucket_name([u.name for u in group]),
                            sum(u.numel for u in group), sum(u.fwd_s for u in group),
                            sum(u.bwd_s for u in group)))
        run.clear()
    for u in units:
        if u.name == "root":
            close()
            out.append(u)
        else:
            run.append(u)
    close()
    return out


def step_time(stage: int, units: list[Unit], world_size: int, link: Link | Topology, *,
              overlap: bool = True, prefetch: bool | int = False, precision: str = "bf16",
              zero1_grad_op: str = "all_reduce", clip: bool = True, keep_root: bool = False,
              algorithm: str = "ring", hierarchical: bool = False,
              hybrid: str | None = None, bytes_per_param: dict | None = None,
              two_hop_grads: bool = False, zero12_gather: str = "after_step",
              **options) -> StepTime:
    """Replay one optimizer step (one micro-step) of zerolab's `stage` and return its timing.

    The schedule is the strategy code's own (`schedule.record`: the class zerolab.variants.compose builds
    for these options, run on a skeleton of these units, every collective, compute and wait in
    the order the code does them); this function only puts the sizes and seconds in.
    units: forward order; a unit named "root" is treated as `Unit` says. Variant options of the
    stage (zerolab.variants.compose's; a new variant's go through `**options` untouched): prefetch
    (ZeRO-3: False / 0 none - the default here -, True / 1 the next block, k, -1 all remaining),
    keep_root (ZeRO-3), zero1_grad_op (ZeRO-1's grad_op), zero12_gather (ZeRO-1/2's gather:
    "after_step" or "before_forward", in steady state the previous step's gathers run in this
    step's forward), hybrid (ZeRO-3 on a Topology: "hsdp" or "hpz", k = its ranks_per_node);
    each is applied only to the stages that take it (`compose.TAKES`). clip: keep the scalar
    all_reduce of the gradient norm (stages 1-3). overlap=False waits for every collective as
    soon as it is issued (compute + communication). Sizes: bf16 grads and params (4 bytes each
    in "fp32"), or `bytes_per_param` {"params": w, "grads": g} (ZeRO++'s qwZ int8 with
    256-element blocks: 1 + 4/256); two_hop_grads (hybrid "hpz" with qgZ: ZeRO++ whole) replays
    each gradient reduce_scatter as qgZ's two hops, S on the node's ranks, then S/k across once
    it ended (`quant.reduce_scatter_two_hop`). algorithm: how every all_reduce is modelled
    (`collective_time`). link: one Link, or a hardware.Topology of two tiers: a collective on
    all world_size ranks as `flat_leg` says (each all_reduce as `hierarchical_all_reduce`'s three
    legs with `hierarchical`), one on a node's ranks or across nodes on its tier; each tier's
    link serves its legs in issue order (`Clocks`); a collective issued when another completed
    (HSDP's all_reduce after its reduce_scatter) starts no sooner than that. Returns a StepTime.
    """
    depth = check_depth(prefetch)
    n = theory.check_world_size(world_size)
    if zero12_gather not in GATHER_MODES:
        raise ValueError(f"zero12_gather {zero12_gather!r} is not one of "
                         f"{', '.join(map(repr, GATHER_MODES))}")
    k = None
    if hybrid is not None:
        if stage != 3 or hybrid not in HYBRIDS or not isinstance(link, Topology):
            raise ValueError(f"hybrid {hybrid!r} is ZeRO-3's 'hsdp' or 'hpz' on a Topology of "
                             f"two tiers (stage {stage}, {type(link).__name__})")
        k = link.ranks_per_node
        if n % k:
            raise ValueError(f"hybrid needs whole nodes: {k} ranks per node do not divide {n}")
        options.update(hybrid=hybrid, ranks_per_node=k)
    if two_hop_grads and hybrid != "hpz":
        raise ValueError(f"two_hop_grads is qgZ with hybrid 'hpz' (ZeRO++), not hybrid {hybrid!r}")
    given = {"prefetch": depth, "keep_root": keep_root, "grad_op": zero1_grad_op,
             "gather": zero12_gather}
    options.update({key: v for key, v in given.items() if theory.check_stage(stage) in TAKES[key]})
    root = [u for u in units if u.name == "root"]
    blocks = [u for u in units if u.name != "root"]
    named = {"root": root[0] if root else None, **{f"block.{i}": u for i, u in enumerate(blocks)}}
    width = {**theory.bytes_per_param(precision), **(bytes_per_param or {})}
    groups = {"": None, "intra": k and range(k), "inter": k and range(0, n, k)}
    sim = _Replay(stage, n, link, overlap, algorithm, hierarchical)
    ends: dict[int, float] = {}
    for ev in schedule.record(stage, len(blocks), bool(root), **options):
        if ev[0] == "compute":
            sim.compute(named[ev[1]].fwd_s if ev[2] == "fwd" else named[ev[1]].bwd_s)
        elif ev[0] == "wait":
            if ev[1] in ends:
                sim.wait(ends[ev[1]])
        else:
            _, i, op, what, unit, fraction, tier, parent, sim.phase = ev
            if what == "metric" and not clip:
                continue
            plain = hybrid == "hpz" and what == "params" and tier == "intra"   # bf16 secondaries
            size = 4 if what == "metric" else fraction * named[unit].numel * (
                theory.bytes_per_param(precision)["params"] if plain else width[what])
            after = None if sim.blocking else ends.get(parent)    # (serial: one at a time)
            name = named[unit].name if unit in named else unit
            if two_hop_grads and op == "reduce_scatter" and what == "grads" and not tier:
                after = sim.issue(op, size, name, groups["intra"], after)     # hop 1, then 2
                size, tier = size / k, "inter"
            ends[i] = sim.issue(op, size, name, groups[tier], after)
    sim.out.total = sim.t
    return sim.out


def zero3_comm_bound_tokens(block_params: float, world_size: int, link: Link | Topology, device: Device,
                            precision: str = "bf16", mfu: float = MFU, *, d_model: int = 0,
                            seq_len: float = 0) -> float:
    """Tokens per rank T* below which a ZeRO-3 block's all_gather outlasts its forward compute.

    all_gather(Ψ_u) = (n-1)α + (n-1)/n · w·Ψ_u/β  (w = 2 bytes in bf16) equals
    (2Ψ_u + 4·d·s)·T / (F·MFU) at
    T* = all_gather · F·MFU / (2Ψ_u + 4·d·s)  =  (n-1)/n · F·MFU/β  (bf16, α = 0, no attention)
    + latency. The attention term (the block is one layer of width d_model, sequences of seq_len
    tokens) adds compute and lowers T*. Returns T* in tokens (0 for n = 1). Source: the module
    docstring; scaling-book's "when is FSDP communication-bound" uses the same ratio of FLOP/s to
    bandwidth. The all_gather is a ring under every algorithm (NCCL has no tree all_gather). On a
    Topology it is the flat ring over all world_size ranks (`flat_leg`): one ring per NIC, so β
    is the node's NICs together (8 x 50 GB/s on 8-GPU 8-NIC NDR nodes), not one NIC's.
    """
    check_mfu(mfu)
    w = theory.bytes_per_param(precision)["params"]
    t_gather = sum(leg.seconds for leg in legs("all_gather", w * block_params, world_size, link))
    per_token = flops_per_token(block_params, n_layer=1, d_model=d_model, seq_len=seq_len,
                                passes="fwd")
    return t_gather * device.flops * mfu / per_token


def latency_note(world_size: int, link: Link | Topology, algorithm: str = "ring") -> str:
    """One line: which algorithm the collectives are modelled with, and at this N what a ring
    all_reduce's latency costs against NCCL's tree (`collective_time`; on a Topology, NCCL's
    tuning model, `ring_latency`: α_inter only on the steps that cross nodes, and NCCL's
    hierarchical tree: a chain through a node's k ranks, a tree across the m nodes, `flat_leg`)."""
    n = theory.check_world_size(world_size)
    check_algorithm(algorithm)
    if n <= 2:
        return "collectives: ring (at N <= 2 a tree all_reduce has as many steps)"
    ms = (lambda seconds: f"{seconds * 1e3:.3g} ms")
    flat = flat_link(link, n)
    ring, rs = ms(ring_latency("all_reduce", n, link)), ms(ring_latency("all_gather", n, link))
    ar_name, rs_name = "2(n-1)·α", "(n-1)·α"
    if isinstance(link, Topology) and n > link.ranks_per_node:
        k, m = link.ranks_per_node, -(-n // link.ranks_per_node)
        tree = ms(tree_steps(m) * link.inter.latency + 2 * (k - 1) * link.intra.latency)
        tree_name = f"NCCL's tree 2·⌈log2 m⌉·α_inter + 2(k-1)·α_intra = {tree} (m = {m} nodes)"
        ar_name, rs_name = "2(m-1)·α_inter + 2(n-m)·α_intra", "(m-1)·α_inter + (n-m)·α_intra"
    else:
        tree = ms(tree_steps(n) * flat.latency)
        tree_name = f"NCCL's tree 2·⌈log2 n⌉·α = {tree}"
    if algorithm == "ring":
        return (f"collectives: ring. At N = {n} a ring all_reduce pays {ar_name} = {ring} of latency, "
                f"{tree_name} (--algo auto takes the cheaper per all_reduce); "
                f"reduce_scatter / all_gather are rings in NCCL too, {rs_name} = {rs} each")
    how = "the cheaper of ring and tree" if algorithm == "auto" else "tree"
    return (f"collectives: all_reduce by {how} ({tree_name}, ring's {ar_name} = {ring}); "
            f"reduce_scatter / all_gather by ring, {rs_name} = {rs} each (NCCL has no tree for them)")


# --- compute measured on this machine, to feed the replay ----------------------------------------
def measure_units(model, x, y, world_size: int = 1, repeats: int = 3) -> list[Unit]:
    """Time each unit's forward and backward on this process (one thread, as torchrun's ranks
    run) and return `Unit`s named and sized as zerolab's strategies build them (padded numel).

    model: a GPT-like module with `zero_units()`; x, y: one rank's micro-batch [B, T]. The root
    unit gets what the blocks leave over (embeddings, final norm, head, loss). Seconds are the
    median of `repeats` forward + backward passes after one warm-up. Measured, so as noisy as the
    machine: on a shared machine repeat and look at the spread.
    """
    import statistics
    import time

    import torch

    from ..sharding import build_units
    units = build_units(model, world_size, 0)
    blocks = {name: module for name, module in model.zero_units()}
    samples = {u.name: ([], []) for u in units}
    clock, handles, threads = {}, [], torch.get_num_threads()

    def start(key):
        clock[key] = time.perf_counter()

    def stop(key, into):
        into.append(time.perf_counter() - clock[key])

    for name, module in blocks.items():
        fwd, bwd = samples[name]
        handles += [module.register_forward_pre_hook(lambda *_, n=name: start(("f", n))),
                    module.register_forward_hook(lambda *_, n=name, s=fwd: stop(("f", n), s)),
                    module.register_full_backward_pre_hook(lambda *_, n=name: start(("b", n))),
                    module.register_full_backward_hook(lambda *_, n=name, s=bwd: stop(("b", n), s))]
    totals = ([], [])
    torch.set_num_threads(1)
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            loss = model(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i == 0:                                  # warm-up
                for f, b in samples.values():
                    f.clear()
                    b.clear()
                continue
            totals[0].append(t1 - t0)
            totals[1].append(t2 - t1)
    finally:
        torch.set_num_threads(threads)
        for h in handles:
            h.remove()
    med = statistics.median
    out = []
    for u in units:
        if u.name in blocks:
            out.append(Unit(u.name, u.padded_numel, med(samples[u.name][0]), med(samples[u.name][1])))
    rest = [[max(0.0, totals[k][i] - sum(samples[b][k][i] for b in blocks))     # per pass
             for i in range(repeats)] for k in (0, 1)]
    root = [Unit(u.name, u.padded_numel, med(rest[0]), med(rest[1]))
            for u in units if u.name not in blocks]
    return root + out
