# Wrong on purpose (tests/test_exercises_more.py): depth p holds p blocks, not 1 + p.
from zerolab.course.exercises.more import ddp_buckets  # noqa: F401 - the right buckets


def zero3_gathered_peak(root_numel, block_numel, n_blocks, prefetch, param_bytes):
    held = n_blocks if prefetch < 0 else min(max(prefetch, 1), n_blocks)
    return (root_numel + held * block_numel) * param_bytes
