"""GPU check for the labs: the labs' core runs (stages 0-3) on real devices, asserted against the
formulas, in well under 5 minutes.

With >= 2 GPUs: NCCL, one rank per GPU. With 1 GPU: NCCL refuses two ranks on one GPU
("Duplicate GPU detected"), so the check runs 2 gloo ranks that share it (gloo stages CUDA
tensors through host memory; each rank's CUDA allocator figures stay valid). `--device cpu` runs
the same code path on gloo CPU ranks (what CI and laptops can do).

Asserts, per rank: measured model-state bytes == formula at the padded Ψ (each state), ledger
bytes per step == traffic formula (each collective; ZeRO-1 with all_reduce and with
reduce_scatter). Prints torch.cuda's peak allocated next to the model-state formula, and a
compact summary; writes it as JSON with --out. Exits 1 on any mismatch or failed launch.

    python labs/gpu_check.py --out gpu_check.json            # on the GPU machine
    python labs/gpu_check.py --device cpu --out /tmp/c.json  # anywhere
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from zerolab import labs, theory
from zerolab.launch import LaunchError, cuda_device_count, run_torchrun
from zerolab.report import load_run


def plan(device: str, nproc: int | None) -> tuple[str, str, int, str]:
    """(backend, device, nproc, note) for this machine."""
    gpus = cuda_device_count()
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cpu":
        return "gloo", "cpu", nproc or 2, "gloo on CPU (code-path check; no CUDA figures)"
    if gpus == 0:
        raise SystemExit("gpu_check: --device cuda but no GPU is visible")
    if gpus >= 2 and (nproc or gpus) <= gpus:
        n = nproc or min(gpus, 8)
        return "nccl", "cuda", n, f"NCCL, one rank per GPU ({n} of {gpus} GPUs)"
    n = nproc or 2
    return "gloo", "cuda", n, (f"gloo on CUDA, {n} ranks sharing {gpus} GPU(s): NCCL refuses two "
                               "ranks on one GPU ('Duplicate GPU detected')")


def launch(out, stages, args, backend, device, nproc, **flags):
    argv = ["--stages", stages, "--preset", args.preset, "--steps", str(args.steps), "--out", str(out),
            "--backend", backend, "--device", device,
            "--batch-size", str(labs.batch_size_for(nproc, args.batch_size))]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return labs.tolerate_teardown_abort(
        lambda: (run_torchrun(argv, nproc, timeout=args.timeout, echo=print if args.verbose else None),
                 load_run(out))[1], out=out, stages=stages, nproc=nproc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2)")
    ap.add_argument("--preset", default=None, help="default: gpt2 on CUDA, tiny on CPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="global rows (rounded up to N)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    ap.add_argument("--runs", default=None, help="folder for the rank JSONs (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the summary JSON here")
    ap.add_argument("--verbose", action="store_true", help="echo the ranks' output")
    args = ap.parse_args(argv)
    backend, device, nproc, note = plan(args.device, args.nproc)
    args.preset = args.preset or ("gpt2" if device == "cuda" else "tiny")
    runs_dir = Path(args.runs or tempfile.mkdtemp(prefix="zerolab_gpu_check_"))
    print(f"gpu_check: {note}; preset {args.preset}, {args.steps} steps, runs in {runs_dir}", flush=True)

    t0 = time.perf_counter()
    failures, summary = [], {"backend": backend, "device": device, "nproc": nproc, "note": note,
                             "preset": args.preset, "stages": {}}
    try:
        snapshot = {"cuda_snapshot": True} if device == "cuda" else {}
        runs = launch(runs_dir / "notes", "0,1,2,3", args, backend, device, nproc, **snapshot)
        runs_rs = launch(runs_dir / "zero1_rs", "1", args, backend, device, nproc,
                         zero1_grad_op="reduce_scatter", no_allocator=True)
    except LaunchError as err:
        print(f"gpu_check: FAILED launch: {err}", file=sys.stderr)
        return 1

    # --- memory: every rank, every state ----------------------------------------------------
    try:
        summary["memory_values_checked"] = labs.check_memory(runs)
    except AssertionError as err:
        failures.append(f"memory: {err}")
    # --- traffic: every collective, both ZeRO-1 variants -------------------------------------
    rows = labs.traffic_rows(runs) + labs.traffic_rows(runs_rs)
    try:
        summary["traffic_values_checked"] = labs.check_traffic(rows)
    except AssertionError as err:
        failures.append(f"traffic: {err}")

    print(f"\n{'stage':<24}{'states (B)':>14}{'formula':>14}{'bytes/step':>13}{'formula':>13}"
          f"{'peak alloc (B)':>16}{'peak/states':>12}")
    for row in rows:
        stage_runs = runs_rs if row["name"].endswith("(reduce_scatter)") else runs
        ranks = stage_runs[row["stage"]]
        states = max(r["memory"]["model_states_total"] for r in ranks)
        formula = sum(ranks[0]["theory"]["model_states_padded"].values())
        peak = max(((r["memory"].get("allocator") or {}).get("peak_absolute") or 0) for r in ranks)
        traffic, t_formula = sum(row["measured"].values()), sum(row["formula"].values())
        print(f"{row['name']:<24}{states:>14,}{formula:>14,.0f}{traffic:>13,.0f}{t_formula:>13,.0f}"
              f"{peak:>16,}{(peak / states if peak else float('nan')):>12.2f}")
        summary["stages"][row["name"]] = {
            "model_states": states, "model_states_formula": formula, "bytes_per_step": traffic,
            "bytes_per_step_formula": t_formula, "allocator_peak": peak,
            "allocator_source": (ranks[0]["memory"].get("allocator") or {}).get("source"),
            "timing": row["timing"]}
    snaps = sorted(str(p) for p in (runs_dir / "notes").glob("stage*/rank*_snapshot.json"))
    summary["cuda_snapshots"] = snaps
    if device == "cuda":
        print(f"\ntorch.cuda peak allocated counts model states + activations + temporaries; "
              f"{len(snaps)} CUDA snapshot(s) written under {runs_dir / 'notes'}")
        if not snaps:
            failures.append("cuda: --cuda-snapshot wrote no snapshot")
    summary["failures"] = failures
    summary["seconds"] = time.perf_counter() - t0
    summary["ok"] = not failures
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1, default=float))
        print(f"wrote {args.out}")
    for f in failures:
        print(f"gpu_check: MISMATCH {f}", file=sys.stderr)
    print(f"gpu_check: {'OK' if not failures else 'FAILED'} in {summary['seconds']:.0f} s "
          f"({summary.get('memory_values_checked', 0)} memory and "
          f"{summary.get('traffic_values_checked', 0)} traffic values checked)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
