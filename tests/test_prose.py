"""How the course reads, held: scripts/prose_check.py's limits on every text a user reads.

One test per file (README, each notebook, lab and site page), so a failure names the file and
lists its problem lines: the README's line cap, the mean and the longest sentence, and terms of
development history. One more test per package file set (strings and docstrings, which the CLI's
help and errors come from). The checker itself is tested on made-up texts: a history term, a long
sentence and a long README are caught, so the per-file tests can fail.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("prose_check", ROOT / "scripts" / "prose_check.py")
prose_check = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("prose_check", prose_check)       # dataclasses look their module up
_spec.loader.exec_module(prose_check)

TEXTS = prose_check.files(prose_check.TEXTS)
CODE = prose_check.files(prose_check.CODE)


def test_every_text_is_checked():
    names = {str(p.relative_to(ROOT)) for p in TEXTS}
    assert "README.md" in names and any(n.startswith("notebooks/") for n in names)
    assert any(n.startswith("docs/") for n in names) and any(n.startswith("labs/") for n in names)


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_text_reads_within_the_limits(path):
    found = prose_check.problems([prose_check.measure(path)], [])
    assert not found, f"{len(found)} problem(s):\n" + "\n".join(found)


def test_package_strings_hold_no_development_history():
    found = prose_check.problems([], [h for p in CODE for h in prose_check.code_history(p)])
    assert not found, f"{len(found)} problem(s):\n" + "\n".join(found)


def _made_up(tmp_path, name, text):
    """A made-up page measured as prose_check.measure measures a file of the repository."""
    t = prose_check.Text(name, lines=len(text.splitlines()))
    t.history += prose_check.history_in(text, "page")
    for para in prose_check.prose_lines(text):
        t.sentences += [(prose_check.words_of(s), s, "page")
                        for s in prose_check.split_sentences(para)]
    return t


@pytest.mark.parametrize("term", ["This was fixed in issue #31.", "It used to hang on two ranks.",
                                  "The step (#33) is shorter.", "Unlike the last session, it runs."])
def test_the_checker_catches_development_history(tmp_path, term):
    t = _made_up(tmp_path, "page.md", f"# A page\n\nZeRO-3 shards the weights. {term}\n")
    found = prose_check.problems([t], [])
    assert any("development history" in f for f in found), found


def test_the_checker_lets_external_references_and_anchors_pass(tmp_path):
    t = _made_up(tmp_path, "page.md", "# A page\n\nNCCL's rings are per NIC (NVIDIA/nccl#412). "
                 "The table is in the glossary.\n")
    assert not prose_check.problems([t], [])


def test_the_checker_catches_a_long_sentence_and_a_long_readme(tmp_path):
    long = " ".join(["word"] * (prose_check.MAX_WORDS + 1)) + "."
    t = _made_up(tmp_path, "page.md", f"# A page\n\n{long}\n")
    assert any("a sentence of" in f for f in prose_check.problems([t], []))
    readme = _made_up(tmp_path, "README.md", "Short line.\n" * (prose_check.README_LINES + 1))
    assert any("lines (at most" in f for f in prose_check.problems([readme], []))
