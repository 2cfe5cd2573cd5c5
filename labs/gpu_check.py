"""GPU check for the labs: stages 0-3 on real devices, asserted against the formulas, a CPU fp32
reference and each other, in one command (52-56 s on one H200, 2026-12-04), printing one table.

With >= 2 GPUs: NCCL, one rank per GPU. With 1 GPU: NCCL refuses two ranks on one GPU
("Duplicate GPU detected"), so the check runs 2 gloo ranks that share it (gloo stages CUDA
tensors through host memory; each rank's CUDA allocator figures stay valid). `--device cpu` runs
the same code path on gloo CPU ranks: the CPU twin that CI runs (tests/test_gpu_check.py).

Two launches on the chosen device (and, on CUDA, a third on CPU):
  notes  stages 0-3, bf16, --preset (gpt2 on CUDA), with the allocator cross-check and (CUDA)
         an allocator snapshot of the last step;
  fp32   stages 0-3, fp32, --max-grad-norm 0, --grad-accum 2, --zero3-prefetch,
         --zero1-grad-op reduce_scatter, --save-params, preset --ref-preset;
  ref    (CUDA only) the same fp32 run of stage 0 on gloo CPU ranks: the CPU fp32 reference.
         On --device cpu the fp32 run is itself on CPU, so its stage 0 is the reference.

Checks (each a row of the table; exit 1 when any fails):
  placement   every rank's JSON says the chosen backend and device were used;
  memory      measured model-state bytes == formula at the padded Ψ, every rank, state, run;
  traffic     ledger bytes per step == formula, each collective (ZeRO-1 both ways; A = 2);
  numerics    every stage of the fp32 run vs the reference: losses within LOSS_RTOL relative;
              parameters: all within 2·lr·steps (Adam moves an element by ±lr when a tiny
              gradient's sign flips under another summation order) and at least
              1 - PARAM_OUTLIERS of the elements within PARAM_ATOL;
  leak        before stages 1-3 no earlier strategy is alive (after gc) and, on CUDA,
              memory_allocated equals its value before stage 0 (LEAK_SLACK bytes), both read
              after dropping cuBLAS's workspaces (run.stage.before_stage: 65 MiB on an H200
              that the library, not a strategy, keeps; the first GPU run failed on them);
              enforced when every strategy has close(), reported otherwise;
  durations   every collective's own duration (comm.TIME_SOURCES) is > 0 and below its step's time;
  prefetch    ZeRO-3 with --zero3-prefetch held one more gathered block than without;
  accumulation  every rank ran 2 micro-steps per step (and the traffic formula with A = 2 held).

    python labs/gpu_check.py --out gpu_check.json            # on the GPU machine
    python labs/gpu_check.py --device cpu --preset nano      # anywhere (the CI twin)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from zerolab.comm import TIME_SOURCES
from zerolab.course import checks as formula_checks
from zerolab.course import labs, results
from zerolab.course.results import load_run
from zerolab.memory import CUDA_FIGURES
from zerolab.run.launch import LaunchError, cuda_device_count, run_torchrun

LOSS_RTOL = 1e-4          # losses of a stage vs the reference, relative
PARAM_ATOL = 1e-5         # parameters: "equal" elements
PARAM_OUTLIERS = 1e-3     # share of elements allowed beyond PARAM_ATOL (sign flips of tiny grads)
LEAK_SLACK = 1 << 20      # bytes of CUDA memory_allocated drift allowed between stages
LR = 1e-3


def plan(device: str, nproc: int | None) -> tuple[str, str, int, str]:
    """(backend, device, nproc, note) for this machine."""
    gpus = cuda_device_count()
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cpu":
        return "gloo", "cpu", nproc or 2, "gloo on CPU (the CPU twin: no CUDA figures)"
    if gpus == 0:
        raise SystemExit("gpu_check: --device cuda but no GPU is visible (use --device cpu)")
    if gpus >= 2 and (nproc or gpus) <= gpus:
        n = nproc or min(gpus, 8)
        return "nccl", "cuda", n, f"NCCL, one rank per GPU ({n} of {gpus} GPUs)"
    n = nproc or 2
    return "gloo", "cuda", n, (f"gloo on CUDA, {n} ranks sharing {gpus} GPU(s): NCCL refuses two "
                               "ranks on one GPU ('Duplicate GPU detected')")


def launch(out: Path, stages: str, args, backend: str, device: str, nproc: int, *, preset: str,
           accum: int = 1, **flags) -> tuple[dict, str]:
    """Run zerolab.run.train; return (runs, note). A launch that exits non-zero after every rank
    wrote every stage's JSON (a crash in teardown, e.g. an NCCL abort at exit) is kept and noted;
    any other failure raises LaunchError."""
    argv = ["--stages", stages, "--preset", preset, "--steps", str(args.steps), "--out", str(out),
            "--backend", backend, "--device", device, "--grad-accum", str(accum),
            "--batch-size", str(labs.batch_size_for(nproc * accum, args.batch_size)),
            "--overwrite"]                          # this script owns its runs folder
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    try:
        run_torchrun(argv, nproc, timeout=args.timeout, echo=print if args.verbose else None)
        return load_run(out), ""
    except LaunchError as err:
        wanted = [out / f"stage{s}" / f"rank{r}.json" for s in stages.split(",") for r in range(nproc)]
        if not all(p.exists() for p in wanted):
            raise
        return load_run(out), f"{out.name}: exited non-zero after every rank wrote its JSON: " \
                              f"{str(err).splitlines()[0]}"


# --- checks: each returns (ok: bool | None, detail: str); None = reported, not enforced --------
def check_placement(runs_list, backend, device):
    bad = [f"{r['name']} rank {r['rank']}: {r['backend']} on {r['device']}"
           for runs in runs_list for ranks in runs.values() for r in ranks
           if r["backend"] != backend or not r["device"].startswith(device)]
    n = sum(len(ranks) for runs in runs_list for ranks in runs.values())
    return not bad, (f"{n} rank JSONs: {backend} on {device}" if not bad else "; ".join(bad[:4]))


def param_agreement(a: dict, b: dict) -> tuple[float, float]:
    """(max |a - b|, share of elements with |a - b| > PARAM_ATOL) over every parameter."""
    worst, outside, total = 0.0, 0, 0
    for k in a:
        d = (a[k].float() - b[k].float()).abs()
        worst = max(worst, float(d.max()))
        outside += int((d > PARAM_ATOL).sum())
        total += d.numel()
    return worst, outside / max(total, 1)


def check_numerics(fp32_dir: Path, runs, ref_dir: Path, ref_runs, steps: int):
    ref = ref_runs[0][0]
    ref_params = results.load_params(ref_dir, 0)
    bound = 2 * LR * steps
    parts, ok = [], True
    for stage, ranks in sorted(runs.items()):
        losses, ref_losses = ranks[0]["losses"], ref["losses"]
        loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        worst, share = param_agreement(results.load_params(fp32_dir, stage), ref_params)
        good = loss_err <= LOSS_RTOL and worst <= bound and share <= PARAM_OUTLIERS
        ok &= good
        parts.append(f"{ranks[0]['name']}: loss {loss_err:.1e}, max|Δp| {worst:.1e}, "
                     f"{100 * share:.3f}% > {PARAM_ATOL:g}")
    return ok, "; ".join(parts) + (f" (tolerances: loss {LOSS_RTOL:g} rel; |Δp| ≤ 2·lr·steps = "
                                   f"{bound:g}, ≤ {100 * PARAM_OUTLIERS:g}% beyond {PARAM_ATOL:g})")


def check_leak(runs, device):
    from zerolab import STRATEGIES
    enforced = all(hasattr(cls, "close") for cls in STRATEGIES.values())
    alive = {s: ranks[0].get("before_stage", {}).get("strategies_alive") for s, ranks in sorted(runs.items())}
    ok = all(not a for ranks in runs.values() for a in
             [r.get("before_stage", {}).get("strategies_alive") for r in ranks])
    detail = f"strategies alive before each stage (rank 0): {alive}"
    if device == "cuda":
        first = min(runs)
        for r0 in runs[first]:
            base = r0["before_stage"]["cuda"]["allocated"]
            for s, ranks in sorted(runs.items()):
                got = ranks[r0["rank"]]["before_stage"]["cuda"]["allocated"]
                ok &= abs(got - base) <= LEAK_SLACK
        detail += ("; CUDA allocated before each stage, after dropping cuBLAS's workspaces "
                   "(rank 0): " + ", ".join(
                       f"{s}: {ranks[0]['before_stage']['cuda']['allocated']:,} (workspaces "
                       f"{ranks[0]['before_stage']['cuda'].get('library_workspaces', 0):,})"
                       for s, ranks in sorted(runs.items())))
    if not enforced:
        return None, detail + " (not enforced: a strategy has no close())"
    return ok, detail


def check_durations(runs_list):
    bad, n, sources = [], 0, set()
    for runs in runs_list:
        for ranks in runs.values():
            for r in ranks:
                for x in r["comm"]["records"]:
                    if x["step"] < 0 or x["what"] not in ("grads", "params"):
                        continue
                    n += 1
                    sources.add(x["time_source"])
                    step_time = r["step_times_s"][x["step"]]
                    if x["time_source"] not in TIME_SOURCES or x["time_source"] == "none" \
                            or not 0 < x["time_s"] < step_time:
                        bad.append(f"{r['name']} rank {r['rank']} step {x['step']} {x['op']} "
                                   f"{x['unit']}: {x['time_s']:.3g} s ({x['time_source']}) vs step "
                                   f"{step_time:.3g} s")
    return not bad and n > 0, (f"{n} collectives, 0 < time_s < step time; "
                               f"source: {', '.join(sorted(sources))}" if not bad else "; ".join(bad[:3]))


def check_prefetch_accum(fp32_runs):
    facts, ok = [], True
    if 3 in fp32_runs:
        r = fp32_runs[3][0]
        units = results.unit_bytes(r)
        root_one = units["root"] + max(b for name, b in units.items() if name != "root")
        peak = max(x["memory"]["peak"].get("gathered_params", 0) for x in fp32_runs[3])
        good = all(x["zero3_prefetch"] for x in fp32_runs[3]) and peak > root_one
        ok &= good
        facts.append(f"prefetch: ZeRO-3's gathered peak {peak:,} B > root + largest block "
                     f"{root_one:,} B (what it holds without prefetch)")
    accum = {r["grad_accum"] for ranks in fp32_runs.values() for r in ranks}
    ok &= accum == {2}
    facts.append(f"accumulation: grad_accum {sorted(accum)} on every rank and stage")
    return ok, "; ".join(facts)


# --- the table ---------------------------------------------------------------------------------
def stage_table(rows, runs_by_name, device):
    cuda = device == "cuda"
    head = (f"{'stage':<34}{'states (B)':>15}{'formula':>15}{'bytes/step':>14}{'formula':>14}"
            f"{'peak alloc':>15}" + (f"{'reserved':>15}{'GPU used':>15}" if cuda else "")
            + f"{'coll. ms/step':>14}")
    lines, out = [head], {}
    for row, runs in rows:
        ranks = runs[row["stage"]]
        states = max(r["memory"]["model_states_total"] for r in ranks)
        formula = sum(ranks[0]["theory"]["model_states_padded"].values())
        alloc = [r["memory"].get("allocator") or {} for r in ranks]
        peak = max((a.get("peak_absolute") or 0) for a in alloc)
        dev = [a.get("device") or {} for a in alloc]
        reserved = max((d.get("max_reserved") or 0) for d in dev)
        used = max((d.get("device_used") or 0) for d in dev)
        traffic, t_formula = sum(row["measured"].values()), sum(row["formula"].values())
        coll = sum(t["seconds_per_step"] for t in row["timing"].values()) * 1e3
        lines.append(f"{row['name']:<34}{states:>15,}{formula:>15,.0f}{traffic:>14,.0f}{t_formula:>14,.0f}"
                     f"{peak:>15,}" + (f"{reserved:>15,}{used:>15,}" if cuda else "")
                     + f"{coll:>14.2f}")
        out[row["name"]] = {"model_states": states, "model_states_formula": formula,
                            "bytes_per_step": traffic, "bytes_per_step_formula": t_formula,
                            "allocator_peak": peak, "max_reserved": reserved, "device_used": used,
                            "allocator_source": alloc[0].get("source"), "timing": row["timing"]}
    return "\n".join(lines), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2)")
    ap.add_argument("--preset", default=None, help="notes run (default: gpt2 on CUDA, tiny on CPU)")
    ap.add_argument("--ref-preset", default=None, help="fp32 run and CPU reference (default: tiny, "
                    "or --preset when that is nano)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="global rows (rounded up)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    ap.add_argument("--runs", default=None, help="folder for the rank JSONs (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the summary JSON here")
    ap.add_argument("--verbose", action="store_true", help="echo the ranks' output")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps} must be >= 2 (timings skip the first step)")
    backend, device, nproc, note = plan(args.device, args.nproc)
    args.preset = args.preset or ("gpt2" if device == "cuda" else "tiny")
    ref_preset = args.ref_preset or ("nano" if args.preset == "nano" else "tiny")
    runs_dir = Path(args.runs or tempfile.mkdtemp(prefix="zerolab_gpu_check_"))
    print(f"gpu_check: {note}; notes preset {args.preset}, fp32 preset {ref_preset}, "
          f"{args.steps} steps, runs in {runs_dir}", flush=True)

    t0 = time.perf_counter()
    launches = []
    try:
        snapshot = {"cuda_snapshot": True} if device == "cuda" else {}
        runs, n1 = launch(runs_dir / "notes", "0,1,2,3", args, backend, device, nproc,
                          preset=args.preset, **snapshot)
        fp32_flags = dict(precision="fp32", max_grad_norm=0, zero3_prefetch=True,
                          zero1_grad_op="reduce_scatter", save_params=True, no_allocator=True)
        fp32, n2 = launch(runs_dir / "fp32", "0,1,2,3", args, backend, device, nproc,
                          preset=ref_preset, accum=2, **fp32_flags)
        if device == "cuda":
            ref_dir = runs_dir / "ref_cpu"
            ref, n3 = launch(ref_dir, "0", args, "gloo", "cpu", nproc, preset=ref_preset, accum=2,
                             **fp32_flags)
        else:
            ref_dir, ref, n3 = runs_dir / "fp32", {0: fp32[0]}, ""
        launches = [n for n in (n1, n2, n3) if n]
    except LaunchError as err:
        print(f"gpu_check: FAILED launch: {err}", file=sys.stderr)
        return 1

    checks = []

    def run_check(name, fn, *a):
        try:
            ok, detail = fn(*a)
        except (AssertionError, KeyError, ValueError, FileNotFoundError) as err:
            ok, detail = False, f"{type(err).__name__}: {err}"
        checks.append({"check": name, "ok": ok, "detail": detail})

    run_check("placement", check_placement, [runs, fp32], backend, device)
    run_check("memory", lambda: (True, f"{formula_checks.check_memory(runs) + formula_checks.check_memory(fp32)} "
                                       "values == formula at the padded Ψ"))
    rows = [(row, runs) for row in formula_checks.traffic_rows(runs)] + \
           [(row, fp32) for row in formula_checks.traffic_rows(fp32)]
    for row, _ in rows[len(runs):]:
        row["name"] += " fp32 A=2"
    run_check("traffic", lambda: (True, f"{formula_checks.check_traffic([r for r, _ in rows])} values == "
                                        "formula (ZeRO-1 all_reduce in bf16, reduce_scatter in fp32)"))
    run_check("numerics", check_numerics, runs_dir / "fp32", fp32, ref_dir, ref, args.steps)
    run_check("leak", check_leak, runs, device)
    run_check("durations", check_durations, [runs, fp32])
    run_check("prefetch+accumulation", check_prefetch_accum, fp32)

    table, stages = stage_table(rows, None, device)
    print("\n" + table)
    sources = sorted({s for r in (runs, fp32) for ranks in r.values() for x in ranks
                      for s in x["comm"].get("time_sources", [])})
    for s in sources:
        print(f"  collective times: {TIME_SOURCES.get(s, s)}")
    if device == "cuda":
        for key in ("max_allocated", "reserved", "device_used"):
            print(f"  {key}: {CUDA_FIGURES[key]}")
    snaps = sorted(str(p) for p in (runs_dir / "notes").glob("stage*/rank*_snapshot.json"))
    if device == "cuda":
        checks.append({"check": "cuda snapshot", "ok": bool(snaps),
                       "detail": f"{len(snaps)} allocator snapshot(s) under {runs_dir / 'notes'}"})
    print(f"\n{'check':<22}{'result':<8}detail")
    for c in checks:
        result = {True: "ok", False: "FAILED", None: "report"}[c["ok"]]
        print(f"{c['check']:<22}{result:<8}{c['detail']}")
    for n in launches:
        print(f"  note: {n}")
    failures = [c for c in checks if c["ok"] is False]
    summary = {"backend": backend, "device": device, "nproc": nproc, "note": note,
               "preset": args.preset, "ref_preset": ref_preset, "steps": args.steps,
               "stages": stages, "checks": checks, "launch_notes": launches,
               "time_sources": {s: TIME_SOURCES.get(s, s) for s in sources},
               "cuda_snapshots": snaps, "seconds": time.perf_counter() - t0, "ok": not failures}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1, default=float))
        print(f"wrote {args.out}")
    print(f"gpu_check: {'OK' if not failures else 'FAILED'} in {summary['seconds']:.0f} s "
          f"({len(checks) - len(failures)} of {len(checks)} checks passed or reported)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
