"""This laptop's measurements for the papers' table (zerolab.course.papers): zerolab's own code,
one step on torch's fake process group (the ledger's and the memory meter's bytes, exact), and
two timings (ZeRO-3's prefetch on the emulated link, the host's AdamW).

    report, ledger = one_step(8, 3, hybrid="hsdp", ranks_per_node=4)   # rank 0 of a fake 8
    held_elements("dim0", (4, 3), 16)                                  # 48: FSDP2's padding
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from ..comm import Comm
from ..variants.compose import make_strategy
from ..model import GPT, get_config
from ..timing import costmodel, hardware, linkemu, whatif


def one_step(n: int, stage: int, preset: str = "nano", **options) -> tuple[dict, dict]:
    """Rank 0 of a fake world of `n` runs one bf16 step of `stage` with `options`
    (`make_strategy`'s) on the preset's GPT built on the meta device: (report, ledger), the
    report `whatif.rank_report`'s (bytes by state, the meter's peaks, num_params_padded) and the
    ledger {(op, phase, tier): bytes per rank} ("world" for the whole group's rings)."""
    cfg = get_config(preset)
    with whatif.fake_world(n):
        comm = Comm()
        with torch.device("meta"):
            model = GPT(cfg).to(torch.bfloat16)
        report = whatif.rank_report(stage, model, comm, tokens=cfg.block_size,
                                    zero3_prefetch=options.pop("prefetch", 0), **options)
        ledger: dict = {}
        for r in comm.records:
            if r.what in ("grads", "params"):
                key = (r.op, r.phase, r.tier or "world")
                ledger[key] = ledger.get(key, 0.0) + r.bytes
    return report, ledger


def held_elements(layout: str, shape: tuple, n: int) -> float:
    """Elements rank 0 of a fake world of `n` holds for one parameter of `shape` after
    `fully_shard(layout=...)`, times n (every rank holds as many)."""
    from ..torchlike import fully_shard, held_bytes
    with whatif.fake_world(n):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.zeros(shape))
        fully_shard(module, layout=layout, comm=Comm())
        return held_bytes(module)["params"] / 4 * n


def prefetch_gain(preset: str = "tiny", gbps: float = 1.0, latency_us: float = 100.0,
                  rounds: int = 8, warmup: int = 2) -> dict:
    """ZeRO-3's step time saved by prefetching one block ahead (1 - t_prefetch / t_none): the
    cost model on this machine's measured units (`costmodel.measure_units`), and rank 0 of a
    fake world of 2 timing real steps whose collectives last as long as the emulated link
    (`linkemu.LinkEmulator`: the fake group moves nothing, the emulator sleeps the model's time,
    so what is measured is zerolab's schedule and overlap, not a network). The two strategies
    take turns, one step each a round; the ratio is taken per round, then its median."""
    cfg, n = get_config(preset), 2
    link = hardware.get_link(None, gbps, latency_us)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        units = costmodel.measure_units(GPT(cfg).to(torch.bfloat16), x, x, n, repeats=3)
        model_s = {p: costmodel.step_time(3, units, n, link, prefetch=p).total for p in (0, 1)}
        times: dict = {0: [], 1: []}
        with whatif.fake_world(n):
            systems = {}
            for p in (0, 1):
                comm = Comm()
                comm.link = linkemu.LinkEmulator(link, n)
                torch.manual_seed(0)
                systems[p] = make_strategy(3, GPT(cfg).to(torch.bfloat16), comm, prefetch=p,
                                           max_grad_norm=0.0)
            for i in range(warmup + rounds):
                for p, strategy in systems.items():
                    t0 = time.perf_counter()
                    strategy.backward(strategy.forward(x, x))
                    strategy.step()
                    strategy.comm.records.clear()
                    if i >= warmup:
                        times[p].append(time.perf_counter() - t0)
            for strategy in systems.values():
                strategy.close()
    finally:
        torch.set_num_threads(threads)
    ratio = statistics.median(b / a for a, b in zip(times[0], times[1]))
    med = {p: statistics.median(ts) for p, ts in times.items()}
    return {"predicted": (1 - model_s[1] / model_s[0]), "measured": 1 - ratio,
            "scaling": f"GPT {preset}, 4 rows a rank, {gbps:g} Gb/s + {latency_us:g} us emulated "
                       f"link, 2 ranks (rank 0 timed on a fake group, {rounds} rounds). Median "
                       f"{med[0] * 1e3:.1f} -> {med[1] * 1e3:.1f} ms a step, median of the "
                       f"rounds' ratios {ratio:.3f} (the measured gain is 1 - it). The model (compute "
                       f"of the units only): {model_s[0] * 1e3:.1f} -> {model_s[1] * 1e3:.1f} ms. "
                       "The emulator sleeps for the model's time: this checks zerolab's schedule "
                       "and overlap, not a network"}


def host_adamw_seconds(numel: int = 1 << 22, repeats: int = 3) -> float:
    """Seconds per parameter of torch's AdamW on one flat fp32 buffer (what zerolab's offload
    host runs, `optim.FlatAdamW`), this machine's threads, the least of `repeats` steps."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.ones(numel)
    opt = torch.optim.AdamW([p], lr=1e-3)
    best = math.inf
    for _ in range(repeats + 1):                    # the first builds the state
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0) if opt.state[p]["step"] > 1 else best
    return best / numel
