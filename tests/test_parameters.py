"""A value the user gives is data, checked against what it sets, and a bad one is one line
(issue #23, items 4 and 6): `zerolab labs -p NAME=VALUE` reaches the lab's parameters cell as a
Python literal of a plain value (a YAML tag such as !!binary, which papermill would paste in as
code, is refused) of the kind of the lab's default, naming the parameter; `zerolab whatif
--world-size` takes N as people write it (1e6) and refuses one it cannot fake, in one line."""
from __future__ import annotations

import ast
import base64

import pytest

from zerolab import cli
from zerolab.course import labs


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a lab was started for a bad parameter")
    monkeypatch.setattr("zerolab.run.launch.run", refuse)


def _one_line(capsys, argv) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


# code that papermill would have pasted into the notebook: bytes (via !!binary) and a set
# (via !!set) are written as `"<their repr>"`, and a `"` inside ends that string
ESCAPE = 'x"; __import__("os").system("touch /tmp/zerolab-pwned"); y="'
BAD_P = {
    "!!binary (the issue's)": (f"steps=!!binary {base64.b64encode(ESCAPE.encode()).decode()}",
                               ["steps", "bytes", "!!binary"]),
    "!!set with a quote": (f"preset=!!set {{'{ESCAPE}': null}}", ["preset", "set", "!!set"]),
    "!!omap": ("stages=!!omap [a: 1]", ["stages", "tuple", "data"]),
    "size_preset (the issue's)": ("size_preset=bogus", ["size_preset = 'bogus'",
                                                        "nano, tiny, small"]),
    "size_preset a number": ("size_preset=3", ["size_preset = 3", "must be text"]),
    "unknown name": ("stepz=3", ["stepz", "no lab to run has a parameter stepz", "steps"]),
    "a list for a number": ("fp32_tolerance=[1]", ["fp32_tolerance = [1]", "a number"]),
}


@pytest.mark.parametrize("case", BAD_P)
def test_bad_lab_parameter_is_one_line_before_any_lab(case, capsys, tmp_path, no_launch):
    value, says = BAD_P[case]
    line = _one_line(capsys, ["labs", "-p", value, "--out", str(tmp_path / "o")])
    assert line.startswith("zerolab labs: error: "), line
    for piece in says:
        assert piece in line, (piece, line)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["3", "[0.1, 1.0]", "'0,1'", "tiny", "null", "2020-01-01",
                                  "'a \"quoted\" \\\\ value'", "'''three'''", ".nan",
                                  ESCAPE.replace('"', "'").join("\"\"")])
def test_lab_parameters_reach_the_notebook_as_literals(text):
    """What zerolab labs hands papermill (`-y`), read as papermill reads it and written into the
    parameters cell as papermill writes it, evaluates as a literal to the value checked here."""
    import math

    import yaml
    from papermill.iorw import NoDatesSafeLoader
    from papermill.translators import PythonTranslator
    assert labs._parse_overrides([f"x={text}"]) == [("x", text)]
    want = labs._load(text)
    got = yaml.load(labs.papermill_yaml("x", text), Loader=NoDatesSafeLoader)["x"]
    code = PythonTranslator.translate(got)
    if isinstance(want, float) and math.isnan(want):
        assert code == "float('nan')"
        return
    assert got == want and ast.literal_eval(code) == want, (text, code)


def test_good_lab_overrides_are_checked_against_the_labs(capsys, tmp_path):
    books = labs.lab_notebooks()
    labs._check_overrides([("size_preset", "nano"), ("link_gbps", "'0.1,1'"),
                           ("link_gbps", "[0.5]"), ("steps", "2"), ("nproc", "auto")], books)
    assert labs.lab_parameters(books[0])["steps"] == 2


# --- whatif ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, says", [
    ("1e8", ["world_size 100,000,000 is more than whatif's 1,000,000 ranks", "zerolab memory"]),
    ("100000001", ["world_size 100,000,001", "1,000,000"]),
    ("1.5", ["--world-size", "'1.5' is not a whole number", "1 .. 1000000000"]),
    ("nan", ["--world-size", "'nan' is not a finite number"]),
    ("0", ["--world-size", "'0' is outside the accepted range: a whole number in 1 .."]),
])
def test_whatif_world_size_is_one_line(value, says, capsys):
    line = _one_line(capsys, ["whatif", "--world-size", value, "--stage", "0"])
    assert line.startswith("zerolab whatif: error:"), line
    for piece in says:
        assert piece in line, (piece, line)


def test_world_size_is_read_as_people_write_it(capsys):
    assert cli.main(["memory", "--world-size", "1e3"]) == 0
    assert "1000" in capsys.readouterr().out.replace(",", "")
