"""--nics-per-node on the command line: `zerolab time` / `whatif` pass it to the cost model's
Topology, `zerolab train` / `compare` to the ranks' emulated tiers and into the result JSON; a
bad value, or the flag without --ranks-per-node, is refused in one line."""
from __future__ import annotations

import json
import re

import pytest

from conftest import run_zerolab
from zerolab import cli
from zerolab.run import knobs, options
from zerolab.timing import costmodel as cm
from zerolab.timing import hardware as hw

TIME = ["time", "--world-size", "64", "--ranks-per-node", "8", "--intra", "nvlink4", "--inter", "ib-ndr"]


def _row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if re.match(rf"{re.escape(name)}\s+\d", line))


def _ms(row: str, op: str) -> str:
    return re.search(rf"{op} (\S+) \[inter\]", row).group(1)


def _api(nics):
    """DDP's all_reduce and ZeRO-3 +prefetch's all_gather seconds from the Python API (comm
    does not depend on the compute shape, so the units need no d_model)."""
    topo = hw.get_topology(8, "nvlink4", "ib-ndr", 64, nics_per_node=nics)
    units = cm.uniform_units(7.5e9, 32, 4096, hw.get_device("h100"), 0.4)
    ddp = cm.step_time(0, units, 64, topo, overlap=True).by_op_tier()["all_reduce"]["inter"]
    z3 = cm.step_time(3, units, 64, topo, overlap=True, prefetch=True).by_op_tier()["all_gather"]["inter"]
    return ddp, z3


@pytest.mark.parametrize("nics", [1, 8, None])
def test_time_uses_the_nics_given(nics, capsys):
    assert cli.main(TIME + ([] if nics is None else ["--nics-per-node", str(nics)])) == 0
    out = capsys.readouterr().out
    c = 8 if nics is None else nics
    assert f"8 node(s) x 8 ranks per node, {c} NIC{'s' if c > 1 else ''} per node" in out
    ddp, z3 = _api(nics)
    assert _ms(_row(out, "DDP"), "all_reduce") == f"{ddp * 1e3:.4g}"
    assert _ms(_row(out, "ZeRO-3 +prefetch"), "all_gather") == f"{z3 * 1e3:.4g}"
    # by hand: 32 bucket all_reduces of S = 2Ψ/32 on a ring of 64 ranks in 8 nodes, NCCL's
    # latency 2·7·α_inter + 2·56·α_intra (src/graph/tuning.cc) plus 2·63/64·S over one 50 GB/s
    # NIC a node (c = 1), or a node's 8 NICs together
    S = 2 * 7.5e9 / 32
    assert ddp == pytest.approx(32 * (14 * 5e-6 + 112 * 2e-6 + 2 * 63 / 64 * S / (c * 50e9)), rel=1e-9)


def test_whatif_takes_the_nics(capsys):
    assert cli.main(["whatif", "--preset", "nano", "--world-size", "8", "--ranks-per-node", "4",
                     "--nics-per-node", "1", "--stage", "0"]) == 0
    assert "1 NIC per node" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (TIME + ["--nics-per-node", "0"], ["--nics-per-node", "'0'", "1 .. 1024"]),
    (TIME + ["--nics-per-node", "2.5"], ["--nics-per-node", "'2.5'", "1 .. 1024"]),
    (["time", "--nics-per-node", "4"], ["--nics-per-node needs --ranks-per-node"]),
    (["whatif", "--preset", "nano", "--nics-per-node", "4"], ["--nics-per-node needs --ranks-per-node"]),
])
def test_time_refuses_bad_nics_in_one_line(argv, words, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as stop:          # argparse refused the value (its type)
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


TIERS = ["--ranks-per-node", "2", "--intra", "1@20", "--inter", "0.1@200"]


@pytest.mark.parametrize("extra, words", [
    (TIERS + ["--nics-per-node", "0"], ["--nics-per-node", "'0'", "1 .. 1024"]),
    (["--nics-per-node", "2"], ["--nics-per-node needs --ranks-per-node"]),
    (["--ranks-per-node", "2", "--nics-per-node", "2"], ["needs --intra and --inter"]),
])
def test_train_refuses_bad_nics_before_any_rank_starts(extra, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("launched"))
    try:
        code = cli.main(["train", "--nproc", "4", "--preset", "nano", "--out", str(tmp_path / "o"),
                         *extra])
    except SystemExit as stop:          # argparse refused the value (its range)
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and all(w in err[0] for w in words), err
    assert not (tmp_path / "o").exists()


def test_the_nics_reach_the_ranks():
    args = options.parser("train").parse_args(["--nproc", "4", *TIERS, "--nics-per-node", "1"])
    ranks = options.parse("ranks", options.rank_argv(args, backend="gloo", device="cpu"))
    assert ranks.nics_per_node == 1
    topo = knobs.tiers(ranks, 4)
    assert topo.nics == 1 and topo.nic_share == 1 / 2
    assert options.parse("ranks", []).nics_per_node is None


@pytest.mark.timeout(150)
def test_a_run_records_its_nics(tmp_path):
    out = tmp_path / "run"
    res = run_zerolab(["train", "--nproc", "2", "--preset", "nano", "--steps", "1", "--stage", "0",
                       "--ranks-per-node", "1", "--intra", "nvlink4", "--inter", "ib-ndr",
                       "--nics-per-node", "1", "--out", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads((out / "stage0" / "rank0.json").read_text())
    assert r["tiers"] == {"ranks_per_node": 1, "intra": "nvlink4", "inter": "ib-ndr",
                          "nics_per_node": 1}
