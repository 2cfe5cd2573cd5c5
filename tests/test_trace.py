"""`--trace`: a real 2-rank run writes one Chrome trace per rank in which every collective of the
traced step appears as a labelled issue range and wait range (op, what, unit, phase), inside the
forward / backward / step ranges; `trace.spans` reads it back and `trace.check_labels` finds each
ledger record of the traced step there exactly once; where the collective ran (gloo's worker
thread) lies between its issue and the end of its wait; each block's compute is named, and the
profiler's own link from a backward op to the forward op that made it agrees with the block
ranges; the profiler's clock agrees with the link emulator's model: a blocking all_gather takes
at least the model's time."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_zerolab
from zerolab.timing import costmodel, trace
from zerolab.timing import hardware
from zerolab.comm import Record
from zerolab.model import GPT, get_config


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "run"
    proc = run_zerolab(["train", "--stages", "2,3", "--preset", "nano", "--nproc", "2",
                        "--steps", "2", "--trace", "--link-gbps", "0.01", "--out", str(out)],
                       timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _ledger(out, stage, rank):
    return json.loads((out / f"stage{stage}" / f"rank{rank}.json").read_text())


def test_trace_labels_every_collective(traced):
    from zerolab.course.results import load_run
    assert len(load_run(traced)[3]) == 2           # the trace files are not taken for rank JSONs
    for rank in (0, 1):
        path = traced / "stage3" / f"trace_rank{rank}.json"
        spans = {}
        for s in trace.spans(path):
            spans.setdefault(s.name, []).append(s)
        assert {"forward", "backward", "step"} <= set(spans)
        ledger = _ledger(traced, 3, rank)["comm"]["records"]
        traced_recs = [Record(**{k: r[k] for k in Record.__dataclass_fields__}) for r in ledger
                       if r["step"] == 0 and r["unit"] != "loss"]
        assert len(traced_recs) >= 10
        for r in traced_recs:
            name = trace.label(r)
            assert f"issue {name}" in spans and f"wait {name}" in spans, name
        # the root's forward all_gather is blocking: from its issue to the end of its wait
        # (the profiler's clock) is at least the model's time
        root = next(r for r in traced_recs if r.op == "all_gather" and r.unit == "root")
        name = trace.label(root)
        issue, wait = spans[f"issue {name}"][0], spans[f"wait {name}"][0]
        took = wait.end_s - issue.start_s
        model = costmodel.collective_time("all_gather", root.size_bytes, 2,
                                          hardware.get_link(gbps=0.01))
        assert model > 5e-3 and took >= 0.98 * model, (took, model)


@pytest.mark.parametrize("stage", [2, 3])
def test_spans_hold_every_ledger_record_of_the_traced_step_once(traced, stage):
    """The reader against the ledger: the records issued while the profiler recorded are those
    of the traced step but the loss all_reduce (issued after the profiler stopped); each has one
    issue and one wait range with its op / what / unit / phase, in issue order; each ran on
    gloo's worker after its issue started and before its wait ended; the blocks' compute ranges
    lie inside their phase's range, forward in order, backward in reverse, never overlapping;
    ZeRO-3 waits for a block's gather before the block's range starts."""
    for rank in (0, 1):
        path = traced / f"stage{stage}" / f"trace_rank{rank}.json"
        result = _ledger(traced, stage, rank)
        meta = trace.metadata(path)
        assert (meta["stage"], meta["rank"], meta["step"], meta["run_id"]) == (
            stage, rank, 0, result["run_id"])
        step = [r for r in result["comm"]["records"] if r["step"] == meta["step"]
                and r["unit"] != "loss"]
        recs = trace.traced_records(result, meta)
        assert [r["seq"] for r in recs] == [r["seq"] for r in step] and len(recs) >= 7
        counts = trace.check_labels(path, result)
        want = {}
        for r in step:
            want[r["op"]] = want.get(r["op"], 0) + 1
        assert {op: c["ledger"] for op, c in counts.items()} == want
        assert all(c["issue"] == c["wait"] == c["ledger"] for c in counts.values())

        spans = trace.spans(path)
        by = {k: [s for s in spans if s.kind == k] for k in trace.KINDS}
        assert [(s.op, s.what, s.unit, s.phase) for s in by["issue"]] == [
            (r["op"], r["what"], r["unit"], r["phase"]) for r in recs]
        assert len(by["run"]) == len(recs)              # gloo: one worker range per collective
        tol = 1e-3
        for run in by["run"]:
            issue = by["issue"][run.index]
            wait = next(s for s in by["wait"] if s.index == run.index)
            assert (run.op, run.unit) == (issue.op, issue.unit)
            assert issue.start_s - tol <= run.start_s and run.end_s <= wait.end_s + tol, run

        blocks = [u["name"] for u in result["units"] if u["name"] != "root"]
        phase = {s.name: s for s in by["phase"]}
        fwd = [s for s in by["block"] if s.phase == "forward"]
        bwd = [s for s in by["block"] if s.phase == "backward"]
        assert [s.unit for s in fwd] == blocks and [s.unit for s in bwd] == blocks[::-1]
        for s in fwd + bwd:
            ph = phase[s.phase]
            assert ph.start_s <= s.start_s and s.end_s <= ph.end_s, s
        for a, b in zip(bwd, bwd[1:]):
            assert a.end_s <= b.start_s, (a, b)
        if stage == 3:
            for s in fwd + bwd:
                gather = next(w for w in by["wait"] if w.op == "all_gather"
                              and w.unit == s.unit and w.phase == s.phase)
                assert gather.end_s <= s.start_s, (gather, s)


def test_unit_ranges_agree_with_the_profilers_backward_links(tmp_path):
    """Independent of zerolab's ranges: the profiler links every backward op to the forward op
    that recorded it (its "Sequence number"). Every backward op whose forward op ran inside
    "forward block.i" runs inside "backward block.i" (one process, no collectives)."""
    torch.manual_seed(0)
    cfg = get_config("nano", n_layer=3)
    model = GPT(cfg)
    ranges = trace.UnitRanges(model.zero_units())
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    path = tmp_path / "t.json"
    with trace.chrome_trace(path, torch.device("cpu")):
        with trace.phase("forward"):
            loss = model(x, x)
        with trace.phase("backward"):
            loss.backward()
    ranges.remove()
    blocks = [s for s in trace.spans(path) if s.kind == "block"]
    assert [(s.phase, s.unit) for s in blocks] == [
        *(("forward", f"block.{i}") for i in range(3)), *(("backward", f"block.{i}") for i in (2, 1, 0))]
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]

    def inside(e, s):
        return s.start_s <= e["ts"] / 1e6 and (e["ts"] + e["dur"]) / 1e6 <= s.end_s + 1e-6

    owner = {}                                  # sequence number -> block of its forward op
    for e in events:
        seq = e.get("args", {}).get("Sequence number")
        if seq is not None and not e["name"].startswith("autograd::"):
            for s in blocks[:3]:
                if inside(e, s):
                    owner[seq] = s.unit
    checked = 0
    for e in events:
        seq = e.get("args", {}).get("Sequence number")
        if e["name"].startswith("autograd::engine::evaluate_function") and seq in owner:
            s = next(b for b in blocks[3:] if b.unit == owner[seq])
            assert inside(e, s), (e["name"], owner[seq])
            checked += 1
    assert checked >= 3 * 15                    # every block's ~20 backward ops
    # every thread's ranges nest (what a trace viewer needs to draw one track per thread): the
    # block ranges, which overlap autograd's evaluate_function ranges, are on their own track
    by_thread = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append(e)
    assert {s.thread for s in blocks} == {trace.BLOCK_TID} and len(by_thread) >= 2
    for tid, es in by_thread.items():
        stack = []
        for e in sorted(es, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + 1e-3, \
                (tid, stack[-1]["name"], e["name"])
            stack.append(e)
    # removed: a later profiled pass has no block ranges
    with trace.chrome_trace(path, torch.device("cpu")):
        model(x, x).backward()
    assert not [s for s in trace.spans(path) if s.kind == "block"]


def test_parse_label_is_the_inverse_of_label():
    for op, what, unit, phase in [("all_gather", "params", "block.3", "forward"),
                                  ("reduce_scatter", "grads", "root", "backward"),
                                  ("all_reduce", "metric", "", "step"),
                                  ("broadcast", "", "block.0", "setup")]:
        r = Record(step=0, phase=phase, op=op, what=what, unit=unit, dtype="torch.float32",
                   numel=4, group_size=2, size_bytes=16, bytes=8.0)
        for kind in ("issue", "wait"):
            got = trace.parse_label(f"{kind} {trace.label(r)}")
            assert got == {"kind": kind, "op": op, "what": what, "unit": unit, "phase": phase}
    assert trace.parse_label("aten::mm") is None and trace.parse_label("forward") is None


def test_reader_refuses_what_is_not_a_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace=True"):
        trace.spans(tmp_path / "none.json")
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a Chrome trace"):
        trace.spans(tmp_path / "x.json")
    with pytest.raises(ValueError, match="no zerolab metadata"):
        trace.traced_records({"comm": {"records": []}}, {})
