#!/usr/bin/env bash
# One GPU session's checks, in one prepared command (the device tool's budget is 15 minutes):
#   1. labs/gpu_check.py: stages 0-3 on the GPU vs the formulas and a CPU fp32 reference;
#   2. zerolab bench --preset small: the CPU bench on the GPU machine's idle 16 cores (a quiet host,
#      where this repo's CI machine has 2 shared cores);
#   3. the offload check on CUDA (one rank): host AdamW vs the GPU's, real copies.
# Everything lands under $OUT (default runs/gpu): env.txt, the logs, gpu_check.json, and the rank
# JSONs, bench.json(s) and allocator snapshots as one tarball (the tool returns <= 8 files).
# BENCH_RUNS=3 repeats the bench (median and spread over runs).
#
#     OUT=runs/gpu BENCH_RUNS=3 bash labs/gpu_session.sh     # on a machine with a GPU, repo root
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RUNS=$(mktemp -d /tmp/zerolab_gpu_runs.XXXX)
{
  date -u; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
} 2>&1 | tee "$OUT/env.txt"

echo "== gpu_check"; t=$SECONDS
timeout 330 python3 labs/gpu_check.py --runs "$RUNS" --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check: $((SECONDS - t)) s"

for i in $(seq "${BENCH_RUNS:-1}"); do
  echo "== bench small (CPU, gloo, 2 ranks) run $i"; t=$SECONDS
  timeout 150 python3 -m zerolab bench --preset small --rounds 11 --out "$RUNS/bench$i" --overwrite \
    2>&1 | tee -a "$OUT/bench.log"
  echo "bench: $((SECONDS - t)) s"
done

echo "== offload check on CUDA (1 rank, gpt2)"; t=$SECONDS
timeout 100 python3 -m zerolab.course.offloadcheck --device cuda --nproc 1 --preset gpt2 --rounds 10 \
  --warmup 2 --out "$RUNS/offload" 2>&1 | tee "$OUT/offload.log"
echo "offload: $((SECONDS - t)) s"

tar czf "$OUT/runs.tgz" -C "$RUNS" . 2>/dev/null
ls -la "$OUT"
