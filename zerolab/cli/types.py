"""argparse types for the numbers people type on the formula commands' lines (memory, time,
whatif): Ψ as 7.5e9 / 7.5B / 125M, a world size as 1024 or 1e6, NICs per node. Each refuses a
bad value in one line naming it and what is accepted (argparse prints it, exit 2)."""
from __future__ import annotations

import argparse

from .. import theory


def count(text):
    """An argparse type for Ψ as people write it (`theory.parse_params`: 7.5e9, 7.5B, 125M)."""
    try:
        return theory.parse_params(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


count.__name__ = "parameter count"


def ranks(text):
    """An argparse type for N as people write it: 1024 or 1e6 (a whole number, >= 1)."""
    try:
        n = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        n = None
    if n is None or n != n or n in (float("inf"), float("-inf")) or n != int(n) or n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks >= 1 (e.g. "
                                         f"1024 or 1e6)")
    return int(n)


ranks.__name__ = "world size"


def nics(text: str) -> int:
    """An argparse type for --nics-per-node: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of NICs per node >= 1 "
                                         "(default: one per GPU)")
    return n
