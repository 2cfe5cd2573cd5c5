"""Exercises (f)-(h): the layout and the knobs, predicted by the learner, graded against zerolab.

Where exercises (a)-(e) put one of the learner's functions inside a strategy, these ask for a
prediction, and grade it against zerolab's own answer and against a measured run:

(f) groups: `tp_dp_groups(world_size, tp_size)` and `hsdp_groups(world_size, ranks_per_node)`,
    the process groups of notebook 09's (dp, tp) mesh and notebook 08's (replicate, shard) HSDP
    mesh. Graded for world sizes 1-16: properties first (every rank in exactly one group of each
    kind, group sizes, TP and shard groups inside one node, each DP / replicate group takes the
    same slot of every TP / shard group), then equality with `theory.mesh_groups` (the layout
    torch's `init_device_mesh` builds; tests/test_exercises_more.py checks that on torch's fake
    process group), and the ValueError for a size that does not divide the world. No ranks.
(g) buckets_prefetch: `ddp_buckets(block_numels, bucket_cap_mb, grad_bytes)`, the blocks that
    share one gradient all_reduce, graded on many (sizes, cap) cases against
    `theory.bucket_groups` and then against the buckets zerolab's DDP(bucket_mb=...) formed and the
    all_reduces its ledger shows; `zero3_gathered_peak(root, block, n_blocks, prefetch, bytes)`,
    graded against the gathered-weights peak the memory meter measured in ZeRO-3 runs with
    prefetch depth 0, 1, 2, 8 and -1 (GPT nano with 6 blocks, fp32, gloo ranks).
(h) timing: `ring_time(op, size_bytes, n, link)`, the α-β ring model, graded against
    `costmodel.collective_time` on a sweep of ops, sizes, n and links, then against the time
    collectives took on gloo ranks over the emulated link (`timing.linkemu`), within
    MEASURE_REL of the prediction + MEASURE_ABS_S.

`checker.run_check`'s judge (a fork) loads the learner's functions and calls `grade`; the
reference solutions are the functions below of the same names ((h): `costmodel.collective_time`).
The measured runs do not depend on the learner's code: the checking process takes each once
(`measure`; a second check in the same kernel answers in a second).
"""
from __future__ import annotations

import random
import statistics

from ... import theory
from ...timing import costmodel, hardware
from ..testing import RanksFailed

MEASURE_REL, MEASURE_ABS_S = 0.25, 0.010       # (h): |measured - yours| <= 25 % of yours + 10 ms
KNOB_LAYERS = 6                                # (g): GPT nano with 6 blocks
CAPS_MB = (None, 0.1, 0.2, 1.0)                # (g): 1, 2, 4 + 2, 6 blocks a bucket (fp32)
DEPTHS = (0, 1, 2, 8, -1)                      # (g): ZeRO-3 prefetch depths measured
LINK = hardware.get_link(gbps=0.1, latency_us=2000)   # (h): 12.5 MB/s, α = 2 ms per ring step
LINK_NUMEL = 150_000                           # (h): 600 KB of fp32, divisible by 2, 3, 4
_MEASURED: dict = {}                            # (worker, nproc): rank 0's measured run


# --- the reference solutions ------------------------------------------------------------------
def tp_dp_groups(world_size: int, tp_size: int):
    """(TP groups, DP groups) of the (dp, tp) mesh: notebook 09's layout."""
    return theory.mesh_groups(world_size, tp_size)


def hsdp_groups(world_size: int, ranks_per_node: int):
    """(shard groups, replicate groups) of HSDP's (replicate, shard) mesh, one shard group a node."""
    return theory.mesh_groups(world_size, ranks_per_node)


def ddp_buckets(block_numels, bucket_cap_mb, grad_bytes: int):
    """The buckets DDP(bucket_mb=bucket_cap_mb) forms (sharding.bucket_numel, then
    theory.bucket_groups): consecutive blocks while their gradients fit in the cap (MiB)."""
    cap = None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * theory.MIB // grad_bytes))
    return theory.bucket_groups(list(block_numels), cap)


def zero3_gathered_peak(root_numel: int, block_numel: int, n_blocks: int, prefetch: int,
                        param_bytes: int) -> int:
    """ZeRO-3's peak of gathered weights: the root (held for the whole pass) plus the block that
    runs and the `prefetch` blocks gathered ahead of it (all of them for -1)."""
    held = n_blocks if prefetch < 0 else min(1 + prefetch, n_blocks)
    return (root_numel + held * block_numel) * param_bytes


def ring_time(op: str, size_bytes: float, n: int, link) -> float:
    """Seconds of a ring `op` of S = size_bytes on n ranks over `link`: costmodel's α-β model."""
    return costmodel.collective_time(op, size_bytes, n, link)


# --- dispatch from checker.run_check ------------------------------------------------------------
def grade(name: str, functions: dict, impl: str, nproc: int, timeout: float):
    """(ok, lines) for exercise `name`, the learner's `functions` loaded from `impl`."""
    return {"groups": _grade_groups, "buckets_prefetch": _grade_knobs,
            "timing": _grade_timing}[name](functions, nproc, timeout)


def _call(fn, *args):
    """(value, None) or (None, 'raised ...') for the learner's fn(*args)."""
    try:
        return fn(*args), None
    except Exception as err:  # noqa: BLE001 - shown to the learner
        return None, f"raised {type(err).__name__}: {err}"


class Unmeasured(Exception):
    """In the judge: worker args[0]'s run is not taken yet (the checker does it, `measure`)."""


def _measured(worker, nproc: int, timeout: float):
    """Rank 0's result of `worker` on nproc gloo ranks, measured once per process."""
    from . import sandbox
    if (worker.__name__, nproc) not in _MEASURED:
        if sandbox.MARK is not None:        # a child starts no ranks: the checker measures
            raise Unmeasured(worker.__name__)
        _MEASURED[worker.__name__, nproc] = sandbox.run_ranks(worker, nproc,
                                                              timeout=timeout)[0]["result"]
    return _MEASURED[worker.__name__, nproc]


def measure(worker: str, nproc: int, timeout: float) -> str:
    """Take `worker`'s run in the checking process: "" or one line on why it failed."""
    try:
        _measured({w.__name__: w for w in (_measure_knobs, _measure_link)}[worker], nproc, timeout)
        return ""
    except RanksFailed as err:
        return f"the measurement failed (not your code): {err.why}"


def _sig(name: str, *args) -> str:
    return f"{name}({', '.join(map(repr, args))})"


# --- (f) groups -------------------------------------------------------------------------------
def _as_groups(value):
    """value as a pair of lists of int lists, or None."""
    try:
        pair = [[[int(r) for r in g] for g in part] for part in value]
        return pair if len(pair) == 2 else None
    except (TypeError, ValueError):
        return None


def _group_problem(world, size, groups, kind, other_kind, node_word, node_size, others):
    """The first property `groups` of `kind` breaks, as one line, or None. others: the groups
    of the other kind (already checked)."""
    seen = {}
    for g in groups:
        for r in g:
            if not 0 <= r < world:
                return f"{kind} group {g} names rank {r}, outside 0..{world - 1}"
            if r in seen:
                return f"{kind} group {g} names rank {r} twice" if seen[r] is g else \
                    f"rank {r} is in two {kind} groups ({seen[r]} and {g}): each rank is in " \
                    f"exactly one group of each kind"
            seen[r] = g
    missing = [r for r in range(world) if r not in seen]
    if missing:
        return f"rank {missing[0]} is in no {kind} group: every rank is in exactly one"
    for g in groups:
        if len(g) != size:
            return f"{kind} group {g} has {len(g)} ranks; a {kind} group has {size}"
    if others is None:                      # the inner kind: one node's consecutive ranks
        for g in groups:
            if len({r // node_size for r in g}) > 1:
                return (f"{kind} group {g} spans {len({r // node_size for r in g})} nodes of "
                        f"{node_size} ranks (nodes: ranks 0-{node_size - 1}, {node_size}-"
                        f"{2 * node_size - 1}, ...): {node_word} would cross the slow network; "
                        f"a {kind} group is {node_size} consecutive ranks, one node")
        return None
    for g in groups:                        # the outer kind: one rank of every inner group
        for o in others:
            common = sorted(set(g) & set(o))
            if len(common) != 1:
                return (f"{kind} group {g} and {other_kind} group {o} share {len(common)} ranks "
                        f"{common}: a {kind} group takes exactly one rank of every "
                        f"{other_kind} group")
        slots = {sorted(o).index(r) for r in g for o in others if r in o}
        if len(slots) > 1:
            return (f"{kind} group {g} mixes slots {sorted(slots)} of the {other_kind} groups: "
                    f"its ranks must hold the same part (slot k of their {other_kind} group), "
                    f"or they would average different things")
    return None


def _check_groups(fname, fn, world, size, kinds, node_word):
    inner, outer = kinds
    got, err = _call(fn, world, size)
    call = _sig(fname, world, size)
    if err:
        return f"{call} {err}"
    pair = _as_groups(got)
    if pair is None:
        return f"{call} returned {got!r}: expected a pair ({inner} groups, {outer} groups), " \
               f"each a list of lists of ranks"
    want = theory.mesh_groups(world, size)
    for groups, kind, other_kind, others, n in ((pair[0], inner, outer, None, size),
                                                 (pair[1], outer, inner, pair[0], world // size)):
        problem = _group_problem(world, n, groups, kind, other_kind, node_word, size, others)
        if problem:
            return f"{call}: {problem}"
    norm = [sorted(sorted(g) for g in part) for part in pair]
    if norm != [sorted(part) for part in want]:
        return f"{call} returned {pair}; expected {want} (theory.mesh_groups)"
    return None


def _grade_groups(fns, nproc, timeout):
    cases = [(w, s) for w in (1, 2, 4, 6, 8, 12, 16) for s in range(1, w + 1) if w % s == 0]
    specs = (("tp_dp_groups", ("TP", "DP"), "TP's all_reduces in every layer"),
             ("hsdp_groups", ("shard", "replicate"),
              "the all_gathers and reduce_scatters of every block"))
    for fname, kinds, word in specs:
        fn = fns[fname]
        for world, size in [(8, 2), (8, 4), *cases]:
            problem = _check_groups(fname, fn, world, size, kinds, word)
            if problem:
                return False, [problem]
        for world, size in ((8, 3), (6, 4)):
            got, err = _call(fn, world, size)
            if not (err or "").startswith("raised ValueError"):
                return False, [f"{_sig(fname, world, size)} {err or f'returned {got!r}'}; expected "
                               f"ValueError: {world} ranks do not split into {kinds[0]} groups "
                               f"of {size}"]
    return True, [f"tp_dp_groups and hsdp_groups equal zerolab's mesh layout (theory.mesh_groups, "
                  f"torch's init_device_mesh) for {len(cases)} (world size, group size) "
                  f"pairs up to 16 ranks, and refuse sizes that do not divide the world",
                  "every rank is in one group of each kind; TP and shard groups stay on one "
                  "node; each DP / replicate group takes the same slot of every TP / shard group"]


# --- (g) buckets and prefetch ---------------------------------------------------------------
BUCKET_MISTAKES = (    # (why, a wrong ddp_buckets): named when the learner's answer equals it
    ("bucket_cap_mb counts MiB of 2**20 bytes (torch DDP's unit), not 10**6",
     lambda n, c, b: theory.bucket_groups(n, None if c is None else max(1, int(c * 1e6 // b)))),
    ("the cap is bytes of gradients: divide by grad_bytes to get elements",
     lambda n, c, b: theory.bucket_groups(n, None if c is None else max(1, int(c * theory.MIB)))),
    ("a bucket may fill the cap exactly: take the next block while the total stays <= the cap",
     lambda n, c, b: theory.bucket_groups(n, None if c is None else
                                          max(1, int(c * theory.MIB // b)) - 0.5)),
    ("bucket_cap_mb=None means one bucket per block (zerolab's default)",
     lambda n, c, b: [list(range(len(n)))] if c is None else ddp_buckets(n, c, b)),
    ("list the buckets in forward order, as zerolab's DDP forms them (block 0's bucket first; "
     "backward reduces them in reverse)",
     lambda n, c, b: ddp_buckets(n, c, b)[::-1]),
)


def _bucket_cases():
    rng = random.Random(0)
    for _ in range(60):
        numels = [rng.choice((rng.randint(1, 3000), rng.randint(1, 300_000)))
                  for _ in range(rng.randint(1, 8))]
        for cap in (None, 0.001, 0.01, 0.1, 0.25, 1.0):
            for grad_bytes in (2, 4):
                yield numels, cap, grad_bytes
    yield [262_144, 262_144, 1], 1.0, 4            # exactly 1 MiB of fp32: a bucket of its own
    yield [131_072, 131_072, 1], 1.0, 4            # two blocks fill 1 MiB exactly


def _bucket_problem(fn, numels, cap, grad_bytes, want=None, measured=""):
    got, err = _call(fn, numels, cap, grad_bytes)
    call = f"ddp_buckets({numels}, {cap!r}, {grad_bytes})"
    if err:
        return f"{call} {err}"
    try:
        got = [[int(i) for i in b] for b in got]
    except (TypeError, ValueError):
        return f"{call} returned {got!r}: expected a list of lists of block indices"
    want = ddp_buckets(numels, cap, grad_bytes) if want is None else want
    if got == want:
        return None
    why = next((w for w, wrong in BUCKET_MISTAKES if wrong(numels, cap, grad_bytes) == got), "")
    return f"{call} returned {got}; expected {want}{measured}" + (f": {why}" if why else "")


def _measure_knobs(rank, n):
    """On each rank: DDP's units and gradient all_reduces for each cap; ZeRO-3's gathered peak
    for each prefetch depth (GPT nano, 6 blocks, fp32, one forward and backward)."""
    import torch

    from ...comm import Comm
    from ...ddp import DDP
    from ...memory import MemoryMeter
    from ...model import GPT, get_config
    from ...variants.compose import make_strategy
    from ..testing import global_batch

    def model():
        torch.manual_seed(0)
        return GPT(get_config("nano", n_layer=KNOB_LAYERS))
    out = {"ddp": {}, "zero3": {}}
    for cap in CAPS_MB:
        m, comm = model(), Comm()
        s = DDP(m, comm, bucket_mb=cap)
        x, y = global_batch(m, 0, 2 * n)
        s.backward(s.forward(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        out["ddp"][cap] = {"units": [u.name for u in s.units],
                           "blocks": [sum(p.numel() for p in b.parameters()) for b in m.blocks],
                           "all_reduces": [r.numel for r in comm.records if r.what == "grads"
                                           and r.op == "all_reduce" and r.phase == "backward"]}
        s.close()
    for depth in DEPTHS:
        m, meter = model(), MemoryMeter()
        s = make_strategy(3, m, Comm(), prefetch=depth, meter=meter)
        x, y = global_batch(m, 0, 2 * n)
        s.backward(s.forward(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        units = {u.name: u.padded_numel for u in s.units}
        out["zero3"][depth] = {"peak": meter.peak["gathered_params"], "root": units["root"],
                               "block": units["block.0"], "blocks": len(units) - 1}
        s.close()
    return out


def _block_indices(name: str) -> list[int]:
    first, _, last = name.removeprefix("block.").partition("-")
    return list(range(int(first), int(last or first) + 1))


PEAK_MISTAKES = (
    ("the root unit (embeddings, final LayerNorm) stays gathered for the whole pass: add it",
     lambda r, b, k, p, e: zero3_gathered_peak(0, b, k, p, e)),
    ("depth p gathers p blocks AHEAD of the one that runs: 1 + p blocks",
     lambda r, b, k, p, e: zero3_gathered_peak(r, b, k, p - 1 if p > 0 else p, e)),
    ("prefetch=-1 gathers every remaining block at once: all n_blocks",
     lambda r, b, k, p, e: (r + b) * e if p < 0 else zero3_gathered_peak(r, b, k, p, e)),
    ("there are only n_blocks blocks to gather: the depth is capped",
     lambda r, b, k, p, e: (r + (1 + p) * b) * e if p >= 0 else zero3_gathered_peak(r, b, k, p, e)),
    ("count bytes: elements times param_bytes",
     lambda r, b, k, p, e: zero3_gathered_peak(r, b, k, p, 1)),
)


def _grade_knobs(fns, nproc, timeout):
    buckets, peak = fns["ddp_buckets"], fns["zero3_gathered_peak"]
    for case in _bucket_cases():
        problem = _bucket_problem(buckets, *case)
        if problem:
            return False, [problem]
    try:
        measured = _measured(_measure_knobs, nproc, timeout)
    except RanksFailed as err:
        return False, [f"the measurement failed (not your code): {err.why}"]
    lines = []
    for cap, m in measured["ddp"].items():
        formed = [_block_indices(name) for name in m["units"] if name != "root"]
        note = (f" (DDP(bucket_mb={cap!r}) on GPT nano with {KNOB_LAYERS} blocks formed these; "
                f"its ledger: {len(m['all_reduces'])} gradient all_reduces in backward, one per "
                f"bucket and one for the root)")
        problem = _bucket_problem(buckets, m["blocks"], cap, 4, formed, note)
        if problem:
            return False, [problem]
        lines.append(f"bucket_mb={cap!r}: {len(formed)} bucket(s) {formed}, measured "
                     f"{len(m['all_reduces'])} all_reduces (with the root's)")
    for depth, m in measured["zero3"].items():
        args = (m["root"], m["block"], m["blocks"], depth, 4)
        got, err = _call(peak, *args)
        call = _sig("zero3_gathered_peak", *args)
        if err:
            return False, [f"{call} {err}"]
        if got != m["peak"]:
            why = next((w for w, wrong in PEAK_MISTAKES if wrong(*args) == got), "")
            return False, [f"{call} returned {got!r}; ZeRO-3(prefetch={depth}) measured a "
                           f"gathered-weights peak of {m['peak']:,} bytes (the memory meter, GPT "
                           f"nano, {KNOB_LAYERS} blocks, fp32, {nproc} ranks)" +
                           (f": {why}" if why else "")]
        lines.append(f"prefetch={depth}: peak {m['peak']:,} bytes gathered, as you predicted")
    return True, ["ddp_buckets equals theory.bucket_groups on "
                  f"{sum(1 for _ in _bucket_cases())} (sizes, cap, dtype) cases and the buckets "
                  f"real DDP runs formed; zero3_gathered_peak equals the measured peaks", *lines]


# --- (h) timing ---------------------------------------------------------------------------------
TIME_MISTAKES = (   # (why, wrong ring_time)
    ("all_reduce is a reduce_scatter then an all_gather: 2(n-1) steps and 2(n-1)/n of S",
     lambda op, s, n, l: costmodel.collective_time("all_gather" if op == "all_reduce" else op,
                                                   s, n, l)),
    ("a ring rank sends (n-1)/n of S per pass, not S (nor S/n)",
     lambda op, s, n, l: costmodel.collective_time(op, s, n, l) if n == 1 else
     costmodel.ring_steps(op, n) * l.latency + (2 if op == "all_reduce" else 1) * s / l.bandwidth),
    ("add the latency: α per ring step, 2(n-1) steps for all_reduce, n-1 for the others",
     lambda op, s, n, l: 0.0 if n == 1 else theory.RING_FACTOR[op](n) * s / l.bandwidth),
    ("on one rank nothing moves: 0 seconds (also for broadcast)",
     lambda op, s, n, l: costmodel.ring_steps(op, n) * l.latency
     + theory.RING_FACTOR[op](n) * s / l.bandwidth),
    ("link.bandwidth is bytes per second (not bits): no factor 8",
     lambda op, s, n, l: costmodel.collective_time(op, 8 * s, n, l) if n > 1 else 0.0),
)


def _time_cases():
    links = [hardware.get_link("nvlink4"), hardware.get_link("ib-ndr"), LINK]
    for op in costmodel.OPS:
        for n in (1, 2, 3, 4, 8, 64):
            for size in (0, 1e3, 1e6, 4e9):
                for link in links:
                    yield op, size, n, link


def _close(a, b) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-12)


def _measure_link(rank, n, reps=3):
    """Median seconds of each op on LINK_NUMEL fp32 over the emulated LINK (blocking calls)."""
    import torch

    from ...comm import Comm
    from ...timing.linkemu import LinkEmulator
    comm = Comm()
    comm.all_reduce(torch.ones(1), what="metric")           # gloo connects on the first call
    comm.link = LinkEmulator(LINK, n)
    full, chunk, out = torch.ones(LINK_NUMEL), torch.ones(LINK_NUMEL // n), {}
    for op in costmodel.OPS:
        times = []
        for _ in range(reps):
            h = (comm.all_reduce(full, what="grads") if op == "all_reduce" else
                 comm.reduce_scatter(chunk, full, what="grads") if op == "reduce_scatter" else
                 comm.all_gather(full, chunk, what="params") if op == "all_gather" else
                 comm.broadcast(full, 0, what="params"))
            times.append(h.record.time_s)
        out[op] = statistics.median(times)
    return out


def _grade_timing(fns, nproc, timeout):
    fn = fns["ring_time"]
    for op, size, n, link in _time_cases():
        got, err = _call(fn, op, size, n, link)
        call = f"ring_time({op!r}, {size:g}, {n}, {link.name})"
        if err:
            return False, [f"{call} {err}"]
        want = costmodel.collective_time(op, size, n, link)
        try:
            ok = _close(float(got), want)
        except (TypeError, ValueError):
            return False, [f"{call} returned {got!r}: expected seconds (a float)"]
        if not ok:
            why = next((w for w, wrong in TIME_MISTAKES if _close(float(got),
                                                                  wrong(op, size, n, link))), "")
            return False, [f"{call} = {float(got):.6g} s; the α-β ring model gives {want:.6g} s "
                           f"(α = {link.latency:g} s per ring step, β = {link.bandwidth:g} "
                           f"bytes/s)" + (f": {why}" if why else "")]
    try:
        measured = _measured(_measure_link, nproc, timeout)
    except RanksFailed as err:
        return False, [f"the measurement failed (not your code): {err.why}"]
    lines, bad = [], []
    for op, t in measured.items():
        mine = float(fn(op, 4 * LINK_NUMEL, nproc, LINK))
        off = abs(t - mine) <= MEASURE_REL * mine + MEASURE_ABS_S
        lines.append(f"{op:<15} {4 * LINK_NUMEL:,} bytes on {nproc} ranks: you predict "
                     f"{mine * 1e3:6.1f} ms, the emulated link took {t * 1e3:6.1f} ms")
        if not off:
            bad.append(lines[-1])
    if bad:
        return False, [f"measured (gloo ranks, emulated link {LINK.gbps:g} Gb/s, "
                       f"α = {LINK.latency * 1e3:g} ms) and predicted differ by more than "
                       f"{MEASURE_REL:.0%} + {MEASURE_ABS_S * 1e3:g} ms:", *bad]
    return True, [f"ring_time equals costmodel.collective_time on {sum(1 for _ in _time_cases())} "
                  f"(op, size, n, link) cases, and the measured times on the emulated link "
                  f"({LINK.gbps:g} Gb/s, α = {LINK.latency * 1e3:g} ms) are within "
                  f"{MEASURE_REL:.0%} + {MEASURE_ABS_S * 1e3:g} ms of your predictions:", *lines]
