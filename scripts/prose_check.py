"""How the course reads: sentence lengths, the README's size, and no development history.

The course teaches in short sentences: the idea first, the evidence folded. This script measures
that, per notebook, lab and page, and (with --check) holds every user-facing text to the limits:

- README.md: at most README_LINES lines;
- every notebook, lab and page: markdown sentences average at most MEAN_WORDS words, and none
  runs over MAX_WORDS;
- nothing a user reads (the texts above, and the package's own strings and docstrings, which the
  CLI's help and error messages come from) names the development history: issue numbers,
  "this session", "before this fix".

What counts as prose: markdown text (a notebook's markdown cells; a page's lines), with code
blocks, tables, headings, HTML tags and display math set aside. List items and the text inside
folded `<details>` blocks count: a folded sentence is still read. Inline code, inline math and a
number count as one word each; a link counts its text only.

    python scripts/prose_check.py                  # the table, worst sentence per file
    python scripts/prose_check.py --check          # exit 1 naming every file over a limit
    python scripts/prose_check.py --long FILE ...  # every sentence over MAX_WORDS, with its place
    python scripts/prose_check.py --json           # the numbers, for a closing note or a test

The limits are the issue's: README ~150 lines, about 22 words per sentence per notebook (what the
first three notebooks already read at), none over 40 (plain technical prose reads at 15-25).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
README_LINES = 160           # "at most ~150 lines": a little room for a link or a blank line
MEAN_WORDS = 22.0            # average words per sentence, per notebook or page
MAX_WORDS = 40               # no sentence longer than this

# the texts a user reads, relative to the repository's root
TEXTS = ["README.md", "notebooks/*.ipynb", "notebooks/exercises/*.ipynb", "notebooks/*.md",
         "labs/*.ipynb", "labs/*.md", "docs/*.md", "site/*.md"]
# the package's strings (CLI help, errors, docstrings shown in notebooks): history terms only
CODE = ["zerolab/**/*.py", "scripts/**/*.py", "labs/*.py", "labs/*.sh"]

# development history: what the project went through, never what is true now
HISTORY = [
    (re.compile(r"\bissues?\s*#?\s*\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w/.-])#\d{1,3}\b(?![\w-])"), "an issue number"),
    (re.compile(r"\b(this|last|previous|earlier|next) session\b", re.I), "a session"),
    (re.compile(r"\bbefore (this|the) (fix|change)\b", re.I), "before a fix"),
    (re.compile(r"\bused to (fail|hang|raise|print|say|crash)\b", re.I), "what used to happen"),
    (re.compile(r"\bno longer (fails|hangs|raises|crashes)\b", re.I), "what used to happen"),
    (re.compile(r"\b(this|last|previous|earlier) round\b", re.I), "a round of work"),
]
# "#123" that is not history: a colour, a heading anchor, a GitHub reference repo#123 (caught by
# the look-behind above), a Python comment in a code cell (not prose)

ABBREVIATIONS = ["e.g.", "i.e.", "vs.", "et al.", "cf.", "Fig.", "Eq.", "Sec.", "etc.", "approx.",
                 "No.", "Ch.", "resp.", "incl.", "ca.", "Dr.", "Mr.", "St."]


@dataclass
class Text:
    """One user-facing file's prose: its sentences (words each) and where each came from."""
    path: str
    lines: int = 0
    sentences: list = field(default_factory=list)   # (words, sentence text, place)
    history: list = field(default_factory=list)     # (term kind, excerpt, place)

    @property
    def words(self) -> int:
        return sum(n for n, _, _ in self.sentences)

    @property
    def mean(self) -> float:
        return mean(n for n, _, _ in self.sentences) if self.sentences else 0.0

    @property
    def over(self) -> list:
        return [s for s in self.sentences if s[0] > MAX_WORDS]


def prose_lines(markdown: str) -> list[str]:
    """The prose of a markdown text as paragraphs: code blocks, tables, headings, HTML tags and
    display math set aside; list items each their own paragraph."""
    paras, cur, fence, math = [], [], None, False

    def flush():
        if cur:
            paras.append(" ".join(cur))
            cur.clear()

    for raw in markdown.splitlines():
        line = raw.strip()
        if fence:
            if line.startswith(fence):
                fence = None
            continue
        m = re.match(r"^(```+|~~~+|:::+)", line)
        if m:
            flush()
            fence = m.group(1)[:3]
            continue
        if line.startswith("$$"):
            flush()
            if not (line.endswith("$$") and len(line) > 2):
                math = not math
            continue
        if math:
            continue
        if (not line or line.startswith("|") or line.startswith("#") or line.startswith(">|")
                or re.fullmatch(r"</?[a-zA-Z][^>]*>", line) or line.startswith("<!--")
                or line.startswith("![") or re.fullmatch(r"[-=*_ ]{3,}", line)):
            flush()
            continue
        line = re.sub(r"^>\s*", "", line)
        if re.match(r"^([-*+]|\d+[.)])\s+", line):
            flush()
            line = re.sub(r"^([-*+]|\d+[.)])\s+", "", line)
        line = re.sub(r"</?(summary|details|b|i|em|strong|br|sub|sup|code|span)[^>]*>", " ", line)
        cur.append(line)
    flush()
    return paras


def words_of(sentence: str) -> int:
    s = re.sub(r"`[^`]*`", " CODE ", sentence)
    s = re.sub(r"\$[^$]+\$", " MATH ", s)
    s = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"https?://\S+", " URL ", s)
    return len([w for w in re.split(r"\s+", s) if re.search(r"\w", w)])


def split_sentences(para: str) -> list[str]:
    """Sentences of one paragraph: a stop (. ! ?) then a space and a capital, a digit, a quote,
    a bracket or a backtick; the abbreviations above never end one; code and math never split."""
    protected = para
    keep = {}

    def hide(m):
        key = f"\x00{len(keep)}\x00"
        keep[key] = m.group(0)
        return key

    protected = re.sub(r"`[^`]*`|\$[^$]+\$|\]\([^)]*\)", hide, protected)
    for abbr in ABBREVIATIONS:
        protected = protected.replace(abbr, abbr.replace(".", "\x01"))
    parts = re.split(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(\[`\x00*_])", protected)
    out = []
    for p in parts:
        for key, val in keep.items():
            p = p.replace(key, val)
        p = p.replace("\x01", ".").strip()
        if p:
            out.append(p)
    return out


def markdown_of(path: Path) -> list[tuple[str, str]]:
    """(place, markdown) pieces of a file: a notebook's markdown cells, or a page whole."""
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        return [(f"cell {i}", "".join(c["source"])) for i, c in enumerate(nb["cells"])
                if c["cell_type"] == "markdown"]
    return [("page", path.read_text(encoding="utf-8"))]


def history_in(text: str, place: str) -> list:
    found = []
    for rx, kind in HISTORY:
        for m in rx.finditer(text):
            a, b = max(0, m.start() - 30), min(len(text), m.end() + 30)
            found.append((kind, text[a:b].replace("\n", " "), place))
    return found


def measure(path: Path) -> Text:
    rel = str(path.relative_to(ROOT))
    t = Text(rel, lines=len(path.read_text(encoding="utf-8").splitlines()))
    for place, md in markdown_of(path):
        # a heading anchor (#symbols) or a colour is not a reference; drop links' targets first
        t.history += history_in(re.sub(r"\]\([^)]*\)", "]", md), place)
        for para in prose_lines(md):
            for s in split_sentences(para):
                n = words_of(s)
                if n:
                    t.sentences.append((n, s, place))
    return t


def code_history(path: Path) -> list:
    text = path.read_text(encoding="utf-8", errors="replace")
    return [(k, e, f"{path.relative_to(ROOT)}") for k, e, _ in history_in(text, "")]


def files(patterns: list[str]) -> list[Path]:
    out = []
    for p in patterns:
        out += sorted(ROOT.glob(p))
    return [p for p in out if ".ipynb_checkpoints" not in p.parts and "runs" not in p.parts
            and p.name != "prose_check.py"]            # this file names the terms it looks for


def problems(texts: list[Text], code: list) -> list[str]:
    """Every limit a text breaks, one line each."""
    out = []
    for t in texts:
        if t.path == "README.md" and t.lines > README_LINES:
            out.append(f"README.md: {t.lines} lines (at most {README_LINES})")
        if t.mean > MEAN_WORDS:
            out.append(f"{t.path}: sentences average {t.mean:.1f} words (at most {MEAN_WORDS:g})")
        for n, s, place in t.over:
            out.append(f"{t.path} {place}: a sentence of {n} words (at most {MAX_WORDS}): "
                       f"{s[:90]}...")
        for kind, excerpt, place in t.history:
            out.append(f"{t.path} {place}: development history ({kind}): ...{excerpt}...")
    for kind, excerpt, where in code:
        out.append(f"{where}: development history ({kind}): ...{excerpt}...")
    return out


def table(texts: list[Text]) -> str:
    rows = [f"{'file':44} {'lines':>6} {'words':>7} {'sent.':>6} {'mean':>5} {'max':>4} "
            f"{'>40':>4} {'hist':>4}"]
    for t in texts:
        mx = max((n for n, _, _ in t.sentences), default=0)
        rows.append(f"{t.path:44} {t.lines:6d} {t.words:7,d} {len(t.sentences):6d} "
                    f"{t.mean:5.1f} {mx:4d} {len(t.over):4d} {len(t.history):4d}")
    total = [n for t in texts for n, _, _ in t.sentences]
    rows.append(f"{'all':44} {'':>6} {sum(total):7,d} {len(total):6d} "
                f"{(mean(total) if total else 0):5.1f} {max(total, default=0):4d} "
                f"{sum(len(t.over) for t in texts):4d} {sum(len(t.history) for t in texts):4d}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="files to measure (default: every user-facing text)")
    ap.add_argument("--check", action="store_true", help="exit 1 if any text breaks a limit")
    ap.add_argument("--long", action="store_true", help=f"list every sentence over {MAX_WORDS}")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    paths = [Path(p).resolve() for p in args.paths] if args.paths else files(TEXTS)
    texts = [measure(p) for p in paths]
    code = [] if args.paths else [h for p in files(CODE) for h in code_history(p)]
    if args.json:
        print(json.dumps({t.path: {"lines": t.lines, "words": t.words, "sentences": len(t.sentences),
                                   "mean": round(t.mean, 1), "over_40": len(t.over),
                                   "history": len(t.history)} for t in texts}, indent=1))
    else:
        print(table(texts))
    if args.long:
        for t in texts:
            for n, s, place in t.over:
                print(f"\n{t.path} {place} ({n} words):\n  {s}")
    found = problems(texts, code)
    if args.check and found:
        print(f"\n{len(found)} problem(s):", file=sys.stderr)
        for line in found:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
