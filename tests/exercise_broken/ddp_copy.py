# Broken on purpose (tests/test_exercises.py): all_reduces a copy of the bucket.
def all_reduce_bucket(comm, unit, world_size):
    grads = unit.grad_flat.clone()
    handle = comm.all_reduce(grads, what="grads", unit=unit.name, async_op=True)
    handle.on_done = lambda: grads.div_(world_size)
    return handle
