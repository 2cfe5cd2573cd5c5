"""How big the lesson is: lines per stage file and per method, and what each stage adds.

The course promises that a learner reads a stage on about two screens and that `diff zero2.py
zero3.py` is the lesson "parameters too". This prints, for the four stages and the frame they
share (zerolab/strategy.py): the file's lines, its functions' lines (max and median; a method is
its `def` through its last line), and for consecutive stages the lines `diff` removes, adds and
keeps.

    python scripts/lesson_size.py            # from the repository's root
"""
import ast
import difflib
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "zerolab"
STAGES = ("ddp.py", "zero1.py", "zero2.py", "zero3.py")


def functions(path: Path) -> list[tuple[int, str]]:
    return [(n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def main() -> int:
    for name in (*STAGES, "strategy.py"):
        if not (ROOT / name).exists():          # (before the frame existed)
            continue
        path = ROOT / name
        lines, fns = len(path.read_text().splitlines()), functions(path)
        longest = max(fns)
        print(f"{name:<12}{lines:>5} lines {len(fns):>4} functions, longest {longest[0]} "
              f"({longest[1]}), median {statistics.median(n for n, _ in fns):g}")
    for a, b in zip(STAGES, STAGES[1:]):
        old, new = ((ROOT / f).read_text().splitlines() for f in (a, b))
        ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        kept = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag == "equal")
        print(f"diff {a} {b}: -{len(old) - kept} +{len(new) - kept}, {kept} lines equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
