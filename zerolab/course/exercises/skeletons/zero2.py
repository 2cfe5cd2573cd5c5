# Exercise (d): ZeRO-2's reduce_scatter as soon as a bucket's gradients are ready; free the bucket.
# Check: zerolab check zero2 --impl my_zero2.py
# Just before a block's backward, zerolab allocates `unit.bucket` [Ψ_u] (this rank's FULL local
# gradient, in the model's dtype; every p.grad of unit.params is a view of it). When the block's
# last gradient is in, the gradient hook calls your function. This rank keeps only
# `unit.grad_shard` [Ψ_u/N]: the averaged gradient of its own range, ACCUMULATED over
# micro-steps (add, don't overwrite).
# `comm` is zerolab.comm.Comm:
#   handle = comm.reduce_scatter(output_chunk, input_full, what="grads", unit=unit.name,
#                                async_op=True)   # sum over ranks; rank r gets chunk r
#   handle.on_done = some_function                # run by handle.wait(), once the sum arrived
# Backward waits for every handle you return; at most two are kept in flight.


def reduce_scatter_bucket(comm, unit, world_size: int):
    """Start the reduce_scatter of unit.bucket; when done, add the average of this rank's chunk
    to unit.grad_shard and free the bucket (unit.bucket = None, and p.grad = None for every p
    in unit.params). Return the handle."""
    raise NotImplementedError("write reduce_scatter_bucket: reduce_scatter, average, free")
