# Exercise (f): the process groups of a 2-D device mesh: TP x DP (notebook 09), HSDP (notebook 08).
# Check: zerolab check groups --impl my_groups.py
# 8 ranks, tp_size = 2, dp_size = 4: a TP group holds the ranks that split every weight of ONE
# model replica between them (they exchange activations in every layer, so they must sit on one
# node, on its fast links); a DP group holds the ranks that hold the SAME TP part of different
# replicas (ZeRO shards and averages along it: it takes one rank of every TP group).
# HSDP (FSDP's HYBRID_SHARD) on nodes of ranks_per_node ranks: a shard group is one node (the
# all_gathers and reduce_scatters of every block stay on its fast links); a replicate group takes
# the rank at the same position on every node (one all_reduce of each gradient shard a step).
# Return lists of lists of ranks (the order of the groups does not matter); raise ValueError when
# the group size does not divide world_size. torch's init_device_mesh builds the same layout.


def tp_dp_groups(world_size: int, tp_size: int):
    """(tp_groups, dp_groups) for world_size ranks in TP groups of tp_size: for 8 ranks and
    tp_size 2, four TP groups of 2 ranks and two DP groups of 4 ranks."""
    raise NotImplementedError("write tp_dp_groups: the TP groups, then the DP groups")


def hsdp_groups(world_size: int, ranks_per_node: int):
    """(shard_groups, replicate_groups) for world_size ranks on nodes of ranks_per_node ranks:
    shard within a node, replicate across nodes."""
    raise NotImplementedError("write hsdp_groups: the shard groups, then the replicate groups")
