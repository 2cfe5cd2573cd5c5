# Broken on purpose (tests/test_exercises.py): floor division, no padding (elements at the end
# belong to no rank).
def shard_range(numel, world_size, rank):
    shard = numel // world_size
    return rank * shard, (rank + 1) * shard
