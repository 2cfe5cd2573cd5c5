# Broken on purpose (tests/test_exercises.py): gathers from this rank's range of the freed
# unit.param_flat instead of unit.param_shard.
from zerolab.sharding import alloc_storage, free_storage


def gather_params(comm, unit):
    alloc_storage(unit.param_flat)
    comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params", unit=unit.name)


def free_params(unit):
    free_storage(unit.param_flat)
