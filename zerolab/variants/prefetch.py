"""When ZeRO-3 gathers: how many blocks ahead (prefetch depth), and whether the root waits.

Idea: zero3.py gathers a block just before it runs and, as soon as it is gathered, issues the
all_gather of the next block in the pass's order (forward order in forward, reverse in
backward), so that the gather runs while the current block computes: the same bytes, one more
gathered block alive. Two knobs change *when*, never what is moved:

- `PrefetchDepth` (--zero3-prefetch-depth k): k blocks ahead instead of one (k + 1 gathered
  blocks at the peak), -1 all the remaining blocks at once (FSDP's unlimited in-flight gathers),
  0 none (--no-zero3-prefetch: the notes' picture, one block gathered at a time, every gather on
  the critical path). It sets the depth that ZeRO3._ahead reads.
- `KeepRoot` (--zero3-keep-root): the root unit (tied embedding and head, position embedding,
  final norm) stays gathered from the end of forward into backward, whose first op needs it
  again: one all_gather fewer a step, the root's full weights held in between (FSDP2 keeps its
  root so). It overrides ZeRO3.reshard_after_forward.

Both are mixins over ZeRO3 and its subclasses (zerolab.variants.hybrid's HSDP, HpZ): `class X(PrefetchDepth,
ZeRO3)`; zerolab.variants.compose builds them.

    python -m zerolab train --stage 3 --zero3-prefetch-depth 2 --zero3-keep-root
"""
from __future__ import annotations

import torch

# Blocks gathered ahead by default: zero3.py's one. Chosen from measurements
# (tests/test_knobs.py, tests/test_linkemu.py, `zerolab bench`): on an emulated slow link (2 ranks,
# sleeping blocks) depth 0 / 1 / 2 / all took 275 / 183 / 187 / 179 ms a step for a gathered peak
# of root + 1 / 2 / 3 / all blocks; on 2 idle gloo CPU ranks (`small`) depth 1 took 176 ms
# against 192 ms. Depth 1 is the knee: almost all of the time for one block more. FSDP2 and
# DeepSpeed prefetch too.
DEFAULT_PREFETCH = 1


def check_depth(prefetch) -> int:
    """The depth of `prefetch` (True means 1, False 0); ValueError (one line) unless it is a bool,
    an int >= 0, or -1 (all remaining blocks)."""
    depth = int(prefetch) if isinstance(prefetch, bool) else prefetch
    if not isinstance(depth, int) or depth < -1:
        raise ValueError(f"prefetch {prefetch!r} must be a bool, a depth >= 0, or -1 (all)")
    return depth


class PrefetchDepth:
    """ZeRO-3 gathering `prefetch` blocks ahead (see `check_depth`); the other options are the
    strategy's. Attribute: prefetch (the depth)."""

    def __init__(self, model, comm, *, prefetch=DEFAULT_PREFETCH, **options):
        self.prefetch = check_depth(prefetch)
        super().__init__(model, comm, **options)


class KeepRoot:
    """ZeRO-3 whose root unit stays gathered from forward into backward (a forward without
    gradients still frees it: no backward follows)."""

    keep_root = True

    def reshard_after_forward(self, u) -> bool:
        if u.module is None:                # the root: kept when a backward follows
            return not torch.is_grad_enabled()
        return super().reshard_after_forward(u)
