"""The committed reference results (zerolab.reference) that labs plot when a launch fails."""
from __future__ import annotations

import pytest


def test_reference_runs_restore_and_equal_the_formulas(tmp_path):
    """The committed CPU reference run of every lab restores into any out folder and its bytes
    held and sent equal the formulas (the labs' own checks), so plots drawn from it are right."""
    from zerolab import labs, nb, reference
    from zerolab.report import load_run
    keys = sorted({str(p.parent.parent.relative_to(reference.FOLDER))
                   for p in reference.FOLDER.glob("**/stage0/rank0.json")})
    assert {k.split("/")[0] for k in keys} >= {"lab1_memory_by_stage", "lab2_traffic_by_stage",
                                               "lab3_step_timeline", "lab4_scaling"}
    for k in keys:
        runs = load_run(reference.restore(tmp_path / "runs" / "labs" / k))
        assert labs.check_memory(runs) > 0
        assert labs.check_traffic(labs.traffic_rows(runs)) > 0
    nb.use_reference()
    try:
        printed = []
        runs = nb.launch(stages="0,1,2,3", nproc=4, out=tmp_path / "x" / "lab1_memory_by_stage",
                         echo=printed.append)
        assert sorted(runs) == [0, 1, 2, 3] and "no ranks launched" in printed[0]
        with pytest.raises(FileNotFoundError, match="no reference run for 'lab5_same_training/fp32'"):
            nb.launch(out=tmp_path / "lab5_same_training" / "fp32")
    finally:
        nb.use_reference(False)
