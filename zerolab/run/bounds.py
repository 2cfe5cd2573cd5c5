"""The accepted range of every number a zerolab command line or a lab takes, checked where it is read.

Idea: one table (`RANGES`) gives each numeric option its range; `guard(parser)` walks every
action of a parser and its subcommands and makes each numeric one check its value as argparse
reads it. A value outside its range, NaN, inf, or text that is not a number (a wrong unit such
as `4MB`) ends the command line with one line naming the option, the value and the range (exit
2), before anything runs. An option missing from the table gets the default range of its type
(a whole number 0 .. 2**31 - 1, or a finite number >= 0), so a new option is checked the day it
is added; tests/test_bounds.py walks the same actions and tries each bad value on each one.
Lab parameters use the same table by name (`check`).

    guard(parser)                         # every numeric option of parser and its subcommands
    check("steps", 0)                     # ValueError: steps = 0 is outside 1 .. 1000000000 ...
"""
from __future__ import annotations

import argparse
import math

from .. import theory

WHOLE, REAL = "a whole number", "a finite number"
BIG = 2**31 - 1         # the default top of a whole number: what a C int holds

#: name (a flag without its dashes, or a lab parameter): (kind, low, high, low excluded)
RANGES = {
    # model and data
    "params": (REAL, 1, 1e15, False), "world-size": (WHOLE, 1, 10**9, False),
    "optimizer-bytes": (REAL, 0, 1024, True), "tokens-per-rank": (REAL, 0, 1e9, True),
    "blocks": (WHOLE, 1, 10**4, False), "d-model": (WHOLE, 1, 10**6, False),
    "seq-len": (REAL, 0, 1e9, False), "block-size": (WHOLE, 1, 10**7, False),
    "batch-size": (WHOLE, 1, 10**7, False), "grad-accum": (WHOLE, 1, 10**6, False),
    "steps": (WHOLE, 1, 10**9, False), "seed": (WHOLE, 0, 2**32 - 1, False),
    # optimizer
    "lr": (REAL, 0, 1e6, True), "weight-decay": (REAL, 0, 100, False),
    "max-grad-norm": (REAL, -1e9, 1e9, False),
    # hardware the cost model or the link emulator assumes
    "link-gbps": (REAL, 0, 1e6, True), "link-latency-us": (REAL, 0, 1e6, False),
    "device-tflops": (REAL, 0, 1e6, True), "mfu": (REAL, 0, 1, True),
    "ranks-per-node": (WHOLE, 1, 4096, False), "nics-per-node": (WHOLE, 1, 1024, False),
    "rank": (WHOLE, 0, 10**7 - 1, False),
    # strategies' knobs
    "bucket-mb": (REAL, 0, 1e6, True), "zero3-prefetch-depth": (WHOLE, -1, 10**4, False),
    "quant-block": (WHOLE, 1, 2**24, False),
    # the launch
    "nproc": (WHOLE, 1, 1024, False), "nnodes": (WHOLE, 1, 10**5, False),
    "node-rank": (WHOLE, 0, 10**5 - 1, False), "nodes": (WHOLE, 1, 10**5, False),
    "timeout": (REAL, 0, 1e7, True), "call-timeout": (REAL, 0, 1e6, True),
    "save-every": (WHOLE, 0, 10**9, False), "rounds": (WHOLE, 1, 10**4, False),
    "warmup": (WHOLE, 0, 10**4, False),
    # lab parameters (their names in the labs' parameters cells)
    "world_sizes": (WHOLE, 1, 1024, False), "muon_world_sizes": (WHOLE, 2, 8, False),
    "fp32_tolerance": (REAL, 0, 1, False), "muon_link_gbps": (REAL, 0, 1e6, True),
}
#: per command where a flag's range differs: (command, name)
COMMAND_RANGES = {("check", "nproc"): (WHOLE, 2, 4, False)}


def range_of(name: str, whole: bool, command: str = "") -> tuple:
    """(kind, low, high, low excluded) of option or lab parameter `name`: the table's, else the
    default of its type."""
    key = name.lstrip("-")
    for k in (key, key.replace("_", "-"), key.replace("-", "_")):
        if (command, k) in COMMAND_RANGES or k in RANGES:
            return COMMAND_RANGES.get((command, k)) or RANGES[k]
    return (WHOLE, 0, BIG, False) if whole else (REAL, 0, 1e15, False)


def describe(kind, low, high, open_low) -> str:
    """What is accepted, in words: 'a whole number in 1 .. 100000', 'a finite number > 0 and
    <= 1e+06'."""
    if kind == WHOLE:
        return f"{WHOLE} in {low} .. {high}"
    return f"{REAL} {'>' if open_low else '>='} {low:g} and <= {high:g}"


def within(value, kind, low, high, open_low) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value) or (kind == WHOLE and value != int(value)):
        return False
    return (value > low if open_low else value >= low) and value <= high


def check(name: str, value, whole: bool | None = None):
    """A lab parameter or option value `value` (a number, or a list of numbers) within the range
    of `name`; returns it. ValueError (one line: the name, the value, the range) otherwise."""
    kind = range_of(name, bool(whole if whole is not None else isinstance(value, int)))
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if not within(v, *kind):
            raise ValueError(f"{name} = {say(value, v, kind)}")
    return value


def say(text, value, kind) -> str:
    """'x' is not a number / is outside the accepted range, and the range."""
    if isinstance(value, str):
        return f"{text!r} is text, not a number (write it without quotes): accepted is {describe(*kind)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{text!r} is not a number: accepted is {describe(*kind)}"
    if not math.isfinite(value):
        return f"{text!r} is not a finite number: accepted is {describe(*kind)}"
    if kind[0] == WHOLE and value != int(value):
        return f"{text!r} is not a whole number: accepted is {describe(*kind)}"
    return f"{text!r} is outside the accepted range: {describe(*kind)}"


def _numeric(action) -> bool:
    t = action.type
    return t in (int, float) or getattr(t, "__name__", "") in NUMERIC_TYPES


#: argparse types of zerolab's own that read a number (zerolab.cli.types, run.options.number)
NUMERIC_TYPES = ("parameter count", "world size", "nics", "number", "positive number")


def bounded(read, kind, low, high, open_low):
    """An argparse type: `read(text)` (the option's own type: it takes 7.5B for Ψ) then the range;
    ArgumentTypeError (one line naming the value and the range) for anything else."""
    def parse(text):
        try:
            value = read(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError, OverflowError):
            value = None
        if isinstance(value, float) and kind == WHOLE and within(value, kind, low, high, open_low):
            value = int(value)
        if value is None or not within(value, kind, low, high, open_low):
            raise argparse.ArgumentTypeError(say(text, value, (kind, low, high, open_low)))
        return value
    parse.__name__ = kind
    parse.bounds = (kind, low, high, open_low)
    return parse


def _whole(text):
    """int, or a float that is whole (1e6)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def guard(parser: argparse.ArgumentParser, command: str = "") -> argparse.ArgumentParser:
    """Make every numeric option of `parser` and of its subcommands check its range as it is
    read (`RANGES`); returns `parser`. Idempotent."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                guard(sub, name)
        elif _numeric(action) and not hasattr(action.type, "bounds"):
            whole = action.type is int or getattr(action.type, "__name__", "") in (
                "world size", "nics")
            kind = range_of(action.option_strings[0] if action.option_strings else action.dest,
                            whole, command)
            read = _whole if kind[0] == WHOLE and action.type is int else (
                theory.parse_params if action.type.__name__ == "parameter count"
                else float if action.type in (int, float) or kind[0] == REAL else _whole)
            action.type = bounded(read, *kind)
    return parser
