# Wrong on purpose (tests/test_exercises_more.py): the TP groups are right, but the DP groups are
# blocks of consecutive ranks too, so a DP group holds both ranks of a TP group.
def tp_dp_groups(world_size, tp_size):
    if world_size % tp_size:
        raise ValueError("does not divide")
    dp = world_size // tp_size
    return ([list(range(s, s + tp_size)) for s in range(0, world_size, tp_size)],
            [list(range(s, s + dp)) for s in range(0, world_size, dp)])


def hsdp_groups(world_size, ranks_per_node):
    from zerolab.theory import mesh_groups
    return mesh_groups(world_size, ranks_per_node)
