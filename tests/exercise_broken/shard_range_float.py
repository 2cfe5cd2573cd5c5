# Broken on purpose (tests/test_exercises.py): true division gives floats.
def shard_range(numel, world_size, rank):
    shard = numel / world_size
    return rank * shard, (rank + 1) * shard
