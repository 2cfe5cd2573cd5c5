"""`--trace`: a real 2-rank run writes one Chrome trace per rank in which every collective of the
traced step appears as a labelled issue range and wait range (op, what, unit, phase), inside the
forward / backward / step ranges; the profiler's own clock agrees with the link emulator's
model: a blocking all_gather takes at least the model's time."""
from __future__ import annotations

import json
import subprocess
import sys

from zerolab import costmodel, trace
from zerolab.comm import Record


def test_trace_labels_every_collective(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "zerolab", "train", "--stage", "3", "--preset", "nano",
                           "--nproc", "2", "--steps", "2", "--trace", "--link-gbps", "0.01",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from zerolab.report import load_run
    assert len(load_run(out)[3]) == 2           # the trace files are not taken for rank JSONs
    for rank in (0, 1):
        events = json.loads((out / "stage3" / f"trace_rank{rank}.json").read_text())["traceEvents"]
        spans = {}
        for e in events:
            if e.get("ph") == "X":
                spans.setdefault(e["name"], []).append(e)
        assert {"forward", "backward", "step"} <= set(spans)
        ledger = json.loads((out / "stage3" / f"rank{rank}.json").read_text())["comm"]["records"]
        traced = [Record(**{k: r[k] for k in Record.__dataclass_fields__}) for r in ledger
                  if r["step"] == 0 and r["unit"] != "loss"]
        assert len(traced) >= 10
        for r in traced:
            name = trace.label(r)
            assert f"issue {name}" in spans and f"wait {name}" in spans, name
        # the root's forward all_gather is blocking: from its issue to the end of its wait
        # (the profiler's clock) is at least the model's time
        root = next(r for r in traced if r.op == "all_gather" and r.unit == "root")
        name = trace.label(root)
        issue, wait = spans[f"issue {name}"][0], spans[f"wait {name}"][0]
        took = (wait["ts"] + wait["dur"] - issue["ts"]) / 1e6
        model = costmodel.collective_time("all_gather", root.size_bytes, 2,
                                          costmodel.get_link(gbps=0.01))
        assert model > 5e-3 and took >= 0.98 * model, (took, model)
