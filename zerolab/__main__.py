"""`python -m zerolab ...` is the `zerolab` command (zerolab.cli)."""
import sys

from .cli import main

sys.exit(main())
