# Broken on purpose (tests/test_exercises.py): returns (start, length) instead of (start, stop).
def shard_range(numel, world_size, rank):
    shard = -(-numel // world_size)
    return rank * shard, shard
