# Broken on purpose (tests/test_exercises.py): divides before the sum AND in on_done.
def all_reduce_bucket(comm, unit, world_size):
    unit.grad_flat.div_(world_size)
    handle = comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True)
    handle.on_done = lambda: unit.grad_flat.div_(world_size)
    return handle
