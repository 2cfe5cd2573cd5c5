"""ZeRO-1 with a reduce_scatter of the gradients instead of the notes' all_reduce.

Idea: ZeRO-1's update reads only the averaged gradient of this rank's own range, yet the notes'
ZeRO-1 all-reduces the whole gradient, 2(n-1)/n·2Ψ bytes, before the all_gather's (n-1)/n·2Ψ:
3(n-1)/n·2Ψ a step. A reduce_scatter leaves each rank the average of just its range for half the
all_reduce's bytes, so the step moves 2(n-1)/n·2Ψ, ZeRO-2's traffic, while the full gradient
buffer stays (ZeRO-1's memory: what ZeRO-2 adds is freeing it). llm.c's ZeRO-1 does this.

What changes against zero1.py (`ReduceScatterZeRO1` overrides four methods): the collective of
a ready bucket (`_grads_ready`: in place, the owned range receives the sum of everyone's range);
after a synchronising backward the rest of the buffer holds this rank's own unreduced gradient,
so every p.grad becomes a placeholder (`synced`: `guards.shard_grads`), restored after the step
(`consumed`); and a second synchronising backward before the step turns the averaged range
back into a sum and the stale rest into zeros, so that it accumulates (`claim`).

    python -m zerolab train --stage 1 --zero1-grad-op reduce_scatter
"""
from __future__ import annotations

from ..loop.guards import claim_grads, shard_grads
from ..zero1 import ZeRO1


class ReduceScatterZeRO1(ZeRO1):
    """ZeRO-1 whose gradient collective is a reduce_scatter (the options are ZeRO1's)."""

    grad_op = "reduce_scatter"

    def hold(self, u):
        super().hold(u)
        u.averaged = False          # reduce_scatter done: own range averaged, the rest stale

    def claim(self, u):
        if u.averaged:              # a second synchronised backward before the step:
            u.own(u.grad_flat).mul_(self.n)                 # own range back to a sum, the rest 0
            u.grad_flat[:u.start].zero_()
            u.grad_flat[u.start + u.shard_numel:].zero_()
            u.averaged = False
        super().claim(u)

    def _grads_ready(self, u):
        if not self.sync:
            return
        # in place: the owned range of grad_flat receives the sum of everyone's range
        handle = self.comm.reduce_scatter(u.own(u.grad_flat), u.grad_flat, what="grads",
                                          unit=u.name, async_op=True)
        handle.on_done = lambda: u.own(u.grad_flat).div_(self.n)     # sum -> average
        u.averaged = True
        self.inflight.append(handle)
        self._sample(f"reduce_scatter {u.name}")

    def synced(self):                       # only the own range is averaged now
        shard_grads(self.units, "ZeRO-1 with grad_op='reduce_scatter'")

    def consumed(self, u):
        super().consumed(u)
        u.averaged = False
        claim_grads(u, u.grad_flat)         # p.grad: the view again (the placeholders go)
