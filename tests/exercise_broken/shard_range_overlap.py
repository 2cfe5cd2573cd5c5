# Broken on purpose (tests/test_exercises.py): starts at the floor, stops a ceil later: overlaps.
import math


def shard_range(numel, world_size, rank):
    start = rank * (numel // world_size)
    return start, start + math.ceil(numel / world_size)
