"""zerolab fit: the predicted peak against a real run's, the anchors' formulas against their
sources, the advice of a refusal, and one line for each bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch

from zerolab import theory
from zerolab.cli.commands import main
from zerolab.course import fitanchors, fitcheck
from zerolab.model import GPT, get_config
from zerolab.run import fit, fitreport, fittarget, options


# --- predicted vs measured (the benchmark's subset) ---------------------------------------------
@pytest.mark.timeout(400)
def test_predicted_peak_within_3_percent_of_a_real_run(tmp_path):
    """nano on 2 gloo ranks, every block checkpointed, 2 rows per rank: rank 0's MemTracker peak
    and memory-meter peak of the last step (the run's JSON) against zerolab fit's simulation."""
    argv, runs = fitcheck.measured_gpt("nano", 2, 2, True, tmp_path / "run")
    pred = fitcheck.predicted(argv, range(4), 2, 2)
    for s in range(4):
        mem = runs[s]["memory"]
        assert abs(pred[s]["peak"] / mem["allocator"]["peak_absolute"] - 1) < fitcheck.TOLERANCE
        assert abs(pred[s]["meter_peak"] / mem["peak_total"] - 1) < fitcheck.TOLERANCE
        # the prediction's model states are the formula's, and the real run holds them
        assert pred[s]["model_states"] == runs[s]["theory"]["model_states_padded"]


@pytest.mark.timeout(300)
def test_a_model_with_tied_and_frozen_weights_is_predicted_too(tmp_path):
    spec = "zerolab.course.fitmodels:tied_frozen"
    runs = fitcheck.measured_model(spec, 2, 2, tmp_path, stages=(0, 3))
    pred = fitcheck.predicted(["--model", spec, "--steps", "2", "--batch-size", "4"], (0, 3), 2, 2)
    for s in (0, 3):
        assert abs(pred[s]["peak"] / runs[s]["peak"] - 1) < fitcheck.TOLERANCE, (s, pred[s], runs[s])


def _args(argv):
    return fitcheck.fit_args(argv)


def test_activations_grow_with_rows_and_checkpointing_keeps_fewer():
    """Counted activations are linear in the rows (to 0.5 %: the batch index tensors and the
    checkpoint frames do not scale); checkpointing every block keeps less than
    every 2nd block, which keeps less than none."""
    acts = {}
    for every in (None, 2, 1):
        for rows in (1, 2, 4):
            a = _args(["--preset", "tiny", "--steps", "1", "--batch-size", str(rows), "--nproc", "1"])
            n, _, target = fitreport.check_args(a)
            acts[every, rows] = fit.simulate(a, 0, 1, rows, target, every=every)["activations"]
    for every in (None, 2, 1):
        assert acts[every, 4] - acts[every, 2] == pytest.approx(
            2 * (acts[every, 2] - acts[every, 1]), rel=5e-3)
    assert acts[1, 4] < acts[2, 4] < acts[None, 4]


def test_counted_activations_per_layer_match_korthikanti_without_dropout_and_s_squared():
    """gpt2's shape: eq. 1 of Korthikanti et al. 2022 without its dropout masks and with a flash
    kernel (32·s·b·h + 4·a·s·b) within 1 % of the bytes one block keeps; eq. 1 as printed is
    3.5x that (its 5·a·s/h term is the s x s scores a flash kernel never keeps)."""
    cfg = get_config("gpt2")
    counted = fitanchors.counted_per_layer("gpt2", 1)
    assert abs(counted / fitanchors.no_dropout_flash(cfg, 1) - 1) < 0.01
    assert fitanchors.korthikanti(cfg, 1) / counted > 3


def test_deepspeed_estimators_re_derived_against_the_formulas():
    """DeepSpeed's ZeRO-3 no-offload estimate 4·P_max + 18Ψ/N is the course's ZeRO-3 states with
    fp32 gradients (2 + 4 + 12 bytes per parameter over N) plus four bytes per parameter of the
    largest module; its ZeRO-2 4Ψ + 16Ψ/N is the course's ZeRO-2 with fp32 gradients
    (2Ψ + 16Ψ/N) plus 2Ψ: a whole 16-bit gradient buffer besides the shards."""
    with torch.device("meta"):
        model = GPT(get_config("gpt2"))
    psi = sum(p.numel() for p in model.parameters())
    big = fitanchors.largest_layer_params(model)
    assert big == 768 * 3072 + 3072      # c_fc: width x 4·width, and its bias
    n = 64
    ours3 = theory.model_state_total(psi, n, 3, "bf16", grad_dtype="fp32")
    assert fitanchors.deepspeed_zero3(psi, big, n) - 4 * big == pytest.approx(ours3, abs=1)
    ours2 = theory.model_state_total(psi, n, 2, "bf16", grad_dtype="fp32")
    assert fitanchors.deepspeed_zero2(psi, n) == pytest.approx(ours2 + 2 * psi, abs=2)


# --- advice that helps --------------------------------------------------------------------------
def _refusal(argv, world, available):
    args = options.parser("train").parse_args(argv)
    options.check(args, world)
    with pytest.raises(ValueError) as err:
        fit.check_fits(args, world, "cpu", available=available)
    return args, str(err.value)


@pytest.mark.timeout(300)
def test_1b_on_24_gb_is_not_told_to_lower_a_batch_of_one_row():
    """The model states alone do not fit, the batch is one row a rank: the refusal names options
    that do fit (each checked by a simulation), never a smaller batch."""
    args, line = _refusal(["--preset", "1b", "--nproc", "4", "--steps", "1", "--batch-size", "4"],
                          4, 24e9)
    assert "\n" not in line and "--batch-size 4:" not in line
    assert "--grad-accum" not in line and "lower --batch-size" not in line
    assert "--preset gpt2" in line or "--stage 3" in line
    # following the advice fits: the smaller preset's predicted peak x 4 ranks is below 24 GB
    small = argparse_ns(args, preset="gpt2")
    peak = fit.simulate(small, 0, 4, 1, fit.target_of(small))["peak"]
    assert 4 * peak < 24e9


def argparse_ns(args, **changes):
    import argparse
    return argparse.Namespace(**{**vars(args), **changes})


@pytest.mark.timeout(300)
def test_too_many_rows_is_told_the_micro_steps_that_fit():
    """small at 64 rows a rank on a budget where 8 rows fit: the advice is more micro-steps with
    the same global batch, and that number of rows does fit."""
    argv = ["--preset", "small", "--nproc", "1", "--steps", "2", "--batch-size", "64"]
    a = options.parser("train").parse_args(argv)
    options.check(a, 1)
    target = fit.target_of(a)
    eight = fit.simulate(a, 0, 1, 8, target)["peak"]
    _, line = _refusal(argv, 1, eight * 1.05)
    assert "--grad-accum 8 (8 row(s)" in line, line
    accum = options.parser("train").parse_args(argv + ["--grad-accum", "8"])
    assert fit.simulate(accum, 0, 1, 8, target)["peak"] <= eight * 1.05


# --- zerolab fit: the table, --json, and bad input ---------------------------------------------
def test_fit_json_reports_every_part(capsys):
    assert main(["fit", "--preset", "nano", "--stages", "0,3", "--world-size", "4", "--batch-size",
                 "8", "--device-memory", "h100", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["budget"] == 80e9 and rep["world_size"] == 4 and rep["rows_per_rank"] == 2
    for s in rep["stages"]:
        assert s["fits"] and s["smallest_world"] == 1 and s["largest_rows"] > 2
        assert s["peak"] > s["model_states_total"] + s["activations"]
    assert rep["unknown"]


@pytest.mark.parametrize("argv, names", [
    (["--model", "no_such_pkg.mod:build"], ["no_such_pkg.mod:build", "does not import"]),
    (["--model", "zerolab.course.fitmodels:nothing"], ["nothing", "pkg.module:function"]),
    (["--model", "zerolab.course.fitmodels"], ["pkg.module:function"]),
    (["--model", "zerolab.theory:check_stage"], ["check_stage()", "failed"]),
    (["--model", "math:pi"], ["math:pi", "pkg.module:function"]),
    (["--preset", "tiny", "--d-model", "65"], ["--d-model 65", "--n-head 4"]),
    (["--preset", "tiny", "--n-layer", "0"], ["--n-layer 0", ">= 1"]),
    (["--world-size", "0"], ["--world-size: '0'", "1 .."]),
    (["--world-size", "3", "--batch-size", "8"], ["--batch-size 8", "world_size 3"]),
    (["--batch-size", "0"], ["--batch-size: '0'", "1 .."]),
    (["--device-memory", "h900"], ["'h900'", "h100"]),
    (["--device-memory", "-3"], ["'-3'", "GB"]),
    (["--checkpoint-every", "0"], ["--checkpoint-every 0", ">= 1"]),
])
def test_bad_input_is_one_line_naming_the_value(argv, names, capsys):
    try:
        code = main(["fit", *argv])
    except SystemExit as stop:          # argparse's range check on the value itself
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in names:
        assert n in err, err


def test_a_build_that_returns_no_module_is_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text("import torch\ndef build():\n    return 3\n"
                                          "def noinputs():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["fit", "--model", "mymodels:build"]) == 2
    assert "returned int, not an nn.Module" in capsys.readouterr().err
    assert main(["fit", "--model", "mymodels:noinputs"]) == 2
    assert "no example_inputs(rows)" in capsys.readouterr().err


def test_named_devices_carry_their_memory():
    assert fittarget.device_memory("h200") == (141e9, "h200")
    assert fittarget.device_memory("24")[0] == 24e9
    assert not math.isnan(fittarget.device_memory("0.5GB")[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_train_and_compare_refuse_in_one_line_with_what_fits(command, tmp_path, monkeypatch, capsys):
    """The launchers ask the same prediction before any rank starts: on a machine whose memory
    holds DDP's step at 8 rows a rank but not at 32, the refusal (exit 2, one line) names more
    micro-steps, and nothing is launched."""
    from zerolab.run import preflight
    argv = ["--preset", "tiny", "--nproc", "2", "--batch-size", "64", "--steps", "1",
            "--stages", "0", "--out", str(tmp_path / "o")]
    a = options.parser("train").parse_args(argv)
    options.check(a, 2)
    eight = fit.simulate(a, 0, 2, 8, fit.target_of(a))["peak"]
    monkeypatch.setattr(preflight, "available_bytes", lambda: int(2 * eight * 1.05))
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "DDP needs about" in err and "--grad-accum 4 (8 row(s)" in err, err
    assert not (tmp_path / "o").exists()
