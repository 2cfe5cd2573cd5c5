"""course/commfloor.py replays a step's collectives alone: the same ops, sizes and order the step
issued, seen by torch's own c10d dispatch counter (on gloo a reduce_scatter runs as the in-place
all_reduce that zerolab's Comm and gloo's own reduce_scatter both issue). `zerolab bench` replays
every system's step (its `comm` column): the replay holds exactly the step's collectives."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks


def _replay_seen(rank, world_size):
    from zerolab.course.commfloor import replay
    from zerolab.course.demos.fsdp import CollectiveCounter
    schedule = [("all_reduce", 1000, torch.float32), ("all_gather", 998, torch.bfloat16),
                ("reduce_scatter", 64, torch.float32), ("broadcast", 7, torch.int64)]
    with CollectiveCounter() as counter:
        out = replay(schedule, repeats=2)
    try:
        replay([("all_to_all", 8, torch.float32)])
    except ValueError as e:
        refused = str(e)
    return out, [(r["op"], r["numel"], r["dtype"]) for r in counter.rows], refused


def test_replay_issues_the_schedule():
    for out, seen, refused in run_ranks(_replay_seen, 2):
        assert out["ops"] == 4 and out["cpu_s"] > 0 and out["wall_s"] > 0
        # 3 passes (one untimed + 2 repeats) of: the all_reduce, the all_gather of 998 elements
        # padded to whole chunks (996 = 2 x 498, as the strategies pad), the reduce_scatter as
        # an all_reduce, the broadcast; barriers are not collectives of the schedule
        once = [("all_reduce", 1000, "torch.float32"), ("all_gather", 998 - 998 % 2,
                                                         "torch.bfloat16"),
                ("all_reduce", 64, "torch.float32"), ("broadcast", 7, "torch.int64")]
        assert [s for s in seen if s[0] != "barrier"] == once * 3
        assert "'all_to_all'" in refused and "all_reduce" in refused


def test_bench_replays_each_step(tmp_path):
    """Each system's replay holds as many collectives as its step issued, and the comm column
    is 1 + (its replay's CPU seconds - torch DDP's) / torch DDP's step CPU seconds."""
    import json
    from test_bench import _bench
    stdout = _bench(tmp_path, "--systems", "zerolab-ddp,zerolab-zero3,torch-ddp,fsdp2-reshard")
    rows = {r["system"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    ddp = rows["torch-ddp"]
    for name, r in rows.items():
        assert r["comm_alone"]["ops"] == r["collectives_per_step"], name
        assert r["comm_floor"] == pytest.approx(
            1 + (r["comm_alone"]["cpu_s"] - ddp["comm_alone"]["cpu_s"]) / ddp["cpu_median_s"])
    assert rows["torch-ddp"]["comm_floor"] == 1.0
    assert "comm" in stdout.splitlines()[2] and "replayed alone" in " ".join(stdout.split())
