# Exercise (b): DDP's bucketed all_reduce, started from a gradient hook.
# Check: zerolab check ddp --impl my_ddp.py
# zerolab.sharding.on_grads_ready registers a post-accumulate-grad hook on every parameter; when
# the last gradient of a bucket (`unit`) has been accumulated, the hook calls your function while
# backward is still running on the earlier layers. `unit.grad_flat` [Ψ_u] is the bucket: every
# parameter's .grad is a view of it. `comm` is zerolab.comm.Comm:
#   handle = comm.all_reduce(tensor, what="grads", unit=unit.name, async_op=True)   # sums in place
#   handle.on_done = some_function     # run by handle.wait(), after the sum has arrived
# Backward waits for every handle you return before the optimizer step.


def all_reduce_bucket(comm, unit, world_size: int):
    """Start the all_reduce of this bucket so that, once waited for, unit.grad_flat holds the
    AVERAGE of the ranks' gradients. Return the handle."""
    raise NotImplementedError("write all_reduce_bucket: all_reduce unit.grad_flat, then average")
