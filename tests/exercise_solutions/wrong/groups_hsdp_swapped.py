# Wrong on purpose (tests/test_exercises_more.py): HSDP's groups swapped - shard across the nodes,
# replicate within one.
from zerolab.theory import mesh_groups


def tp_dp_groups(world_size, tp_size):
    return mesh_groups(world_size, tp_size)


def hsdp_groups(world_size, ranks_per_node):
    rows, columns = mesh_groups(world_size, ranks_per_node)
    return columns, rows
