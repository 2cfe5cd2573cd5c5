"""Gradient buckets (`bucket_mb`, `--bucket-mb`): DDP / ZeRO-1 / ZeRO-2 merge consecutive blocks
into size-capped buckets. The result stays the single-process torch AdamW run's; the ledger shows
one gradient collective per bucket, counted here by hand from the GPT's parameter counts; the
bytes moved stay theory's formula; ZeRO-2's transient bucket peak grows with the cap as
`theory.zero2_bucket_peak_bytes` says; the cost model groups blocks as the strategies do.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import global_batch, make_model, run_ranks
from zerolab import theory
from zerolab.course import bench, testing
from zerolab.course.testing import LR, WD, max_param_diff, train_job
from zerolab.model import GPT, get_config
from zerolab.run import options
from zerolab.sharding import bucket_numel, build_units
from zerolab.timing import costmodel

STEPS = 5
VARIANTS = [(0, None), (1, "all_reduce"), (1, "reduce_scatter"), (2, None)]
D, VOCAB, T = 32, 256, 32                       # the nano preset: n_embd, vocab, block_size
BLOCK = 12 * D * D + 13 * D                     # a GPT block: attn 4d²+4d, mlp 8d²+5d, 2 LN 4d
ROOT = VOCAB * D + T * D + 2 * D                # wte (tied head), wpe, final LayerNorm


def hand_buckets(n_blocks: int, mb: float | None, block: int = BLOCK, width: int = 4) -> list[int]:
    """Blocks per bucket, by hand: as many whole blocks as fit in mb MiB of `width`-byte grads."""
    per = 1 if mb is None else max(1, int(mb * 2**20 / width) // block)
    return [min(per, n_blocks - i) for i in range(0, n_blocks, per)]


NANO4 = dict(model="nano4", precision="fp32", grad_accum=1, rows_per_micro=2, max_norm=0.5,
             bucket_mb=0.1)                                          # buckets of 2 + 2 blocks
NANO4_ACCUM = dict(NANO4, grad_accum=4, rows_per_micro=1, bucket_mb=0.15)      # 3 + 1 blocks
# one bucket holding both CondToy blocks: block 1 is skipped on some ranks / micro-steps, so the
# bucket must open at block 0's pre-backward too (ZeRO-2), and parameters get no gradient
COND_MICRO = dict(model="cond", precision="fp32", grad_accum=2, rows_per_micro=1, max_norm=0.5,
                  find_unused=True, trigger=[[0, 2]], bucket_mb=1)
COND_RANKS = dict(COND_MICRO, grad_accum=1, rows_per_micro=2, trigger=[[0], [], [3], [1, 2], []],
                  freeze=(2, "blocks.0.a.weight"))
JOBS = {"nano4": NANO4, "accum": NANO4_ACCUM, "cond_micro": COND_MICRO, "cond_ranks": COND_RANKS}
PEAK_CAPS = (None, 0.1, 0.15, 1)                # nano with 8 blocks: buckets of 1, 2, 3, 8 blocks


def _worker(rank, n):
    import torch.distributed as dist


    from zerolab.variants.compose import make_strategy
    from zerolab.comm import Comm
    from zerolab.memory import MemoryMeter
    from zerolab.zero2 import ZeRO2

    out = {}
    for key, job in JOBS.items():
        for stage, grad_op in VARIANTS:
            model = make_model(job["model"])
            comm = Comm()
            kwargs = dict(max_grad_norm=job["max_norm"], lr=LR, weight_decay=WD,
                          find_unused_parameters=job.get("find_unused", False),
                          bucket_mb=job["bucket_mb"], **({"grad_op": grad_op} if grad_op else {}))
            s = make_strategy(stage, model, comm, **kwargs)
            losses, norms = train_job(s, model, job, rank, n, STEPS)
            last = [r for r in comm.records if r.step == STEPS - 1]
            out[key, stage, grad_op] = {
                "losses": losses, "norms": norms, "params": s.full_parameters(),
                "units": [(u.name, u.numel) for u in s.units],
                "grads": [(r.op, r.phase) for r in last if r.what == "grads"],
                "params_gathers": sum(r.what == "params" for r in last),
                "bytes": comm.bytes_by_op(step=STEPS - 1)}
            s.close()
            dist.barrier()
    for mb in PEAK_CAPS:                # ZeRO-2's bucket peak against the cap: one step each
        torch.manual_seed(0)
        model, meter = GPT(get_config("nano", n_layer=8)), MemoryMeter()
        z = ZeRO2(model, Comm(), meter=meter, bucket_mb=mb, lr=LR)
        x, y = global_batch(model, 0, 2 * n)
        meter.reset_peaks()
        z.backward(z.forward(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        z.step()
        out["peak", mb] = {"grad_buckets": meter.peak["grad_buckets"],
                           "units": [u.padded_numel for u in z.units]}
        z.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_worker, 2, timeout=180)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", JOBS)
def test_buckets_train_like_single_process_adamw(runs, key):
    """Same bounds as test_equivalence.check_fp32: the same loss and global gradient norm up to
    fp32 rounding of sums in another order (rel 2e-6), parameters within 1e-6."""
    job = JOBS[key]
    ref = testing.reference(job, 2, STEPS)
    for variant in VARIANTS:
        losses = [sum(r[(key, *variant)]["losses"][i] for r in runs) / 2 for i in range(STEPS)]
        assert losses == pytest.approx(ref["losses"], rel=2e-6), variant
        for rank, r in enumerate(runs):
            res = r[(key, *variant)]
            assert res["norms"] == pytest.approx(ref["norms"], rel=2e-6), (variant, rank)
            assert max_param_diff(res["params"], ref["params"]) <= 1e-6, (variant, rank)
    if key == "cond_ranks":             # the unused parameters stayed where they started
        init = dict(make_model("cond").named_parameters())
        for r in runs:
            for k in ("spare", "blocks.1.unused.weight"):
                assert torch.equal(r[(key, 2, None)]["params"][k], init[k].detach())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", ["nano4", "accum"])
def test_one_gradient_collective_per_bucket_and_the_formula_bytes(runs, key):
    job = JOBS[key]
    sizes = hand_buckets(4, job["bucket_mb"])
    assert sizes == ([2, 2] if key == "nano4" else [3, 1])            # what the job is about
    buckets = 1 + len(sizes)                                          # + the root unit
    psi = ROOT + 4 * BLOCK                       # N = 2 divides every unit: padded Ψ = Ψ
    A = job["grad_accum"]
    for r in runs:
        for stage, grad_op in VARIANTS:
            res = r[key, stage, grad_op]
            names = ["root"] + [f"block.{sum(sizes[:i])}" + (f"-{sum(sizes[:i + 1]) - 1}" if s > 1
                                                             else "")
                                for i, s in enumerate(sizes)]
            assert res["units"] == [("root", ROOT)] + [(nm, s * BLOCK) for nm, s in
                                                       zip(names[1:], sizes)]
            op = "reduce_scatter" if stage == 2 or grad_op == "reduce_scatter" else "all_reduce"
            # the job's loop passes sync=False before the last micro-step: ZeRO-2 accumulates
            # the full local gradient then, and reduces once a step like the others
            assert res["grads"] == [(op, "backward")] * buckets, (stage, grad_op)
            assert res["params_gathers"] == (buckets if stage else 0)
            want = theory.traffic_bytes(psi, 2, stage, "fp32", grad_op or "all_reduce", A,
                                        no_sync=True)
            assert res["bytes"] == {**want, "broadcast": 0.0}, (stage, grad_op)


@pytest.mark.timeout(240)
def test_zero2_bucket_peak_grows_with_the_cap(runs):
    """Root bucket + three consecutive block buckets (two reduce_scatters in flight, one
    filling): 3, 6, 8, 8 of the 8 blocks for buckets of 1, 2, 3 and 8 blocks."""
    peaks = []
    for mb in PEAK_CAPS:
        sizes = hand_buckets(8, mb)
        blocks = min(8, max(sum(sizes[i:i + 3]) for i in range(max(1, len(sizes) - 2))))
        want = (ROOT + blocks * BLOCK) * 4
        assert blocks == {None: 3, 0.1: 6, 0.15: 8, 1: 8}[mb]
        for r in runs:
            got = r["peak", mb]
            assert got["grad_buckets"] == want, (mb, got["grad_buckets"], want)
            assert theory.zero2_bucket_peak_bytes(got["units"][1:], got["units"][0], 4) == want
        peaks.append(want)
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


# --- no ranks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["small", "tiny", "tied", "odd"])
def test_cost_model_groups_blocks_as_the_strategies_do(model_name):
    if model_name in ("small", "tiny"):
        with torch.device("meta"):
            model = GPT(get_config(model_name))
    else:
        model = make_model(model_name)
    per_block = build_units(model, 3, 0)
    blocks = [costmodel.Unit(u.name, u.numel) for u in per_block]
    for cap in (1, 1e3, 5e5, 9e5, 1.4e6, 1e9):
        units = build_units(model, 3, 0, int(cap))
        merged = costmodel.merge_units(blocks, int(cap))
        assert [(u.name, u.numel) for u in units] == [(u.name, u.numel) for u in merged], cap
        assert all(sum(p.numel() for p in u.params) == u.numel for u in units)
        assert sum(len(u.modules) for u in units) == len(per_block) - (per_block[0].name == "root")


def test_bucket_groups_by_hand():
    assert theory.bucket_groups([3, 3, 3], None) == [[0], [1], [2]]
    assert theory.bucket_groups([3, 3, 3], 6) == [[0, 1], [2]]
    assert theory.bucket_groups([3, 9, 3, 3], 6) == [[0], [1], [2, 3]]     # 9 > cap: alone
    assert theory.bucket_groups([3, 3, 3], 100) == [[0, 1, 2]]
    assert theory.bucket_name(["block.0", "block.1", "block.2"]) == "block.0-2"
    for bad in (0, -1, math.nan, math.inf, "4", True):
        with pytest.raises(ValueError):
            theory.bucket_groups([1], bad)


def test_bucket_mb_counts_mib_of_gradients():
    model = make_model("nano")
    assert bucket_numel(1, model) == 2**20 // 4                        # fp32 gradients
    assert bucket_numel(1, model, torch.bfloat16) == 2**20 // 2
    assert bucket_numel(None, model) is None


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_bad_bucket_mb_is_one_line(value):
    with pytest.raises(ValueError) as err:        # the ranks' own parser, as nb.launch uses it
        options.check(options.parse("ranks", ["--bucket-mb", value, "--preset", "nano"]), 2)
    assert "--bucket-mb" in str(err.value) and value in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="bucket"):
        build_units(make_model("nano"), 2, 0, float(value))
    with pytest.raises(ValueError, match="bucket_mb"):
        bucket_numel(float(value), make_model("nano"))


@pytest.mark.parametrize("name,error", [("zerolab-zero3@4", "only zerolab-ddp"),
                                        ("zerolab-ddp@x", "not a number"),
                                        ("zerolab-ddp@-2", "> 0"), ("torch-ddp@4", "only"),
                                        ("nope@4", "not one of")])
def test_bad_bench_bucket_systems(name, error):
    with pytest.raises(ValueError, match=error):
        bench.parse_systems(f"zerolab-ddp,{name}", link=False)
    assert bench.parse_systems("zerolab-ddp,zerolab-ddp@4,torch-ddp", link=True) == [
        "zerolab-ddp", "zerolab-ddp@4"]
