# Broken on purpose (tests/test_exercises.py): the last rank's range stops at numel, no padding.
def shard_range(numel, world_size, rank):
    shard = -(-numel // world_size)
    return min(rank * shard, numel), min((rank + 1) * shard, numel)
