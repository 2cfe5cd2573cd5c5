"""Training text that needs no download: byte-level tokens of the Python standard library's source.

Idea: every machine with Python has its standard library's `.py` files, written by many people
(none of them us). Their bytes, in sorted path order, are the corpus; the last 10 % is held out
for validation. `--data PATH` trains on any text file instead. Batches are drawn by a seeded
generator from (seed, step) alone, so every rank, and the single-process reference, sees the same
global batch; rank r then takes its own disjoint rows.

    python -m zerolab train --stage 0 --nproc 2 --data README.md
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4_000_000


def stdlib_text(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The first `max_bytes` bytes of the standard library's top-level `*.py` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        chunk = path.read_bytes()
        out.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def load_tokens(path: str | os.PathLike | None, block_size: int, val_fraction: float = 0.1):
    """(train, val) uint8 token tensors [n] from `path` (None: the standard library).

    Raises ValueError (one line, naming the path) when the file is missing, empty, or shorter
    than one context window plus one token in its training split.
    """
    if path is None:
        data = stdlib_text()
        where = "the standard library sources"
    else:
        p = Path(path)
        if not p.is_file():
            what = "is a directory, not a file" if p.is_dir() else "does not exist"
            raise ValueError(f"data file {str(path)!r} {what} (give a text file, or omit --data "
                             "to use the standard library sources)")
        data = p.read_bytes()
        where = repr(str(path))
        if not data:
            raise ValueError(f"data file {where} is empty (give a text file with at least "
                             f"{block_size + 2} bytes)")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if len(train) < block_size + 1:
        raise ValueError(f"data from {where} has {len(train)} training bytes, fewer than one context "
                         f"window of {block_size} + 1 tokens")
    if len(val) < block_size + 1:
        val = train
    return train, val


def get_batch(tokens: torch.Tensor, step: int, batch_size: int, block_size: int, seed: int = 0):
    """The global batch of `step`: (x, y) int64 [batch_size, block_size], y = x shifted by one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - block_size, (batch_size,), generator=g)
    # gather by index (a new tensor): slicing views would make MemTracker count the whole corpus
    rows = tokens[starts[:, None] + torch.arange(block_size + 1)].long()   # [B, T + 1]
    return rows[:, :-1], rows[:, 1:]


def rank_slice(batch: torch.Tensor, rank: int, world_size: int, micro: int = 0,
               grad_accum: int = 1) -> torch.Tensor:
    """Rows of `batch` [B, ...] for `rank`'s micro-step `micro`: B/(N·A) disjoint rows.

    Raises ValueError when B is not divisible by world_size × grad_accum.
    """
    B = batch.shape[0]
    if B % (world_size * grad_accum):
        raise ValueError(f"global batch {B} is not divisible by world_size {world_size} x "
                         f"grad_accum {grad_accum}")
    per = B // (world_size * grad_accum)
    start = (rank * grad_accum + micro) * per
    return batch[start:start + per]
