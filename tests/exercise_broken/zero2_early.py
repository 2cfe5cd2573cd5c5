# Broken on purpose (tests/test_exercises.py): adds the chunk and frees right after starting the
# reduce_scatter, not in handle.on_done (the chunk has not arrived yet).
import torch


def reduce_scatter_bucket(comm, unit, world_size):
    out = torch.empty_like(unit.grad_shard)
    handle = comm.reduce_scatter(out, unit.bucket, what="grads", unit=unit.name, async_op=True)
    unit.grad_shard.add_(out / world_size)
    unit.bucket = None
    for p in unit.params:
        p.grad = None
    return handle
