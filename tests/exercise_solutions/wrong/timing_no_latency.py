# Wrong on purpose (tests/test_exercises_more.py): the bytes over the bandwidth, no latency.
from zerolab.theory import RING_FACTOR


def ring_time(op, size_bytes, n, link):
    return 0.0 if n == 1 else RING_FACTOR[op](n) * size_bytes / link.bandwidth
