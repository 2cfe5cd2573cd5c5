"""One ledger per model: the Comms that separate fully_shard calls made merge into the root's.

FSDP2's calls are made bottom-up, each before the model's root exists: a block's call broadcasts
rank 0's weights through a Comm of its own (`LedgerComm`), and its siblings' calls through
theirs. The root's call moves every one of those records into the Comm it keeps (`one_ledger`),
in the order they were issued in this process, so `model.comm.records` holds every collective
of the model from its first broadcast on, and every block's `.comm` is that Comm.
"""
from __future__ import annotations

import itertools

from ..comm import Comm

_ORDER = itertools.count()


class LedgerComm(Comm):
    """A Comm that fully_shard made itself: each record stamped with its place in this process's
    order of issue, so that the ledgers of separate calls (sibling blocks) merge into the
    root's in the order their collectives ran (`one_ledger`)."""

    def _record(self, *args, **kwargs):
        record = super()._record(*args, **kwargs)
        record._zerolab_order = next(_ORDER)
        return record


def one_ledger(target, comms):
    """Move the records of every Comm of `comms` into `target`'s ledger (by order of issue;
    after target's own when target is the loop's Comm), renumbered; those Comms then write
    there too. ValueError (one line) for two Comms the loop gave."""
    others = [c for c in dict.fromkeys(comms) if c is not target]
    if not others:
        return
    if any(not isinstance(c, LedgerComm) for c in others):
        raise ValueError("the fully_shard calls of one model were given different comm=: pass one "
                         "Comm (or none) to every call, so that one ledger holds every collective")
    order = lambda r: getattr(r, "_zerolab_order", -1)     # noqa: E731
    for c in others:
        c.settle()                          # their durations, before they leave their Comm
    moved = sorted((r for c in others for r in c.records), key=order)
    records = (sorted(target.records + moved, key=order) if isinstance(target, LedgerComm)
               else target.records + moved)
    target.records[:] = records
    for i, r in enumerate(target.records):
        r.seq = i
    for c in others:
        c.records = target.records
