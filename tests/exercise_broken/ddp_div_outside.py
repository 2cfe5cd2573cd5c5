# Broken on purpose (tests/test_exercises.py): divides while the all_reduce is in flight (not in
# handle.on_done).
def all_reduce_bucket(comm, unit, world_size):
    handle = comm.all_reduce(unit.grad_flat, what="grads", unit=unit.name, async_op=True)
    unit.grad_flat.div_(world_size)
    return handle
