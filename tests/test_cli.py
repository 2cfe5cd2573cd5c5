"""The `zerolab` command and the launcher: argument checks before any rank starts, real torchrun
runs (preset nano, 2 steps; few of them, each costs seconds), failure and determinism."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from conftest import run_zerolab as run_cmd
from zerolab import cli, theory
from zerolab.run.launch import LaunchError, resolve


def processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes that contain every needle (our own run only)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if state != "Z" and all(n in cmd for n in needles):
            found.append(f"{pid}: {cmd}")
    return found


def load_rank0(out: Path, stage: int) -> dict:
    return json.loads((out / f"stage{stage}" / "rank0.json").read_text())


# --- bad input: one line on stderr, exit 2, no rank started ------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a launch was attempted for bad input")
    monkeypatch.setattr("zerolab.run.launch.run", refuse)


BAD_INPUTS = {     # extra argv, substrings the one error line must contain ({tmp}: tmp_path)
    "stage 4": (["--stage", "4"], ["4"]),
    "preset huge": (["--preset", "huge"], ["huge"]),
    "batch 6 on 4 ranks": (["--batch-size", "6", "--nproc", "4"], ["6", "4"]),
    "missing data": (["--data", "{tmp}/missing.txt"], ["{tmp}/missing.txt"]),
    "empty data": (["--data", "{tmp}/empty.txt"], ["{tmp}/empty.txt", "empty"]),
    "data shorter than a window": (["--data", "{tmp}/short.txt"], ["{tmp}/short.txt", "32"]),
}


@pytest.mark.parametrize("argv, words", [
    (["train", "--stgae", "3"], ["--stgae", "did you mean --stage?"]),       # a misspelled flag
    (["memory", "--params", "7.5bn"], ["--params", "'7.5bn'"]),              # a value of a wrong type
    (["tme"], ["'tme'", "'time'"]),                                          # a misspelled command
    (["whatif", "--params", "7.5e9"],                                        # another command's flag
     ["zerolab whatif", "--params is an option of zerolab memory / time"]),
    (["whatif", "--world-sise", "8"], ["zerolab whatif", "did you mean --world-size?"]),  # own flag
])
def test_a_bad_command_line_is_one_line_naming_it(argv, words, capsys):
    """argparse's errors too: one line naming the bad flag or value (the closest flag for a
    misspelled one), exit 2, no usage block."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_before_any_rank_starts(case, tmp_path, capsys, no_launch):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("x" * 20)       # nano's context window is 32 tokens
    args, names = ([a.format(tmp=tmp_path) for a in x] for x in BAD_INPUTS[case])
    base = ["train", "--nproc", "2", "--preset", "nano", "--steps", "2",
            "--out", str(tmp_path / "o")]
    code = cli.main(base + args)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1, captured.err
    for name in names:
        assert name in lines[0]
    assert captured.out == ""
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(60)
def test_bad_stage_from_the_real_command_line(tmp_path):
    res = run_cmd(["train", "--stage", "4", "--preset", "nano", "--out", str(tmp_path / "o")])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "stage 4" in lines[0], res.stderr
    assert not (tmp_path / "o").exists()


def test_resolve_refuses_more_nccl_ranks_than_gpus():
    with pytest.raises(ValueError) as err:
        resolve(4, "nccl", "cuda", gpus=1)
    assert "4" in str(err.value) and "1 GPU" in str(err.value)
    assert resolve(2, "gloo", "cpu", gpus=0) == ("gloo", "cpu")


# --- the memory table --------------------------------------------------------------------------
def test_memory_prints_the_paper_table(capsys):
    assert cli.main(["memory", "--params", "7.5e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    psi, n = 7.5e9, 64
    expect = {"DDP": 16 * psi, "ZeRO-1": 4 * psi + 12 * psi / n, "ZeRO-2": 2 * psi + 14 * psi / n,
              "ZeRO-3": 16 * psi / n}
    rows = {}
    for line in out.splitlines():           # the memory table comes first, then traffic
        if line.split() and line.split()[0] in expect:
            rows.setdefault(line.split()[0], line.split())
    for name, total in expect.items():
        assert float(rows[name][-2]) == pytest.approx(total / 1e9, rel=1e-3), name
    assert "120" in rows["DDP"] and "31.41" in rows["ZeRO-1"]
    assert "16.64" in rows["ZeRO-2"] and "1.875" in rows["ZeRO-3"]


# --- real runs -----------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_world_size_one_trains(tmp_path):
    out = tmp_path / "one"
    res = run_cmd(["train", "--nproc", "1", "--stage", "0,3", "--preset", "nano", "--steps", "2",
                   "--out", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    for stage in (0, 3):
        r = load_rank0(out, stage)
        assert r["world_size"] == 1 and len(r["losses"]) == 2
        assert all(math.isfinite(x) for x in r["losses"])
        padded = sum(u["padded_numel"] for u in r["units"])
        assert padded == r["num_params"]            # N = 1: no padding
        assert r["memory"]["model_states"] == theory.model_state_bytes(padded, 1, stage)


@pytest.mark.timeout(150)
def test_crashing_rank_fails_the_run_with_its_traceback_and_leaves_nothing(tmp_path):
    from zerolab import nb
    out = tmp_path / "crash"
    with pytest.raises(LaunchError) as err:
        nb.launch(stages="0", nproc=2, preset="nano", steps=2, out=str(out), crash_rank=1,
                  echo=None, timeout=120)
    assert "rank 1 crashed on purpose" in str(err.value)
    assert "exited with code" in str(err.value)
    assert processes_mentioning("zerolab.run.train", str(out)) == []


COMPARE = ["compare", "--nproc", "2", "--preset", "nano", "--steps", "2"]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    """`zerolab compare` once: (its out folder, its argv, compare.json rows, rank-0 losses)."""
    out = tmp_path_factory.mktemp("compare")
    args = COMPARE + ["--out", str(out)]
    res = run_cmd(args)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads((out / "compare.json").read_text())["rows"]
    return out, args, rows, {s: load_rank0(out, s)["losses"] for s in (0, 1, 2, 3)}


@pytest.mark.timeout(150)
def test_compare_writes_measured_equal_to_formula(compare_run):
    out, _, rows, _ = compare_run
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["world_size"] == 2
        assert r["model_states"] == r["theory_states"], r["name"]
        assert r["traffic"] == pytest.approx(r["theory_traffic"], rel=1e-12), r["name"]
        # the formula side is theory's, at the padded Ψ the ranks reported
        units = load_rank0(out, r["stage"])["units"]
        padded = sum(u["padded_numel"] for u in units)
        assert r["theory_states"] == theory.model_state_total(padded, 2, r["stage"])
    assert (out / "compare.png").stat().st_size > 0


@pytest.mark.timeout(150)
def test_same_command_twice_gives_identical_losses_and_keeps_the_first(compare_run):
    """The README's main command typed twice, as it is (no --overwrite): it runs, the first
    run moves to OUT.1 whole (one line says so) and the two runs' losses are bit-identical."""
    out, args, _, first = compare_run
    before = json.loads((out / "run.json").read_text())["run_id"]
    res = run_cmd(args)                         # the very same command, same output folder
    assert res.returncode == 0, res.stdout + res.stderr
    kept = out.parent / f"{out.name}.1"
    said = [ln for ln in res.stdout.splitlines() if "held run" in ln]
    assert len(said) == 1 and f"held run {before} (compare, ok); it is now in {kept}" in said[0]
    assert json.loads((kept / "compare.json").read_text())["run_id"] == before
    assert {s: load_rank0(kept, s)["losses"] for s in (0, 1, 2, 3)} == first
    assert json.loads((out / "compare.json").read_text())["run_id"] != before
    second = {s: load_rank0(out, s)["losses"] for s in (0, 1, 2, 3)}
    assert second == first                      # bit-identical floats, not approx
    assert len(first[0]) == 2 and first[0][0] != first[0][1]


def test_params_take_the_counts_people_write(capsys):
    """--params 70B, 70,000,000,000 and 7e10 are the same Ψ (as notebook 02's calculator takes)."""
    outs = []
    for text in ("70B", "70,000,000,000", "7e10", "0.07T"):
        assert cli.main(["memory", "--params", text, "--world-size", "64"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] == outs[3] and "70" in outs[0]
