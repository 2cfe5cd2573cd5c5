# Exercise (c): ZeRO-1's step: update your own range, then all_gather.
# Check: zerolab check zero1 --impl my_zero1.py
# After backward, `unit.grad_flat` [Ψ_u] holds the averaged full gradient on every rank (DDP's
# all_reduce). This rank keeps fp32 master weights (and AdamW's exp_avg / exp_avg_sq) only for
# its own range: `unit.master` [Ψ_u/N] fp32. `unit.own(t)` is the view of t [Ψ_u] that this rank
# owns. zerolab's step (ZeRO1.update, zerolab/zero1.py) does, for every unit:
#     unit.master.grad = own_gradient(unit)        # YOUR FUNCTION 1
#     ... clip the global norm, torch's AdamW.step() on the master shards ...
#     handle = publish_update(comm, unit)          # YOUR FUNCTION 2; the step waits for it
# `comm` is zerolab.comm.Comm:
#   handle = comm.all_gather(output_full, input_chunk, what="params", unit=unit.name, async_op=True)
# concatenates every rank's input_chunk [Ψ_u/N] into output_full [Ψ_u] (rank order).


def own_gradient(unit):
    """fp32 [Ψ_u/N]: the averaged gradient of this rank's range (a new tensor)."""
    raise NotImplementedError("write own_gradient: this rank's range of unit.grad_flat, as fp32")


def publish_update(comm, unit):
    """Put the updated unit.master into this rank's range of the weights unit.param_flat
    [Ψ_u], then start the all_gather that gives every rank every updated range. Return it."""
    raise NotImplementedError("write publish_update: copy the master shard in, then all_gather")
