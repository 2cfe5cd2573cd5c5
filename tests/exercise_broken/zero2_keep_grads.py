# Broken on purpose (tests/test_exercises.py): drops unit.bucket but not the p.grad views of it.
import torch


def reduce_scatter_bucket(comm, unit, world_size):
    out = torch.empty_like(unit.grad_shard)
    handle = comm.reduce_scatter(out, unit.bucket, what="grads", unit=unit.name, async_op=True)

    def done():
        unit.grad_shard.add_(out / world_size)
        unit.bucket = None
    handle.on_done = done
    return handle
