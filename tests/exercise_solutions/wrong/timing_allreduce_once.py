# Wrong on purpose (tests/test_exercises_more.py): all_reduce priced as one pass of the ring.
def ring_time(op, size_bytes, n, link):
    if n == 1:
        return 0.0
    factor = 1.0 if op == "broadcast" else (n - 1) / n
    return (n - 1) * link.latency + factor * size_bytes / link.bandwidth
