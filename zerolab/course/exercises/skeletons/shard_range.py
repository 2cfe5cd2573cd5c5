# Exercise (a): shard ranges with padding.  Check: zerolab check shard_range --impl my_shard_range.py
# A flat buffer of `numel` elements is padded with zeros to a multiple of N = world_size so that
# every rank owns an equal, contiguous range. Return rank `rank`'s range [start, stop) of the
# PADDED buffer. Examples: numel 10, N 4 -> ranks own (0, 3), (3, 6), (6, 9), (9, 12);
# numel 3, N 4 -> (0, 1), (1, 2), (2, 3), (3, 4) (rank 3 owns only padding).
# zerolab builds every flat bucket with your function (zerolab.sharding.FlatUnit).


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """numel >= 1, world_size >= 1, 0 <= rank < world_size -> (start, stop), ints."""
    raise NotImplementedError("write shard_range: the owned range of rank `rank`")
