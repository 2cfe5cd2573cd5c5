"""The allocator cross-check (MemTracker on CPU) runs with every training option that calls
forward more than once per step or recomputes it: gradient accumulation (MemTracker refused a
second forward of the same module: "multiple iterative calls", so `zerolab train --grad-accum 2`
failed on CPU), and gradient accumulation with activation checkpointing (a forward recomputed
inside backward, between two forwards). The independent property checked: activation
checkpointing keeps fewer activation bytes alive at the peak than the same two micro-steps
without it (MemTracker's ACT), on every rank."""
from __future__ import annotations

import json

import pytest

from conftest import run_zerolab


def _activations(out, stage):
    ranks = [json.loads((out / f"stage{stage}" / f"rank{r}.json").read_text()) for r in range(2)]
    allocator = [r["memory"]["allocator"] for r in ranks]
    assert all(a["source"] == "MemTracker" for a in allocator)
    return [a["by_type"]["ACT"] for a in allocator]


@pytest.mark.timeout(300)
def test_allocator_cross_check_with_micro_steps(tmp_path):
    common = ["train", "--stage", "3", "--nproc", "2", "--preset", "nano", "--steps", "1",
              "--batch-size", "16", "--timeout", "120"]
    acts = {}
    for name, extra in (("2 micro-steps", ["--grad-accum", "2"]),
                        ("2 micro-steps, checkpointed", ["--grad-accum", "2",
                                                         "--activation-checkpointing"])):
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        proc = run_zerolab([*common, *extra, "--out", str(out)])
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        acts[name] = _activations(out, 3)
    for rank in range(2):
        assert 0 < acts["2 micro-steps, checkpointed"][rank] < acts["2 micro-steps"][rank], acts
