# Wrong on purpose (tests/test_exercises_more.py): TP and DP swapped - a TP group takes every
# dp_size-th rank, so it spans several nodes.
def tp_dp_groups(world_size, tp_size):
    if world_size % tp_size:
        raise ValueError("does not divide")
    dp = world_size // tp_size
    return ([[d + k * dp for k in range(tp_size)] for d in range(dp)],
            [list(range(t * dp, (t + 1) * dp)) for t in range(tp_size)])


def hsdp_groups(world_size, ranks_per_node):
    from zerolab.theory import mesh_groups
    return mesh_groups(world_size, ranks_per_node)
