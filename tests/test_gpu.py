"""GPU checks: run only where a CUDA device is visible, skipped (not failed) elsewhere.

`labs/gpu_check.py` trains stages 0-3 on the GPU(s) (NCCL with one rank per GPU, or gloo ranks
sharing one GPU) and exits non-zero when a check fails: placement, memory and traffic vs the
formulas, numerics vs a CPU fp32 reference, leaks across stages, per-op collective durations,
prefetch and accumulation (see its docstring). Its CPU twin runs everywhere: test_gpu_check.py.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerolab.run.launch import cuda_device_count

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device visible")


@pytest.mark.timeout(600)
def test_gpu_check_measured_equals_formula(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "labs" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["device"] == "cuda", summary
    assert all(c["ok"] is not False for c in summary["checks"]), summary["checks"]
