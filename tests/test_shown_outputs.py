"""The code a notebook shows is committed with it, and is the package's code as it is now.

A cell that shows the package's code (`nb.show(X)`, or a diff of two strategy files) is tagged
`shown-code` and keeps its Markdown listing (scripts/nb_policy.py), which scripts/nb_shown.py makes
without running the notebook. Checked here:
- every such cell of the course, found by a plain text search of its source (independent of the
  script's own parsing), is tagged, holds a Markdown listing that names a relative `zerolab/...`
  path and no absolute path or memory address, and `nb_shown.py --check` finds nothing stale;
- in a temporary copy of a notebook, a stale listing (the package's code "changed": a line of the
  listing differs), an untagged shown cell without output (what a new cell looks like), and a
  show of a name only the kernel holds each make `--check` exit 1 naming the cell; `--write`
  repairs the first two, also after cells moved;
- the policy keeps a shown cell's Markdown data and nothing else (no image, stream or error).
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import nb_policy  # noqa: E402
import nb_shown  # noqa: E402

NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("notebooks/exercises/*.ipynb"),
                    *ROOT.glob("labs/*.ipynb")])
# a call of zerolab's show or of difflib's diff on a line that is not a comment
SHOWS = re.compile(r"^[^#\n]*\b(?:nb\.show\(|unified_diff\()", re.MULTILINE)
SCRIPT = ROOT / "scripts" / "nb_shown.py"
TAG = "shown-code"


def _markdown(cell) -> list[str]:
    return ["".join(o["data"]["text/markdown"]) for o in cell["outputs"]
            if o.get("output_type") == "display_data" and "text/markdown" in o.get("data", {})]


def _nb_shown(*args, capsys=None) -> subprocess.CompletedProcess:
    """The script on `args`: in this process (its main and its printed lines) when given capsys,
    else as CI runs it, a process of its own."""
    if capsys is None:
        return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                              text=True, cwd=ROOT, timeout=300)
    capsys.readouterr()
    rc = nb_shown.main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def test_every_shown_cell_of_the_course_is_tagged_and_shows_its_code():
    found = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code" or not SHOWS.search("".join(cell["source"])):
                continue
            where = f"{path.relative_to(ROOT)} cell {i}"
            listings = _markdown(cell)
            found.append(where)
            assert TAG in cell["metadata"].get("tags", []), f"{where} is not tagged {TAG}"
            assert listings, f"{where} has no committed listing"
            for text in listings:
                assert re.match(r"`zerolab/[\w/]+\.py`, line \d+:\n\n```python\n", text) \
                    or text.startswith("```diff\n--- zerolab/"), f"{where}: {text[:80]!r}"
                assert str(ROOT) not in text and not re.search(r"\b0x[0-9a-f]{6,}", text), where
    assert len(found) > 50 and {"notebooks/05_zero1.ipynb cell 12",
                                "notebooks/06_zero2.ipynb cell 21"} <= set(found)


def test_every_committed_listing_is_current():
    """What `--check` (CI) runs: each listing equals what the package's code shows now."""
    problems = []
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        problems += nb_shown.process(nb, str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems) + "\n(run python scripts/nb_shown.py --write)"


@pytest.fixture
def copy05(tmp_path):
    path = tmp_path / "05_zero1.ipynb"
    path.write_text((ROOT / "notebooks" / "05_zero1.ipynb").read_text())
    return path


def _cells_showing(nb, text):
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            and text in "".join(c["source"])]


def test_a_stale_listing_fails_the_check_and_write_repairs_it(copy05, capsys):
    nb = json.loads(copy05.read_text())
    committed = copy.deepcopy(nb)
    diff_cell = _cells_showing(nb, "unified_diff(")[0]
    show_cell = _cells_showing(nb, "nb.show(ZeRO1._grads_ready)")[0]
    # the package "changed": a line number and a diff line the listing no longer matches
    out = nb["cells"][show_cell]["outputs"][0]["data"]["text/markdown"]
    out[0] = re.sub(r"line (\d+)", lambda m: f"line {int(m.group(1)) + 3}", out[0])
    nb["cells"][diff_cell]["outputs"][0]["data"]["text/markdown"][5] = "+    an old line\n"
    copy05.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    run = _nb_shown("--check", copy05)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"cell {show_cell}: its committed output differs" in run.stdout
    assert f"cell {diff_cell}: its committed output differs" in run.stdout
    assert "run python scripts/nb_shown.py --write" in run.stdout
    assert _nb_shown("--write", copy05, capsys=capsys).returncode == 0
    assert json.loads(copy05.read_text()) == committed
    assert _nb_shown("--check", copy05, capsys=capsys).returncode == 0


def test_a_new_or_moved_shown_cell_is_tagged_and_filled_by_write(copy05, capsys):
    nb = json.loads(copy05.read_text())
    new = {"cell_type": "code", "execution_count": None, "id": "new0", "metadata": {},
           "outputs": [], "source": ["nb.show(Strategy.own)"]}
    nb["cells"].insert(3, {"cell_type": "markdown", "id": "moved", "metadata": {},
                           "source": ["A cell that moves every cell below it."]})
    nb["cells"].insert(8, new)              # after the cell that imports Strategy
    copy05.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    run = _nb_shown("--check", copy05, capsys=capsys)
    assert run.returncode == 1 and "cell 8: shows code but is not tagged shown-code" in run.stdout
    assert _nb_shown("--write", copy05, capsys=capsys).returncode == 0
    assert _nb_shown("--check", copy05, capsys=capsys).returncode == 0
    written = json.loads(copy05.read_text())
    assert TAG in written["cells"][8]["metadata"]["tags"]
    assert _markdown(written["cells"][8])[0].startswith("`zerolab/strategy.py`, line ")
    assert nb_policy.clean(written) == written      # what --write made follows the policy


def test_a_show_of_a_kernel_only_name_is_refused(copy05, capsys):
    nb = json.loads(copy05.read_text())
    nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "kern", "metadata": {},
                        "outputs": [], "source": ["nb.show(type(strategy).update)"]})
    copy05.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for mode in ("--check", "--write"):
        run = _nb_shown(mode, copy05, capsys=capsys)
        assert run.returncode == 1 and f"cell {len(nb['cells']) - 1}: its shown code cannot be " \
            "made without running the notebook (NameError" in run.stdout, run.stdout


def test_the_policy_keeps_a_shown_cells_markdown_only():
    listing = {"data": {"text/markdown": ["`zerolab/x.py`, line 1:"], "text/plain": ["<M>"],
                        "image/png": "iVBOR"}, "metadata": {"x": 1}, "output_type": "display_data"}
    noise = [{"output_type": "stream", "name": "stdout", "text": ["/home/me/run 0x7f3a2b1c\n"]},
             {"output_type": "error", "ename": "E", "evalue": "", "traceback": []},
             {"data": {"image/png": "iVBOR"}, "metadata": {}, "output_type": "display_data"}]
    cell = {"cell_type": "code", "execution_count": 7, "metadata": {"tags": [TAG]},
            "outputs": [noise[0], listing, *noise[1:]], "source": ["nb.show(f)"]}
    kept = nb_policy.clean({"cells": [cell], "metadata": {}})["cells"][0]
    assert kept["outputs"] == [{"data": {"text/markdown": ["`zerolab/x.py`, line 1:"],
                                         "text/plain": ["<M>"]},
                                "metadata": {}, "output_type": "display_data"}]
    assert kept["execution_count"] == 1
    cell["metadata"]["tags"] = []
    assert nb_policy.clean({"cells": [cell], "metadata": {}})["cells"][0]["outputs"] == []
