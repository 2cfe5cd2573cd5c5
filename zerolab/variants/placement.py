"""Where ZeRO-1/2 all_gather the updated weights: just before each block's next forward.

Idea: the notes' ZeRO-1 and ZeRO-2 end the step with one all_gather per unit (zero1.py,
zero2.py: `publish`), and nothing is left to compute while they run, so the step waits for all
of them. FSDP's SHARD_GRAD_OP gathers later instead: the step only writes this rank's range, and
each unit's all_gather starts just before the next forward needs it, one unit ahead, so that it
runs while the unit before computes. The bytes are the same (the ledger counts each gather in
the step whose update it carries), and so is the memory (the full bf16 weights stay resident).
In between, the other ranks' ranges of the weights are stale, so the parameters are
placeholders: a read raises one line, and `gathered()`, `full_parameters()`, an eval forward and
`close()` gather them first.

`Deferred` is that variant, a mixin over ZeRO1 / ZeRO2 (and their offloaded forms): it overrides
`publish` (the own range only), the end of the step (`publish_all`: every unit deferred) and
every reader of full weights. `GatherBeforeForward` is the mechanism: the forward hooks.

    python -m zerolab train --stage 2 --zero12-gather before_forward

The default stays the notes' (DEFAULT_GATHER, measured below).
"""
from __future__ import annotations

import torch

from ..loop.guards import is_placeholder

GATHER_MODES = ("after_step", "before_forward")
# The default, chosen from measurements (`python -m zerolab.course.gather_placement
# [--compute sleep]`: tiny, 2 gloo ranks, bf16, emulated link + 100 us, DDP / ZeRO-1 / ZeRO-2 in
# both modes interleaved round by round, before_forward / after_step paired per round, median).
# Compute slept (tiny's units and measured compute, so the 2-core machine's load cannot stretch
# it: communication runs beside compute, as NCCL beside a GPU's kernels): 0.1 Gb/s 0.919 (ZeRO-1)
# / 0.912 (ZeRO-2), i.e. ZeRO-2 1.141x -> 1.042x DDP, two thirds of its gap hidden; 1 Gb/s
# 0.970 / 0.949. The real tiny GPT on the shared 2-core CPU machine the labs run on (gloo's
# copies compete with compute for the cores), four runs of 80-200 rounds: 0.1 Gb/s 0.97-1.015 /
# 0.95-1.007, 1 Gb/s 1.025-1.061 / 0.985-1.041: no gain there, at times a loss. So the notes'
# picture stays the default (the weights stay readable between steps, as torch's DDP and
# ZeroRedundancyOptimizer keep them); before_forward is the choice beside a GPU on a slow link.
DEFAULT_GATHER = "after_step"


class GatherBeforeForward:
    """ZeRO-1/2 with gather="before_forward": the all_gather that brings the other ranks' updated
    ranges of a unit's weights is deferred from the end of the step to just before the unit's
    next forward, and issued one unit ahead, so that it runs while the unit before it computes
    (FSDP's SHARD_GRAD_OP; ZeRO-3's prefetch=1 without the free: the full weights stay resident).

    units: the strategy's units, root first, then blocks in forward order; issue(u): start u's
    all_gather of `u.param_flat` (async) and return its Handle; why: what a read of a weight
    says while its gather waits; is_placeholder: `guards.is_placeholder`.
    `defer()` (end of the step, this rank's range written): every unit waits for its gather and
    its parameters become placeholders, so a read raises `why` instead of returning the other
    ranks' ranges of the step before. The forward pre-hook of a unit's block (the model's own
    for the root unit) issues the gathers up to the unit after it and waits for its own;
    `complete()` issues and waits for all of them: at the end of every forward (blocks this rank
    skipped) and before anything reads full weights (the strategy's gathered(),
    full_parameters(), close()). Every rank issues them in unit order, whatever its forward
    does. A parameter given new data (`p.data = t`) meanwhile keeps t, as with the gather after
    the step. `cancel()`: every unit's full weights were written (a checkpoint was loaded).
    """

    def __init__(self, model, units, issue, why: str, is_placeholder):
        self.units, self.issue, self.why = list(units), issue, why
        self.is_placeholder = is_placeholder
        self.index = {id(u): i for i, u in enumerate(self.units)}
        self.issued = self.bound = len(self.units)   # units[:issued] issued, [:bound] bound
        self.inflight = []                           # Handles of units[bound:issued]
        self.hooks = [model.register_forward_hook(lambda *_: self.complete())]
        if self.units:
            self.hooks.append(model.register_forward_pre_hook(
                lambda *_: self.ready(self.units[0])))
        for u in self.units:
            self.hooks += [m.register_forward_pre_hook(lambda *_, u=u: self.ready(u))
                           for m in u.modules]

    @property
    def pending(self) -> bool:
        """True between `defer()` and the forward (or reader) that completed every gather."""
        return self.bound < len(self.units)

    def defer(self):
        for u in self.units:
            u.unbind_params(self.why)
        self.issued = self.bound = 0

    def ready(self, u):
        """`u`'s forward begins: issue the deferred gathers up to the unit after `u`, wait for
        those up to `u` and give their parameters their full weights back."""
        k = self.index[id(u)]
        while self.issued < min(k + 2, len(self.units)):
            self.inflight.append(self.issue(self.units[self.issued]))
            self.issued += 1
        while self.bound <= k:
            self.inflight.pop(0).wait()
            self._bind(self.units[self.bound])
            self.bound += 1

    def complete(self):
        if self.pending:
            self.ready(self.units[-1])

    def cancel(self):
        if self.inflight:
            raise RuntimeError("cancel() with all_gathers in flight (inside a forward)")
        for u in self.units[self.bound:]:
            self._bind(u)
        self.issued = self.bound = len(self.units)

    def _bind(self, u):
        # a parameter the loop gave new data (`p.data = t`) since the step keeps t, as with the
        # gather after the step: the next step takes t into the weights (guards.adopt_edits)
        with torch._C.DisableTorchFunctionSubclass():
            replaced = {i: p.data for i, p in enumerate(u.params) if not self.is_placeholder(p)}
        u.bind_params(u.param_flat)
        for i, t in replaced.items():
            u.params[i].data = t

    def close(self):
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


class Deferred:
    """ZeRO-1 / ZeRO-2 with gather="before_forward" (a mixin: `class X(Deferred, ZeRO2)`; the
    options are the stage's). Attributes: deferred (its GatherBeforeForward)."""

    gather = "before_forward"

    def __init__(self, model, comm, **options):
        super().__init__(model, comm, **options)
        self.stepped = None                 # the step whose update the deferred gathers carry
        why = (f"ZeRO-{self.stage} (gather='before_forward') gathers the other ranks' updated "
               "weights at the next forward: read or change them inside `with "
               "strategy.gathered():` (every rank)")
        self.deferred = GatherBeforeForward(model, self.units, self._issue, why, is_placeholder)

    def publish(self, u):                   # the own range only: its all_gather comes later
        self.write_own(u)

    def publish_all(self):
        super().publish_all()
        self.stepped = self.comm.step       # the other ranks' ranges arrive at the next forward
        self.deferred.defer()

    def _issue(self, u):
        handle = self.gather_update(u)
        handle.record.step = self.stepped   # counted in the step whose update it carries
        return handle

    def _complete(self):                    # every reader of full weights: gather them first
        if self.deferred.pending:
            with self.comm.phase("eval"):
                self.deferred.complete()

    def full_parameters(self):
        self._complete()
        return super().full_parameters()

    def unshard(self):                      # gathered(): the deferred gathers done first
        self._complete()
        super().unshard()

    def close(self):                        # the model keeps the full trained weights
        self.deferred.complete()
        self.deferred.close()
        super().close()

    def load_state(self, read, step: int):
        super().load_state(read, step)
        self.deferred.cancel()              # full weights written: nothing to gather

    def _adopt_edits(self):
        if not self.deferred.pending:       # placeholders: nothing the loop could have edited
            super()._adopt_edits()
