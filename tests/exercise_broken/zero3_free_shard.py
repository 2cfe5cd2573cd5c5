# Broken on purpose (tests/test_exercises.py): frees the shard instead of the gathered weights.
from zerolab.sharding import alloc_storage, free_storage


def gather_params(comm, unit):
    alloc_storage(unit.param_flat)
    comm.all_gather(unit.param_flat, unit.param_shard, what="params", unit=unit.name)


def free_params(unit):
    free_storage(unit.param_shard)
