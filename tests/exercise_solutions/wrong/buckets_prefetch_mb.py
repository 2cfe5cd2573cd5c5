# Wrong on purpose (tests/test_exercises_more.py): the cap in 10**6 bytes, not MiB.
def ddp_buckets(block_numels, bucket_cap_mb, grad_bytes):
    if bucket_cap_mb is None:
        return [[i] for i in range(len(block_numels))]
    cap = max(1, int(bucket_cap_mb * 1e6 // grad_bytes))
    buckets, total = [], 0
    for i, numel in enumerate(block_numels):
        if buckets and total + numel <= cap:
            buckets[-1].append(i)
            total += numel
        else:
            buckets.append([i])
            total = numel
    return buckets


def zero3_gathered_peak(root_numel, block_numel, n_blocks, prefetch, param_bytes):
    held = n_blocks if prefetch < 0 else min(1 + prefetch, n_blocks)
    return (root_numel + held * block_numel) * param_bytes
