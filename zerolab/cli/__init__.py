"""The `zerolab` command (`python -m zerolab`): the door to everything else, above every wing.

`commands.py` holds its parser and one short function per subcommand; `parser.py` the parser's
classes (one-line errors, help), `types.py` the argument types.
"""
from .commands import build_parser, main

__all__ = ["build_parser", "main"]
