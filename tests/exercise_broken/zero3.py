# Broken on purpose (tests/test_exercises.py): gathers correctly but never frees.
from zerolab.sharding import alloc_storage


def gather_params(comm, unit):
    alloc_storage(unit.param_flat)
    comm.all_gather(unit.param_flat, unit.param_shard, what="params", unit=unit.name)


def free_params(unit):
    pass
