"""The `zerolab` command's parser classes: help that names each default once, and a bad command
line told in one line (exit 2) with the closest flag when one is misspelled.
"""
from __future__ import annotations

import argparse
import difflib
import re


class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" once: not when the help text already names its default, and not
    for on/off flags (their default is always off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or isinstance(action, argparse._StoreTrueAction):
            return text
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse with a bad command line told in one line, exit 2 (not the usage block): the
    bad value and what is accepted, and for a misspelled flag the closest one
    (`zerolab train --stgae 3` -> "did you mean --stage?")."""

    others: dict = {}       # flag -> the commands that have it (filled by the top parser)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but a flag the chosen command lacks is told by that command's parser,
        which suggests one of its own flags (the top parser would suggest any command's)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            subs = self._subcommands()
            sub = subs.get(getattr(ns, "command", None), self)
            sub.others = {f: [n for n, s in subs.items() if f in s._flags()]
                          for s in subs.values() for f in s._flags()}
            sub.error("unrecognized arguments: " + " ".join(extras))
        return ns

    def error(self, message):
        hint = ""
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1).split("=")[0]
            close = difflib.get_close_matches(flag, self._flags(), n=1)
            if flag in self.others and flag not in self._flags():
                hint = f" ({flag} is an option of zerolab {' / '.join(self.others[flag])}, not of {self.prog})"
            elif close:
                hint = f" (did you mean {close[0]}?)"
        self.exit(2, f"{self.prog}: error: {message}{hint}; see {self.prog} --help\n")

    def _subcommands(self) -> dict:
        return {name: sub for a in self._actions if isinstance(a, argparse._SubParsersAction)
                for name, sub in a.choices.items()}

    def _flags(self) -> list[str]:
        return [f for a in self._actions for f in a.option_strings]
