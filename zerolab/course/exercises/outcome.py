"""What the exercise checker says when the learner's code did not run to its end: one line that
says what happened - the file exited while it was imported, a rank exited or was killed inside
a function, a call hung (past --call-timeout), a function raised - or that the check could not
grade it: a function never called, a step not compared (`unrun`). The grader passes only what
ran: checker.py and track.py build their verdicts from what sandbox.py's children reported, and
these lines are what the learner reads instead of a PASS or a traceback.
"""
from __future__ import annotations

import re
import signal
from pathlib import Path

from . import diagnose

EXIT_FIX = "remove the exit (exit(), sys.exit(), os._exit())"


def _how(code) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _exit_line(who: str, mark: str, name: str, how: str, where: str = "") -> str:
    """One child ended without its report; `mark`: where (see sandbox.Failed.marks)."""
    verb = "was killed" if how.startswith("killed") else "exited"
    if mark == "import":
        return (f"{name} {verb} while it was being imported ({how}): code at the top level of "
                f"your file that ends the process stops the check before any of your functions "
                f"is called; {EXIT_FIX}")
    if mark:
        return (f"{who} {verb} inside your {mark}{where} ({how}): the checker calls your "
                f"function and needs it to return, on every rank; {EXIT_FIX}")
    return f"{who} {verb} ({how}) before it reported, outside your functions: not graded"


def failure(err, impl: str) -> tuple[list[str], bool]:
    """(lines, named) from a failed group of children (sandbox.Failed, or testing.RanksFailed):
    one line (two for a timeout) saying what happened, on which rank, in which of the learner's
    functions, at which line of the learner's file; named: an exit or a hang, said as such (the
    usual mistakes of the exercise would not help)."""
    lines = _failure(err, impl)
    return lines, bool(getattr(err, "hung", None) or getattr(err, "exited", None)
                       or "exit" in lines[0].split(":")[0])


def _failure(err, impl: str) -> list[str]:
    name = Path(impl).name
    judge, marks = getattr(err, "judge", False), getattr(err, "marks", {})

    def who(rank):
        return "the checker's process" if judge else f"rank {rank}"

    def mine(text, pattern):
        return [f for f in re.findall(pattern, text) if Path(f[0]).name == name]

    hung = getattr(err, "hung", {})
    if hung:
        ranks = sorted(hung)
        fname = hung[ranks[0]][0]
        at = mine(err.ranks.get(ranks[0], ""), r'File "([^"]+)", line (\d+) in (\S+)')
        where = f" ({name} line {at[0][1]})" if at else ""
        on = "" if judge else f" on {_ranks(ranks)}"
        what = (f"importing {name} did not finish" if fname == "import" else
                f"your {fname} did not return")
        return [f"{what} within {err.call_timeout:g} s{on}{where}: it hangs (a loop or a wait "
                f"that never ends, or a collective that not every rank issued); every process "
                f"of the check was stopped (--call-timeout S sets the limit)"]
    for rank, code in sorted(getattr(err, "exited", {}).items()):
        return [_exit_line(who(rank), marks.get(rank, ""), name, _how(code))]
    for rank, text in sorted(err.ranks.items()):
        if "Traceback" not in text:
            continue
        last = text.strip().splitlines()[-1]
        if last.startswith(f"{diagnose.__name__}.Mistake: "):    # a named mistake, as is
            return [last.partition(": ")[2]]
        frames = mine(text, r'File "([^"]+)", line (\d+), in (\S+)')
        where = f" ({name} line {frames[-1][1]})" if frames else ""
        if re.match(r"SystemExit\b", last):
            code = last.partition(":")[2].strip()          # exit() raises SystemExit(None)
            return [_exit_line(who(rank), marks.get(rank, ""), name,
                               f"sys.exit({code})" if code not in ("", "None") else "exit()",
                               where)]
        inside = f" in your {frames[-1][2]}{where}" if frames else ""
        return [f"{who(rank)} raised{inside}: {last}" if not judge or not frames else
                f"your {frames[-1][2]} raised{where}: {last}"]
    if "timed out" in err.why:
        stuck = []
        for rank, text in sorted(err.ranks.items()):
            at = mine(text, r'File "([^"]+)", line (\d+) in (\S+)')
            if at:
                stuck.append(f"rank {rank} was waiting in your {at[0][2]} ({name} line "
                             f"{at[0][1]})")
        return [f"the ranks did not finish: {err.why} (--timeout). A collective that not every "
                f"rank issued, or a wait that never ends, hangs the others.", *stuck]
    return [err.why]


def unrun(names, calls: list[dict], compared: list[int] | None = None, steps: int = 0,
          ranks: bool = True) -> list[str]:
    """[] when each of `names` (the learner's functions) was called on every rank (`calls`: one
    {name: calls} per rank) and, when `compared` is given, every rank compared all `steps`;
    else one line: what did not run, so the check could not grade it."""
    for fname in names:
        missing = [r for r, c in enumerate(calls) if not c.get(fname)]
        if missing:
            on = f" on {_ranks(missing)}" if ranks else ""
            return [f"your {fname} was never called{on}, so the check could not "
                    f"grade it: the checker puts your functions in place of zerolab's itself - "
                    f"does your file change zerolab's or the checker's code?"]
    short = [r for r, k in enumerate(compared or []) if k != steps]
    if short:
        return [f"{_ranks(short)} compared {compared[short[0]]} of the {steps} steps with the "
                f"reference, so the check could not grade the others: every step is compared - "
                f"does your file change the checker's code?"]
    return []


def verdict(done, per_rank, ex, steps: int, accum: int, atol: float):
    """checker.py's verdict from its ranks' reports (check_worker's dicts) of `steps` steps of
    `accum` micro-steps: the first step that differs, one line per finding (the named mistakes
    first); else `unrun`; else PASS. done(ok, lines, diagnosed): what to return it with."""
    STEPS, ACCUM, ATOL = steps, accum, atol  # noqa: N806 - checker.py's names
    found = [f for r in per_rank for f in r["findings"]]
    if found:
        first = min(f["step"] for f in found)
        lines = [f"step {first + 1} of {STEPS} (each {ACCUM} micro-steps), the first that differs:"]
        at_first = [f for f in found if f["step"] == first]
        named = any(f.get("diagnosis") for f in at_first)
        ranks_by_line: dict[tuple, list[int]] = {}      # one line per finding, ranks grouped
        # the mistakes diagnose named first (what to fix), then what the checks measured
        for f in sorted(at_first, key=lambda f: (not f.get("diagnosis"), f["rank"])):
            ranks = ranks_by_line.setdefault((f["kind"], f["text"], bool(f.get("diagnosis"))), [])
            if f["rank"] not in ranks:
                ranks.append(f["rank"])
        kinds_shown, measured = set(), 0
        for (kind, text, diagnosis), ranks in ranks_by_line.items():
            if (kind, tuple(ranks)) in kinds_shown:
                continue                                 # the first of each kind is enough
            if named and not diagnosis:
                measured += 1
                if measured > 2:                         # the evidence, briefly
                    continue
            kinds_shown.add((kind, tuple(ranks)))
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            lines.append(f"{who}: {kind}: {text}")
        return done(False, lines, diagnosed=named)
    missed = unrun(ex.functions, [r["calls"] for r in per_rank],
                          [r["compared"] for r in per_rank], STEPS)
    if missed:                              # what did not run was not graded: no PASS
        return done(False, missed, True)
    worst = max(r["worst"] for r in per_rank)
    return done(True, [
        f"every parameter on every rank equals single-process torch AdamW after each of "
        f"{STEPS} steps (largest difference {worst:.2g} <= {ATOL:g})",
        f"bytes sent and bytes held equal the formulas at Ψ = {per_rank[0]['psi']:,} (padded) "
        f"on every rank, every step"])
