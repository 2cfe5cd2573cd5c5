# Broken on purpose (tests/test_exercises.py): adds the sum, never averages.
import torch


def reduce_scatter_bucket(comm, unit, world_size):
    out = torch.empty_like(unit.grad_shard)
    handle = comm.reduce_scatter(out, unit.bucket, what="grads", unit=unit.name, async_op=True)

    def done():
        unit.grad_shard.add_(out)
        unit.bucket = None
        for p in unit.params:
            p.grad = None
    handle.on_done = done
    return handle
