"""ZeRO-Offload, measured: bytes on the device and on the host, the step split, the same losses.

Idea (zerolab/variants/offload.py): one torchrun group builds ZeRO-2 and ZeRO-2 with
its optimizer offloaded (once per host link given) from the same seed and runs them round by
round on the same batches, one bf16 step of each per round in an order rotated every round, a
barrier before each step (as `zerolab bench`). Measured per rank:
- bytes after the last step, by the memory meter: the device's model states (2Ψ + 2Ψ/N with
  offload, 2Ψ + 14Ψ/N without) and the host's (18Ψ/N), each next to its formula at the padded
  Ψ (`offload.device_bytes`, `offload.host_bytes`, `theory.model_state_bytes`): equal, exactly;
  the bytes of each step's transfers (the offload ledger) next to `offload.transfer_bytes`;
- the losses: every step of every rank, offloaded == not offloaded, bit for bit on a CPU (the
  same casts, clipping and AdamW, run by the same CPU); on a GPU the plain step's AdamW runs on
  the GPU and the offloaded one's on the CPU - the same update, rounded by other kernels - so the
  table gives the largest relative difference instead (gpt2 on an H200, 12 steps: 2e-04);
- each step's seconds: forward + backward, and the optimizer step split into gradients down,
  host update (casts, clipping, AdamW), weights up and the rest (the all_gather); median and
  min-max over rounds, rank 0's, and the step's ratio to the plain ZeRO-2 of the same round;
- the model's split (`offload.step_model`): the transfers from the link's α-β (emulated here,
  so measured >= model by construction: the check is that the emulator adds nothing else), the
  host update from a micro-benchmark of the very same update on copies of the rank's shards
  (FlatAdamW over the same parameter segments, after training, as loaded as training was).

On a CPU the "device" and the host are the same cores: the offloaded step runs the same AdamW as
the plain one, so the ratio is ~1 plus the emulated link's time; on a GPU the host update is the
cost (torch's AdamW on the CPU vs the GPU's), which this module measures the same way (`--device
cuda`, one rank per GPU: the copies are real and `--offload-link` is only the model).

Measured (tiny, 2 gloo ranks on a shared 2-core CPU at load 4-6, bf16, batch 8, 30 rounds;
docs/time.md): device bytes per rank 661,632 with offload vs 1,984,896 without, host 1,984,896,
each equal to its formula; losses equal bit for bit; step time, median [min-max] over rounds:
plain 211 ms [134-1266], offloaded over emulated PCIe 4 244 ms, 1.00x [0.78-1.93] the plain
step of the same round (host update 6.4 ms, model 4.9; transfers 0.3 ms; the cores' load swamps
the rest), over 1 Gb/s + 10 us 1.03x [0.75-1.81] (gradients down 2.0 ms, α-β 1.8 ms).

    python -m zerolab.course.offloadcheck --offload-link pcie4,0.1@100 --rounds 30
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import theory
from ..variants import offload
from ..comm import Comm
from ..data import get_batch, load_tokens, rank_slice
from ..memory import HOST, MemoryMeter
from ..model import GPT, get_config
from ..optim import FlatAdamW
from ..timing import hardware
from ..variants.compose import make_strategy
from ..run.launch import cuda_device_count
from . import nb

MODULE = "zerolab.course.offloadcheck"
SPLIT = ("fwd_bwd_s", "down_s", "host_s", "adam_s", "sync_s", "up_s", "rest_s", "total_s")


def host_update_seconds(strategy, repeats: int = 5) -> float:
    """The host's part of an offloaded step, on copies of `strategy`'s shards (its Offload's
    buffers and masters, FlatAdamW over the same segments and decay flags): the gradient's cast
    to fp32, AdamW, the weights' cast into the staging buffer; median of `repeats` after one."""
    off, units = strategy.offload, strategy.units
    masters = [u.master.detach().clone() for u in units]
    grads = [off.grad[u.name].clone() for u in units]
    staging = [off.staging[u.name] for u in units]
    opt = FlatAdamW(masters, [u.segments(True) for u in units], [u.decay for u in units],
                    lr=1e-9)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for m, g, s in zip(masters, grads, staging):
            if s is not None:
                g.copy_(s)                  # bf16 -> fp32
            m.grad = g
        opt.step()
        for m, s in zip(masters, staging):
            if s is not None:
                s.copy_(m)                  # fp32 -> bf16
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def rank_measure(args) -> dict | None:
    """Every rank: build the systems, run warmup + rounds rounds; rank 0 returns the summary:
    every rank's per-round seconds, losses, bytes and model figures, and the settings."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.device == "cpu" else torch.device(
        "cuda", torch.cuda.current_device())
    if device.type == "cpu":
        torch.set_num_threads(1)            # the ranks share the cores
    cfg = get_config(args.preset)
    tokens, _ = load_tokens(args.data, cfg.block_size)
    systems = []
    for spec in [None, *args.offload_link]:
        torch.manual_seed(args.seed)
        model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
        meter = MemoryMeter(enabled=False)
        off = offload.Offload(hardware.parse_link(spec, "--offload-link")) if spec else None
        s = make_strategy(2, model, Comm(), max_grad_norm=1.0, lr=1e-3, weight_decay=0.1,
                          meter=meter, offload=off)
        systems.append({"label": "ZeRO-2" + (f" offload {spec}" if spec else ""), "link": spec,
                        "s": s, "meter": meter, "rounds": [], "losses": []})
    total = args.warmup + args.rounds
    for r in range(total):
        x, y = get_batch(tokens, r, args.batch_size, cfg.block_size, args.seed)
        x, y = (rank_slice(t, rank, n).to(device) for t in (x, y))
        k = r % len(systems)
        for sy in systems[k:] + systems[:k]:          # rotated every round
            s, last = sy["s"], r == total - 1
            sy["meter"].enabled = last                # bytes after the last step
            s.comm.step = r
            dist.barrier()
            t0 = time.perf_counter()
            loss = s.forward(x, y)
            s.backward(loss)
            t1 = time.perf_counter()
            s.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            sy["losses"].append(float(loss.detach()))
            off = s.options["offload"]          # the strategy's Offload, or None
            if off is not None:                 # the least transfer time / α-β time so far
                sy["floor"] = min([sy.get("floor", float("inf"))] + [
                    t["s"] / t["model_s"] for t in off.records if t["model_s"]])
            if r >= args.warmup:
                split = dict.fromkeys(("down_s", "host_s", "adam_s", "sync_s", "up_s"), 0.0)
                if off is not None:
                    split.update({k: v for k, v in off.steps[-1].items() if k != "step"})
                split.update(fwd_bwd_s=t1 - t0, step_s=t2 - t1, total_s=t2 - t0)
                split["rest_s"] = split["step_s"] - sum(split[k] for k in (
                    "down_s", "host_s", "sync_s", "up_s"))
                sy["rounds"].append(split)
            s.comm.settle()
            s.comm.records.clear()
    psi = sum(u.padded_numel for u in systems[0]["s"].units)
    mine = []
    for sy in systems:
        s, cur = sy["s"], sy["meter"].current
        row = {"label": sy["label"], "link": sy["link"], "losses": sy["losses"],
               "rounds": sy["rounds"],
               "device": {k: v for k, v in cur.items() if not k.startswith(HOST)},
               "host": {k: v for k, v in cur.items() if k.startswith(HOST)}}
        off = s.options["offload"]
        if off is not None:
            link = off.link
            row.update(moved=off.step_bytes(total - 1),
                       floor=sy["floor"],
                       host_update_s=host_update_seconds(s, args.repeats),
                       link={"name": link.name, "bandwidth": link.bandwidth,
                             "latency": link.latency})
        mine.append(row)
        s.close()
    everyone = [None] * n
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    return {"preset": args.preset, "world_size": n, "device": args.device,
            "backend": dist.get_backend(),
            "batch_size": args.batch_size, "rounds": args.rounds, "warmup": args.warmup,
            "psi_padded": psi, "units": len(systems[0]["s"].units), "ranks": everyone}


def rank_main(argv) -> int:
    """A rank of `measure`'s group: rank 0 writes OUT/offloadcheck.json."""
    import datetime
    args = parser().parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=600))
    try:
        summary = rank_measure(args)
        if summary is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "offloadcheck.json").write_text(json.dumps(summary))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure(*, nproc: int = 2, preset: str = "tiny", batch_size: int = 8,
            offload_link=("pcie4",), rounds: int = 30, warmup: int = 3, repeats: int = 5,
            seed: int = 0, device: str = "cpu", data: str | None = None,
            out: str = "runs/offloadcheck",
            timeout: float = 1200, echo=print) -> dict:
    """Start `nproc` ranks (gloo; NCCL, one per GPU, with device "cuda") that interleave the
    systems (module docstring); return the summary rank 0 wrote to OUT/offloadcheck.json."""
    argv = ["--preset", preset, "--batch-size", str(batch_size), "--offload-link",
            ",".join(offload_link), "--rounds", str(rounds), "--warmup", str(warmup),
            "--repeats", str(repeats), "--seed", str(seed), "--device", device, "--out", out]
    argv += ["--data", str(data)] if data else []
    nb.launch_module(MODULE, argv, nproc=nproc, timeout=timeout, echo=echo)
    return json.loads((Path(out) / "offloadcheck.json").read_text())


# --- the table ---------------------------------------------------------------------------------
def _spread(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def table(summary: dict) -> list[dict]:
    """One row per system: bytes (rank 0's; `exact`: measured == formula on every rank), bytes
    moved in the last step and their formula, the emulated link's floor (the least ratio of a
    transfer's seconds to its α-β time, over every transfer of every rank: >= 1 when the
    device is the CPU), losses equal to the plain run's on every rank and step (and the largest
    relative difference of any, `loss_rel_diff`: 0 on a CPU), seconds per
    round (rank 0's spread of each of SPLIT), the step's ratio to the plain ZeRO-2 of the same
    round, and the model's split (`offload.step_model`: transfers from the
    link, host from the micro-benchmark, the device's part as measured)."""
    n, psi, ranks = summary["world_size"], summary["psi_padded"], summary["ranks"]
    plain = [r[0] for r in ranks]
    rows = []
    for i, r0 in enumerate(ranks[0]):
        mine = [r[i] for r in ranks]
        off = r0["link"] is not None
        dev = (offload.device_bytes(psi, n, 2) if off else theory.model_state_bytes(psi, n, 2))
        host = offload.host_bytes(psi, n) if off else {}
        row = {"label": r0["label"], "link": r0["link"],
               "device": sum(r0["device"].get(k, 0) for k in theory.STATES),
               "device_formula": sum(dev.values()),
               "host": sum(r0["host"].values()), "host_formula": sum(host.values()),
               "exact": all({k: m["device"].get(k, 0) for k in theory.STATES} == dev
                            and {k: m["host"].get(k, 0) for k in host} == host for m in mine),
               "same_losses": all(m["losses"] == p["losses"] for m, p in zip(mine, plain)),
               "loss_rel_diff": max(abs(a - b) / abs(b) for m, p in zip(mine, plain)
                                    for a, b in zip(m["losses"], p["losses"])),
               "final_loss": r0["losses"][-1],
               "time": {k: _spread([x[k] for x in r0["rounds"]]) for k in SPLIT},
               "ratio": _spread([a["total_s"] / b["total_s"]
                                 for a, b in zip(r0["rounds"], plain[0]["rounds"])])}
        if off:
            moved = offload.transfer_bytes(psi, n)
            row.update(moved=r0["moved"], moved_formula=moved,
                       floor=min(m["floor"] for m in mine), model=offload.step_model(
                psi, n, summary["units"], hardware.Link(**r0["link"]), r0["host_update_s"],
                sum(row["time"][k]["median"] for k in ("fwd_bwd_s", "sync_s", "rest_s"))))
        rows.append(row)
    return rows


def format_table(summary: dict) -> str:
    """The measured table: bytes per rank, then milliseconds (median [min-max] over rounds)."""
    rows = table(summary)
    lines = [f"{summary['preset']} GPT, ZeRO-2 on {summary['world_size']} "
             f"{summary.get('backend', 'gloo')} rank(s) "
             f"({summary['device']}), bf16, batch {summary['batch_size']}, {summary['rounds']} "
             f"rounds after {summary['warmup']}; Ψ padded {summary['psi_padded']:,}",
             f"{'system':<28}{'device B':>15}{'formula':>15}{'host B':>15}{'formula':>15}"
             f"{'exact':>6}{'losses':>8}"]
    for r in rows:
        lines.append(f"{r['label']:<28}{r['device']:>15,}{r['device_formula']:>15,.0f}"
                     f"{r['host']:>15,}{r['host_formula']:>15,.0f}"
                     f"{'yes' if r['exact'] else 'NO':>6}"
                     f"{'equal' if r['same_losses'] else format(r['loss_rel_diff'], '.0e'):>8}")
    lines.append("losses: 'equal' = every step's loss on every rank equals the plain run's, bit "
                 "for bit; else the largest relative difference (on CUDA the plain AdamW runs on "
                 "the GPU, the offloaded one on the CPU: the same update, other rounding)")
    for r in rows:
        if "moved" in r:
            lines.append(f"{r['label']}: moved down {r['moved']['down']:,} B, up "
                         f"{r['moved']['up']:,} B in the last step (formula "
                         f"{r['moved_formula']['down']:,.0f} + {r['moved_formula']['up']:,.0f}); "
                         f"each transfer took >= {r['floor']:.3f}x the link's α-β time")
    lines.append("ms, rank 0, median [min-max] over rounds (rest: the step's all_gather; "
                 "plain ZeRO-2: its whole optimizer step)")
    lines.append(f"{'system':<26}" + "".join(f"{k[:-2]:>21}" for k in SPLIT) + f"{'x plain':>22}")

    def cell(s, scale=1e3, fmt=".1f"):
        return f"{s['median'] * scale:{fmt}} [{s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}}]"
    for r in rows:
        lines.append(f"{r['label']:<26}" + "".join(f"{cell(r['time'][k]):>21}" for k in SPLIT)
                     + f"{cell(r['ratio'], 1, '.3f'):>22}")
        if "model" in r:
            m = {**r["model"], "total_s": r["model"]["step_s"]}
            modelled = ("down_s", "host_s", "up_s", "total_s")
            lines.append(f"{'  model':<26}" + "".join(
                f"{m[k] * 1e3:>21.3f}" if k in modelled else f"{'':>21}" for k in SPLIT))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--offload-link", default=["pcie4"],
                   type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                   help="comma list of host links, profiles or GBPS@LATENCY_US (default pcie4)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--repeats", type=int, default=5, help="the host update's micro-benchmark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="a text file (default: Python stdlib sources)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default="runs/offloadcheck")
    return p


def check_device(device: str, nproc: int, gpus: int | None = None) -> None:
    """SystemExit with one line when `device` cannot run `nproc` ranks here: --device cuda runs
    one NCCL rank per GPU (NCCL refuses two ranks on one GPU), so it needs 1 <= nproc <= GPUs.
    `gpus`: the GPUs torch sees (default: `run.launch.cuda_device_count`, no CUDA context)."""
    if nproc < 1:
        raise SystemExit(f"offloadcheck: --nproc {nproc}: give 1 or more ranks")
    if device != "cuda":
        return
    gpus = cuda_device_count() if gpus is None else gpus
    if gpus == 0:
        raise SystemExit("offloadcheck: --device cuda but torch sees no CUDA device "
                         "(use --device cpu)")
    if nproc > gpus:
        raise SystemExit(f"offloadcheck: --device cuda runs one NCCL rank per GPU: --nproc {nproc} "
                         f"> {gpus} GPU(s) here (use --nproc {gpus}, or --device cpu)")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check_device(args.device, args.nproc)
    for spec in args.offload_link:
        hardware.parse_link(spec, "--offload-link")       # a bad link: one line, before launching
    summary = measure(nproc=args.nproc, preset=args.preset, batch_size=args.batch_size,
                      offload_link=args.offload_link, rounds=args.rounds, warmup=args.warmup,
                      repeats=args.repeats, seed=args.seed, device=args.device, data=args.data,
                      out=args.out, echo=None)
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:                # a rank of `measure`'s torchrun group
        from ..run.rank import rank_entry
        rank_entry(lambda: rank_main(sys.argv[1:]))
    else:
        raise SystemExit(main())
