# Broken on purpose (tests/test_exercises.py): drops the tensor instead of freeing its memory.
from zerolab.sharding import alloc_storage


def gather_params(comm, unit):
    alloc_storage(unit.param_flat)
    comm.all_gather(unit.param_flat, unit.param_shard, what="params", unit=unit.name)


def free_params(unit):
    unit.param_flat = None
