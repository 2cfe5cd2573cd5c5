# Broken on purpose (tests/test_exercises.py): sums the gradients but never averages them.
def all_reduce_bucket(comm, unit, world_size):
    return comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True)
