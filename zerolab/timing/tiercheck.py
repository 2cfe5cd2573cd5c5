"""The two-tier link emulator measured against the two-tier cost model, on 4 gloo ranks as 2 x 2.

Idea: three all_reduces that the two-tier model tells apart, each timed on gloo ranks over the
emulated links (`linkemu.TieredLinkEmulator`) and put next to `costmodel`'s time for its bytes:

    flat          over all 4 ranks: one ring per NIC (a NIC per rank), crossing nodes
                  2(m-1)·α_e + 2(n-m)·α_i + 2(n-1)/n·S·max(1/(k·β_e), (k-1)/(k·β_i))
                  (the latency as NCCL's tuning model counts it: α_e on the steps that
                  cross nodes only)
    hierarchical  reduce_scatter intra + all_reduce of S/k inter + all_gather intra
                  (`tiers.hierarchical_all_reduce`)
                  2(k-1)·(α_i + S/(k·β_i)) + 2(m-1)·(α_e + S/(k·m·β_e))
    intra         the 2 ranks of one node (both nodes at once): intra only   2(k-1)·(α_i + S/(k·β_i))

n = 4 ranks, k = 2 per node (2 NICs), m = 2 nodes; S the array in bytes, α in seconds, β in
bytes/s per GPU (intra) or per NIC (inter). The links are slow enough (intra 1 Gb/s, α 20 us; inter 0.1 Gb/s, α 200 us: NVLink : IB's
ratio of about 10) and the arrays sized so that every collective's model time is 20-150 ms, far
above gloo's own few ms on a loaded 2-core machine, so the emulated time dominates. Each repeat
starts after a barrier; its time is the slowest rank's (perf_counter around the blocking call);
`compare` reports the median over repeats and its spread against the model.

    from zerolab.course.testing import run_ranks
    from zerolab.timing import tiercheck
    print(tiercheck.format_rows(tiercheck.compare(run_ranks(tiercheck.measure, 4))))

Measured margins: measured / model of the median of 7 repeats (slowest rank), over 3-4 sizes x 6
runs per case, on the 2-core machine shared with other jobs; in brackets the lowest and highest
per-size ratio, then the median excess over the model in ms [range]. The quiet column was measured
with a NIC per rank (flat sizes 0.4-1.6 MB: model times 25-97 ms); the busier one before NICs per
node were modelled (one NIC per node, flat sizes 0.2-0.8 MB, the same model times):

    case           quiet (load 1.0-1.1)                 busier (+ a pytest run; load 3-6)
    flat           1.05 [1.01-1.14], +2.1 ms [0.9-6.0]  1.06 [1.02-1.24], +2.9 ms [1.6-7.0]
    hierarchical   1.07 [1.02-1.45], +4.5 ms [2.6-8.7]  1.28 [1.05-2.18], ~+17 ms [7.1-27]
    intra          1.02 [1.01-1.08], +1.4 ms [0.6-3.5]  1.06 [1.01-1.13], +2.2 ms [0.7-5.7]

The emulated time is a floor (a collective ends at max(gloo's time, the model's)), so ratios sit
at or above 1; the excess is additive - gloo's own work and the wake-up of 4 processes on 2
cores, a few ms per collective - and the hierarchical all_reduce pays it three times (three
collectives, whose intra legs of 1.6-13 ms are short next to gloo's own work): its smallest
size (model 19.6 ms) is where the ratio strays most (1.23-2.18), its largest (154 ms) stays
within 1.02-1.14. The emulator sleeps for the model's own time, so these ratios check the
emulation (and, in a training run, zerolab's schedule and overlap), not the α-β or two-tier
model: tests/test_nics.py holds that to published NCCL measurements.
Single repeats spread further (a max up to 2x the median on the busier runs: a descheduled
rank). tests/test_tiers.py asserts model x 0.95 <= median <= `upper_bound` (1.3 x the model +
12 ms per collective) for every row, and that the measured order is the model's wherever the
model sets two rows 30 % or more apart and further apart than the faster row's 12 ms per collective
(a busy CI run measured hierarchical 400 KB, model 19.6 ms, at 30.6 ms: above intra 3.2 MB's 28.2,
model 25.6).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..comm import Comm
from ..variants.tiers import hierarchical_all_reduce, node_comms
from . import costmodel, hardware, linkemu

INTRA, INTER = "1@20", "0.1@200"        # Gb/s per GPU / per NIC @ α in us: hardware.parse_link
#: bytes of the all_reduced fp32 array per case: model times 20-150 ms on INTRA / INTER
SIZES = {"flat": (400_000, 800_000, 1_600_000),
         "hierarchical": (400_000, 800_000, 1_600_000, 3_200_000),
         "intra": (3_200_000, 6_400_000, 12_800_000)}
CASES = tuple(SIZES)
COLLECTIVES = {"flat": 1, "hierarchical": 3, "intra": 1}    # gloo collectives per case


def upper_bound(model_s: float, collectives: int = 1) -> float:
    """The most a measured median may take, in seconds, for a model time `model_s`: 1.3 x the
    model plus 12 ms per gloo collective it is made of (the module docstring's margins, with
    room for a machine busier than when they were measured)."""
    return 1.3 * model_s + 0.012 * collectives


def model_time(case: str, size_bytes: float, topology: hardware.Topology, world_size: int = 4) -> float:
    """The cost model's seconds for `case` (one of CASES) of an S = size_bytes all_reduce."""
    k = topology.ranks_per_node
    if case == "flat":
        return costmodel.flat_leg("all_reduce", size_bytes, range(world_size), topology).seconds
    if case == "hierarchical":
        return sum(leg.seconds for leg in
                   costmodel.hierarchical_all_reduce(size_bytes, range(world_size), topology))
    if case == "intra":
        return costmodel.flat_leg("all_reduce", size_bytes, range(k), topology).seconds
    raise ValueError(f"case {case!r} is not one of {', '.join(CASES)}")


def measure(rank: int, world_size: int, ranks_per_node: int = 2, intra: str = INTRA,
            inter: str = INTER, sizes: dict | None = None, reps: int = 7) -> dict:
    """On one rank of an initialised gloo world: time each case of `sizes` ({case: bytes, ...},
    default SIZES) `reps` times over the emulated two-tier links. Returns {(case, bytes): [s, ...]}
    (seconds per repeat, this rank) and "topology": (ranks_per_node, intra, inter)."""
    topology = hardware.get_topology(ranks_per_node, intra, inter, world_size)
    world = Comm()
    near, far = node_comms(ranks_per_node, world)
    for c in (world, near, far):                    # gloo connects on a group's first call
        c.all_reduce(torch.ones(4), what="metric")
    world.link = near.link = far.link = linkemu.TieredLinkEmulator(topology, world_size)
    out: dict = {"topology": (ranks_per_node, intra, inter)}
    for case, case_sizes in (sizes or SIZES).items():
        for size in case_sizes:
            x = torch.ones(size // 4)               # fp32
            times = []
            for _ in range(reps):
                dist.barrier()                      # not emulated: lines the ranks up
                t0 = time.perf_counter()
                if case == "flat":
                    world.all_reduce(x, what="grads")
                elif case == "hierarchical":
                    hierarchical_all_reduce(x, near, far, what="grads")
                else:
                    near.all_reduce(x, what="grads")
                times.append(time.perf_counter() - t0)
            out[case, size] = times
    return out


def compare(results: list[dict], world_size: int | None = None) -> list[dict]:
    """Rows {case, size_bytes, model_s, median_s, min_s, max_s, ratio} from every rank's
    `measure` result (a list by rank): a repeat's time is its slowest rank's; median, min and
    max over repeats; ratio = median / model."""
    n = world_size or len(results)
    k, intra, inter = results[0]["topology"]
    topology = hardware.get_topology(k, intra, inter, n)
    rows = []
    for key in results[0]:
        if key == "topology":
            continue
        case, size = key
        slowest = [max(r[key][i] for r in results) for i in range(len(results[0][key]))]
        model = model_time(case, size, topology, n)
        med = statistics.median(slowest)
        rows.append({"case": case, "size_bytes": size, "model_s": model, "median_s": med,
                     "min_s": min(slowest), "max_s": max(slowest), "ratio": med / model})
    return rows


def format_rows(rows: list[dict]) -> str:
    """The table: case, bytes, model ms, measured median ms (min-max), measured / model."""
    lines = [f"{'case':<14}{'bytes':>12}{'model ms':>10}{'measured ms':>13}{'min-max':>14}"
             f"{'measured/model':>16}"]
    for r in rows:
        spread = f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}"
        lines.append(f"{r['case']:<14}{r['size_bytes']:>12,}{r['model_s'] * 1e3:>10.1f}"
                     f"{r['median_s'] * 1e3:>13.1f}{spread:>14}{r['ratio']:>16.2f}")
    return "\n".join(lines)
