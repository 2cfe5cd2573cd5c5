# Wrong on purpose (tests/test_exercises_more.py): the buckets are right; the peak forgets the
# root unit, which stays gathered for the whole pass.
from zerolab.course.exercises.more import ddp_buckets  # noqa: F401 - the right buckets


def zero3_gathered_peak(root_numel, block_numel, n_blocks, prefetch, param_bytes):
    held = n_blocks if prefetch < 0 else min(1 + prefetch, n_blocks)
    return held * block_numel * param_bytes
