"""Every command the README and the site's pages show with its output is run, and its output
compared with the page, so a page can never drift from what the command prints.

The convention (for README.md, docs/*.md and site/*.md): a fenced block whose info string is
`console` and whose first line is `$ COMMAND`; the lines after it are what the command prints
(stdout and stderr together, as a terminal shows them). In those lines:

- a line `...` alone stands for any number of lines, none included;
- `[...]` inside a line stands for any text on that line;
- `<checkout>` stands for the repository's root (an absolute path on the machine that runs it);
- run ids (20261204T041708Z-290da5) and ISO dates are masked on both sides;
- an HTML comment on the line just before the block, `<!-- doc-test: mask REGEX -->`, masks
  REGEX on both sides too (what varies with the machine: a loss that depends on Python's
  standard library, say). The reader sees the value of one run; the test compares the rest.

`zerolab ARGS` runs as `python -m zerolab ARGS`, `python ARGS` as this Python, in an empty
temporary folder (whatever a run writes lands there), with this checkout first on PYTHONPATH; a
relative path argument that names a file of the checkout is given as that file. Every command
must exit 0.

After a change that moves the output (the cost model's latency, a stage's length), rewrite the
blocks from what the commands print now, keeping their `...` lines and masks' places:

    python tests/test_doc_commands.py --update [FILE ...]
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/*.md", "site/*.md"]
ALWAYS = [r"\b\d{8}T\d{6}Z-[0-9a-f]{6}\b",                     # a run id
          r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2})?\S*"]   # an ISO date and time
ANY_LINES, ANY_TEXT, CHECKOUT = "...", "[...]", "<checkout>"
TIMEOUT = 600


@dataclass
class Block:
    """One `console` block: where it is, its command, the output shown, the extra masks."""
    page: str
    line: int                   # 1-based line of the `$ COMMAND` line
    command: str
    shown: list[str]
    masks: list[str] = field(default_factory=list)
    span: tuple[int, int] = (0, 0)      # 0-based lines of the output: [start, end)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.command}"


def pages() -> list[Path]:
    out = []
    for pattern in PAGES:
        out += sorted(ROOT.glob(pattern))
    return out


def blocks(path: Path) -> list[Block]:
    """The page's console blocks (fences of ``` or ~~~, any length)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*console\s*$", lines[i].strip())
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].strip().startswith(fence))
        masks = []
        if i > 0:
            d = re.match(r"^<!--\s*doc-test:\s*mask\s+(.+?)\s*-->$", lines[i - 1].strip())
            masks = [d.group(1)] if d else []
        body = lines[start:end]
        assert body and body[0].startswith("$ "), (
            f"{path.relative_to(ROOT)}:{start + 1}: a console block starts with `$ COMMAND`")
        rel = str(path.relative_to(ROOT))
        found.append(Block(rel, start + 1, body[0][2:].strip(), body[1:], masks,
                           (start + 1, end)))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


def argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "zerolab":
        words = [sys.executable, "-m", "zerolab", *words[1:]]
    elif words[0] in ("python", "python3"):
        words = [sys.executable, *words[1:]]
    else:
        raise AssertionError(f"`{command}`: a shown command starts with zerolab or python")
    return [words[0]] + [str(ROOT / w) if not w.startswith("-") and not os.path.isabs(w)
                         and (ROOT / w).is_file() else w for w in words[1:]]


def run(command: str) -> str:
    """What the command prints (stdout and stderr together), typed in an empty folder."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with tempfile.TemporaryDirectory(prefix="zerolab-doc-") as cwd:
        proc = subprocess.Popen(argv(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"`{command}` ran past {TIMEOUT} s:\n{out}")
        assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{out}"
        return out.replace(cwd, "<cwd>")


def _masked(text: str, masks: list[str]) -> str:
    for rx in ALWAYS + masks:
        text = re.sub(rx, "#", text)
    return text


def _clean(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace(str(ROOT), CHECKOUT).splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(shown: list[str], printed: str, masks: list[str] = ()) -> bool:
    """Whether the printed text is what the block shows, under its wildcards and masks."""
    parts = []
    for line in shown:
        if line.strip() == ANY_LINES:
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        pieces = [re.escape(_masked(p, list(masks))) for p in line.rstrip().split(ANY_TEXT)]
        parts.append(r"[^\n]*?".join(pieces) + r"\n")
    actual = "\n".join(_masked(ln, list(masks)) for ln in _clean(printed)) + "\n"
    return re.fullmatch("".join(parts), actual) is not None


def _diff(shown: list[str], printed: str) -> str:
    return "\n".join(difflib.unified_diff(shown, _clean(printed), "the page", "the command",
                                          lineterm="", n=1))


# --- the tests ------------------------------------------------------------------------------------
BLOCKS = all_blocks()


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_page_shows_what_the_command_prints(block):
    printed = run(block.command)
    assert matches(block.shown, printed, block.masks), (
        f"{block.page}:{block.line}: `{block.command}` prints something else than the page shows "
        f"(rewrite with `python tests/test_doc_commands.py --update {block.page}`):\n"
        + _diff(block.shown, printed))


def test_the_pages_show_the_commands_a_reader_meets_first():
    """The README's main command and the Muon table are among the checked blocks."""
    commands = {(b.page, b.command) for b in BLOCKS}
    assert ("README.md", "zerolab compare") in commands, commands
    assert ("docs/whole-matrix.md", "zerolab time --muon") in commands, commands
    assert all(b.shown for b in BLOCKS), [b.id for b in BLOCKS if not b.shown]


def test_a_command_shown_with_a_prompt_is_in_a_console_block():
    """`$ zerolab ...` in any other fenced block would escape this test."""
    for path in pages():
        fence = None
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = re.match(r"^\s*(```+|~~~+)\s*(\S*)", line)
            if m and fence is None:
                fence, info = m.group(1), m.group(2)
                continue
            if fence and line.strip().startswith(fence):
                fence = None
                continue
            if fence and info != "console":
                assert not line.startswith("$ "), f"{path.relative_to(ROOT)}:{n}: {line}"


def test_the_comparison_can_fail():
    """A changed digit, a missing line or an extra line fails; wildcards and masks pass."""
    printed = "header\nDDP   4.674506   3,528,704\nZeRO-3   4.674582   882,176\nwrote x\n"
    shown = ["header", "DDP   4.674506   3,528,704", "ZeRO-3   4.674582   882,176", "wrote x"]
    assert matches(shown, printed)
    assert not matches([*shown[:2], "ZeRO-3   4.674582   882,177", "wrote x"], printed)
    assert not matches(shown[:3], printed)                        # a line the page leaves out
    assert matches([*shown[:3], ANY_LINES], printed)
    assert matches([ANY_LINES, shown[2], ANY_LINES], printed)
    assert not matches([ANY_LINES, "ZeRO-2   4.674582   882,176", ANY_LINES], printed)
    other = printed.replace("4.674582", "4.674999")
    assert not matches(shown, other)
    assert matches(shown, other, [r"\d\.\d{6}"])                  # the mask lets the loss vary
    assert not matches(shown, other.replace("882,176", "882,000"), [r"\d\.\d{6}"])
    assert matches(["run [...] done"], "run 20261207T184449Z-385424 (4 ranks) done\n")
    assert matches([f"skeleton {CHECKOUT}/a.py"], f"skeleton {ROOT}/a.py\n")


# --- python tests/test_doc_commands.py --update ----------------------------------------------------
def _rewrite(block: Block, printed: str) -> list[str]:
    """The block's output lines rewritten from what the command printed, keeping its `...`
    lines: each run of shown lines between them is replaced by the printed lines most like it."""
    actual = _clean(printed)
    if ANY_LINES not in [ln.strip() for ln in block.shown]:
        return actual
    out, pos, segment = [], 0, []

    def place(seg):
        nonlocal pos
        if not seg:
            return
        best, at = -1.0, pos
        for i in range(pos, len(actual) - len(seg) + 1):
            score = difflib.SequenceMatcher(None, "\n".join(seg),
                                            "\n".join(actual[i:i + len(seg)])).ratio()
            if score > best:
                best, at = score, i
        out.extend(actual[at:at + len(seg)])
        pos = at + len(seg)

    for line in block.shown:
        if line.strip() == ANY_LINES:
            place(segment)
            segment = []
            out.append(ANY_LINES)
        else:
            segment.append(line)
    place(segment)
    return out


def update(files: list[str]) -> int:
    paths = [ROOT / f for f in files] if files else pages()
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for block in reversed(blocks(path)):
            printed = run(block.command)
            if matches(block.shown, printed, block.masks):
                continue
            new = _rewrite(block, printed)
            lines[block.span[0]:block.span[1]] = new
            print(f"{block.id}: rewritten; check it (masks: {block.masks})")
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"]:
        sys.exit(update(sys.argv[2:]))
    print(__doc__)
