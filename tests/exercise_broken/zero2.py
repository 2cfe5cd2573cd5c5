# Broken on purpose (tests/test_exercises.py): averages correctly but never frees the bucket.
import torch


def reduce_scatter_bucket(comm, unit, world_size):
    out = torch.empty_like(unit.grad_shard)
    handle = comm.reduce_scatter(out, unit.bucket, what="grads", unit=unit.name, async_op=True)
    handle.on_done = lambda: unit.grad_shard.add_(out.div_(world_size))
    return handle
