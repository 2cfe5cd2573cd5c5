"""Every launch zerolab makes sets what torch offers to find a stuck NCCL collective (the desync
report, the flight recorder and where it is written), unless the user set them: read back from
the environment a launched process really gets."""
from __future__ import annotations

import json
import os
import sys

from zerolab.run import launch, preflight

SHOW = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ("
        "'TORCH_NCCL_DESYNC_DEBUG', 'TORCH_FR_BUFFER_SIZE', 'TORCH_NCCL_DUMP_ON_TIMEOUT', "
        "'TORCH_FR_DUMP_TEMP_FILE')}))")


def test_a_launch_sets_the_nccl_desync_report_and_flight_recorder(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DESYNC_DEBUG", "0")          # the user's choice stays
    out = launch.run([sys.executable, "-c", SHOW], timeout=60, echo=lambda _: None)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["TORCH_NCCL_DESYNC_DEBUG"] == "0"
    assert int(got["TORCH_FR_BUFFER_SIZE"]) >= 1000
    assert got["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    folder = os.path.dirname(got["TORCH_FR_DUMP_TEMP_FILE"])
    assert os.path.isdir(folder) and folder == preflight.TRACE_DIR   # exists, outlives the run
