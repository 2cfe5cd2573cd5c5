# Broken on purpose (tests/test_exercises.py): torch.chunk-like, the last rank takes the remainder.
def shard_range(numel, world_size, rank):
    shard = numel // world_size
    return rank * shard, numel if rank == world_size - 1 else (rank + 1) * shard
