# Broken on purpose (tests/test_exercises.py): the wrong reduction (max instead of sum).
def all_reduce_bucket(comm, unit, world_size):
    handle = comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True, op="max")
    handle.on_done = lambda: unit.grad_flat.div_(world_size)
    return handle
