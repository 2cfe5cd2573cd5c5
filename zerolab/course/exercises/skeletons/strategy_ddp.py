# Track (i), optional: write DDP yourself - gradient buckets, each all-reduced from a hook while
# backward is still running on the earlier layers.
# Check: zerolab check strategy_ddp --impl my_strategy_ddp.py
# The check builds `ddp = BucketedDDP(model, comm, bucket_cap_mb)` once on every rank, then for
# each step runs (plain torch otherwise; the model and the batches are the same on every rank):
#     for p in params: p.grad = None            # zero_grad(set_to_none=True)
#     loss = model(x_mine, y_mine)              # this rank's rows of the global batch
#     loss.backward()                           # your hooks start the all_reduces in here
#     ddp.finish()                              # you wait: every p.grad = the ranks' average
#     torch.nn.utils.clip_grad_norm_(params, 0.5); AdamW step (torch's, on every rank)
# Tools: p.register_post_accumulate_grad_hook(fn) calls fn(p) when p.grad is complete in a
# backward. `comm` is zerolab.comm.Comm (its ledger counts your bytes; the timing part puts an
# emulated network link under it):
#     handle = comm.all_reduce(tensor, what="grads", unit="bucket 0", async_op=True)  # sums, in place
#     handle.wait()                             # the sum has arrived in `tensor`
#     comm.world_size, comm.rank
# Graded: parameters equal to single-process AdamW, the bytes sent (each gradient once), buckets
# of at most bucket_cap_mb, every all_reduce issued during loss.backward(), and the time of
# backward + finish() on the emulated link: overlap must hide communication behind backward.
import torch  # noqa: F401 - for your code


class BucketedDDP:
    def __init__(self, model, comm, bucket_cap_mb: float):
        """Split model's trainable parameters into buckets of at most bucket_cap_mb MiB (2**20
        bytes) of gradients (a parameter larger than that alone), in the order backward makes
        their gradients (roughly the reverse of model.parameters()), and hook every parameter."""
        raise NotImplementedError("write __init__: buckets and hooks")

    def finish(self):
        """After loss.backward(): wait for every all_reduce it started; leave in every p.grad
        the average of the ranks' gradients; get ready for the next backward."""
        raise NotImplementedError("write finish: wait, average, write back")
