# Broken on purpose (tests/test_exercises.py): an inclusive stop, one element short per rank.
def shard_range(numel, world_size, rank):
    shard = -(-numel // world_size)
    return rank * shard, (rank + 1) * shard - 1
