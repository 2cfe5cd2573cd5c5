# Broken on purpose (tests/test_exercises.py): gathers into unit.param_flat without giving it
# its memory back.
from zerolab.sharding import free_storage


def gather_params(comm, unit):
    comm.all_gather(unit.param_flat, unit.param_shard, what="params", unit=unit.name)


def free_params(unit):
    free_storage(unit.param_flat)
