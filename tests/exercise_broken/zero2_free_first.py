# Broken on purpose (tests/test_exercises.py): frees the bucket before the reduce_scatter read it.
import torch


def reduce_scatter_bucket(comm, unit, world_size):
    out = torch.empty_like(unit.grad_shard)
    unit.bucket = None
    for p in unit.params:
        p.grad = None
    handle = comm.reduce_scatter(out, unit.bucket, what="grads", unit=unit.name, async_op=True)
    handle.on_done = lambda: unit.grad_shard.add_(out / world_size)
    return handle
