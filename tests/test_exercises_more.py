"""Exercises (f)-(j): the mesh groups, the bucket / prefetch predictions, the ring time, and the
optional track's whole strategy classes (zerolab.course.exercises.more, .track).

Each is graded with a correct solution (zerolab's own functions for (f)-(h); the reference
classes of tests/exercise_solutions/ for the track) that must pass, and with wrong solutions
(tests/exercise_solutions/wrong/) that must fail with a message naming the mistake. The mesh
layout zerolab grades against is checked against torch's own `init_device_mesh`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerolab import theory
from zerolab.course.exercises import EXERCISES, checker, track

ROOT = Path(__file__).parent.parent
SOLUTIONS = Path(__file__).parent / "exercise_solutions"
WRONG = SOLUTIONS / "wrong"
MORE = "zerolab.course.exercises.more"


def check(name, impl, **kw):
    r = checker.run_check(name, str(impl), **kw)
    assert "Traceback" not in r.text()
    return r


def test_mesh_groups_are_torchs_device_mesh():
    """theory.mesh_groups (the reference of exercise (f)) is the layout init_device_mesh builds:
    asked on torch's fake process group for every rank of (dp, tp) = (4, 2), (2, 4), (2, 2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for world, inner in ((8, 2), (8, 4), (4, 2)):
        rows, columns = theory.mesh_groups(world, inner)
        for rank in range(world):
            dist.init_process_group("fake", store=fake.FakeStore(), rank=rank, world_size=world)
            try:
                mesh = init_device_mesh("cpu", (world // inner, inner), mesh_dim_names=("dp", "tp"))
                tp = dist.get_process_group_ranks(mesh.get_group("tp"))
                dp = dist.get_process_group_ranks(mesh.get_group("dp"))
            finally:
                dist.destroy_process_group()
            assert tp in rows and rank in tp, (world, inner, rank, tp)
            assert dp in columns and rank in dp, (world, inner, rank, dp)
    assert theory.mesh_groups(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    for bad in (3, 0, 2.0, True):
        with pytest.raises(ValueError, match="do not split"):
            theory.mesh_groups(8, bad)


def test_groups_reference_passes_and_wrong_layouts_name_the_property(tmp_path):
    r = check("groups", MORE)
    assert r.ok and "theory.mesh_groups" in r.lines[0] and r.seconds < 5, r.text()
    wrong = {"groups_tp_strided": "tp_dp_groups(8, 2): TP group [0, 4] spans 2 nodes of 2 ranks",
             "groups_dp_blocks": "DP group [0, 1, 2, 3] and TP group [0, 1] share 2 ranks",
             "groups_hsdp_swapped": "hsdp_groups(8, 2): shard group [0, 2, 4, 6] has 4 ranks; "
                                    "a shard group has 2"}
    for stem, says in wrong.items():
        r = check("groups", WRONG / f"{stem}.py")
        assert not r.ok and says in r.lines[0], (stem, r.text())
    # right groups, but no ValueError; and groups mixing the slots of the TP groups
    impl = tmp_path / "my_groups.py"
    impl.write_text("def tp_dp_groups(w, t):\n"
                    "    return ([list(range(s, s + t)) for s in range(0, w, t)],\n"
                    "            [list(range(c, w, t)) for c in range(t)])\n"
                    "hsdp_groups = tp_dp_groups\n")
    r = check("groups", impl)
    assert not r.ok and "tp_dp_groups(8, 3) returned" in r.lines[0], r.text()
    assert "expected ValueError" in r.lines[0]
    impl.write_text("def tp_dp_groups(w, t):\n    return [[0, 1], [2, 3]], [[0, 3], [1, 2]]\n"
                    "hsdp_groups = tp_dp_groups\n")
    r = check("groups", impl)
    assert "tp_dp_groups(8, 2): TP group [0, 1] has" not in r.lines[0]
    assert not r.ok and "rank 4 is in no TP group" in r.lines[0], r.text()


@pytest.mark.timeout(180)
def test_buckets_prefetch_reference_passes_and_wrong_predictions_fail():
    r = check("buckets_prefetch", MORE)
    assert r.ok, r.text()
    assert "bucket_mb=0.2: 2 bucket(s) [[0, 1, 2, 3], [4, 5]], measured 3 all_reduces" \
        in r.text()
    assert "prefetch=-1: peak" in r.text()
    wrong = {"buckets_prefetch_mb": "bucket_cap_mb counts MiB of 2**20 bytes",
             "buckets_prefetch_no_root": "the root unit (embeddings, final LayerNorm) stays "
                                         "gathered",
             "buckets_prefetch_depth": "depth p gathers p blocks AHEAD of the one that runs"}
    for stem, says in wrong.items():
        r = check("buckets_prefetch", WRONG / f"{stem}.py")     # measured once, above
        assert not r.ok and says in r.lines[0], (stem, r.text())
    assert "measured a gathered-weights peak of" in r.lines[0] and r.seconds < 5


@pytest.mark.timeout(180)
def test_timing_reference_passes_on_the_model_and_the_emulated_link():
    r = check("timing", MORE)
    assert r.ok, r.text()
    assert "within 25% + 10 ms" in r.lines[0] and len(r.lines) == 5
    wrong = {"timing_no_latency": "add the latency: α per ring step",
             "timing_allreduce_once": "all_reduce is a reduce_scatter then an all_gather"}
    for stem, says in wrong.items():
        r = check("timing", WRONG / f"{stem}.py")
        assert not r.ok and says in r.lines[0] and r.seconds < 5, (stem, r.text())


TRACK = [("strategy_ddp", SOLUTIONS / "strategy_ddp.py", None),
         ("strategy_ddp", WRONG / "strategy_ddp_summed.py",
          "gradient norm: global gradient norm"),
         ("strategy_ddp", WRONG / "strategy_ddp_in_finish.py",
          "overlap: 6 of 6 all_reduces were issued after loss.backward() returned"),
         ("strategy_ddp", WRONG / "strategy_ddp_per_param.py", "buckets: "),
         ("strategy_ddp", WRONG / "strategy_ddp_blocking.py",
          "the all_reduces do not overlap backward"),
         ("strategy_zero1", SOLUTIONS / "strategy_zero1.py", None),
         ("strategy_zero1", WRONG / "strategy_zero1_no_gather.py",
          "bytes sent: the all_gathers carried 0 elements"),
         ("strategy_zero1", WRONG / "strategy_zero1_full_state.py",
          "bytes held: your optimizer keeps"),
         ("strategy_zero1", WRONG / "strategy_zero1_per_param.py", "too many collectives")]


@pytest.mark.timeout(240)
def test_track_reference_classes_pass_and_wrong_ones_fail_on_the_right_check():
    results = track.grade_many([(name, str(impl)) for name, impl, _ in TRACK], nproc=3)
    for (name, impl, says), (ok, lines) in zip(TRACK, results):
        text = "\n".join(lines)
        if says is None:
            assert ok, (impl.name, text)
            assert "equals single-process torch AdamW" in lines[0]
        else:
            assert not ok and says in text, (impl.name, text)
    ddp, zero1 = results[0][1], results[5][1]
    assert "all issued during backward" in ddp[1] and "theory.traffic_bytes" in ddp[1]
    assert "with overlap" in ddp[2] and "the check asks <=" in ddp[2]
    assert "ZeRO-1's 12Ψ/N" in zero1[1] and "one all_gather per parameter group" in zero1[2]
    summed = "\n".join(results[1][1])
    assert "summed, not averaged" in summed and "ranks 0, 1, 2" in summed


@pytest.mark.timeout(120)
def test_track_exception_names_rank_file_and_line(tmp_path):
    impl = tmp_path / "my_strategy_ddp.py"
    impl.write_text("class BucketedDDP:\n"
                    "    def __init__(self, model, comm, bucket_cap_mb):\n"
                    "        for p in model.parameters():\n"
                    "            p.register_post_accumulate_grad_hook(self.ready)\n\n"
                    "    def ready(self, p):\n"
                    "        p.grad.no_such_method()\n\n"
                    "    def finish(self):\n"
                    "        pass\n")
    r = check("strategy_ddp", impl, nproc=2, timeout=60)
    assert not r.ok and r.lines[0].startswith("rank ")
    assert "your ready (my_strategy_ddp.py line 7)" in r.lines[0], r.text()
    assert "AttributeError" in r.lines[0]


def test_new_exercises_are_listed_with_skeletons_hints_and_notebooks():
    out = subprocess.run([sys.executable, "-m", "zerolab", "check", "--list"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for name, letter in (("groups", "f"), ("buckets_prefetch", "g"), ("timing", "h"),
                         ("strategy_ddp", "i"), ("strategy_zero1", "j")):
        ex = EXERCISES[name]
        assert f"{name} " in out.stdout and f"({letter})" in out.stdout
        assert ex.grader and ex.skeleton.exists() and len(ex.hints) >= 3
        assert list((ROOT / "notebooks" / "exercises").glob(f"{letter}_{name}.ipynb"))
        r = checker.run_check(name, str(ex.skeleton))          # blank: one line, no ranks
        assert not r.ok and "NotImplementedError (the blank skeleton)" in r.lines[0]
