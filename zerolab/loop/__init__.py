"""What a real training loop needs, below the stages: the lesson (and the folders above it)
imports these modules, and they import nothing else of zerolab.

    guards   what the loop may do to weights and gradients between forward, backward and step:
             rank 0's init taken in, zero_grad(set_to_none), edits adopted, placeholders that
             refuse sharded values (the frame and every stage call it)
    hooks    when a gradient is ready and when a block's backward begins and ends (autograd's
             hooks every strategy's backward runs on; sharding.py re-exports them)
    order    collectives issued in a different order on the ranks: found when a wait stalls by
             comparing the ranks' ledgers, stopped in one line on every rank (comm, strategy, zero3)
    leaves   leaf modules (a mixture of experts' layer): a group of blocks gathered and reduced as
             one unit, whatever order they run in (`zerolab.set_leaf_modules`)
    replicas the ranks start from the same weights: one all_reduce of an exact hash when an
             optimizer that keeps parameters replicated is built (the whole-matrix layouts,
             torchlike's), a one-line refusal on every rank when they differ

ZeRO-3's own part of a real loop (gathered(), checkpoints, skipped blocks) is zero3loop.py at the
top, a mixin of ZeRO3; a loop that steps its own torch optimizer gets variants/loopstep.py.
"""
