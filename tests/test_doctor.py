"""`zerolab doctor` passes on this machine, and a failing check prints its fix, never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerolab.course import doctor


@pytest.mark.timeout(200)
def test_doctor_passes_here():
    out = subprocess.run([sys.executable, "-m", "zerolab", "doctor"], capture_output=True,
                         text=True, timeout=180, cwd=Path(__file__).parent.parent)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    checks = lines[1:-1]
    assert len(checks) == len(doctor.CHECKS)
    assert all(line.startswith("OK   ") for line in checks), out.stdout
    assert any("gloo ranks started under torchrun and all_reduced" in line for line in checks)
    assert any("kernel 'python3' runs" in line for line in checks)
    assert "Traceback" not in out.stdout + out.stderr


def test_a_failing_check_prints_its_fix_not_a_traceback():
    printed = []
    ok = doctor.run([("python", doctor.check_python),
                     ("missing", lambda: doctor.check_module("zerolab_no_such_module")),
                     ("old", lambda: doctor.check_module("pytest", "999.0")),
                     ("crash", lambda: 1 / 0)], echo=printed.append)
    assert not ok
    assert printed[1].startswith("OK   Python")
    assert printed[2] == f"FIX  zerolab_no_such_module is not installed: {doctor.SETUP}"
    assert printed[3].startswith("FIX  pytest ") and "is older than 999.0" in printed[3]
    assert printed[4] == "FIX  crash: the check itself failed (ZeroDivisionError: division by zero)"
    assert "fix the lines marked FIX" in printed[-1]


def test_ranks_that_do_not_start_in_time_are_told_by_the_reason_not_torchrun_banner():
    """A launch that times out is reported by the launcher's reason ("timed out after ..."), never
    by torchrun's bare log header (`W1202 ... run.py:874]`, the line that preceded its banner)."""
    status, text = doctor.check_ranks(timeout=0.3)
    assert status is False and "timed out after 0.3 s" in text, text
    assert "run.py:" not in text and "zerolab train --stage 0" in text
