"""The schedule of one step, recorded from the strategy code itself: what the cost model replays.

Idea: the cost model (`costmodel.step_time`) must time the collectives zerolab's strategies
really issue - in their order, with their waits - not a second, hand-written copy of every
stage and variant. So it asks the code: `record(stage, n_blocks, has_root, **options)` builds the
strategy with `zerolab.variants.compose.make_strategy` (the class any run of these options gets) around a
skeleton model on the meta device (no memory, no arithmetic), runs two training steps through a
`RecordingComm` that moves nothing, and keeps the second (steady state: ZeRO-1/2's gathers
deferred to the next forward belong to it) as a list of events in the order they happened:

    ("compute", unit, "fwd" | "bwd")                the skeleton's unit `unit` computes here
    ("issue", id, op, what, unit, fraction, tier, parent, phase)
                                                    a collective starts: op, what it moves
                                                    ("grads", "params", "metric"), for which unit,
                                                    the fraction of the unit's elements its full
                                                    array holds (1: the whole unit; 1/k: HSDP's
                                                    node shard), the tier ("" the whole group,
                                                    "intra", "inter"), and the collective whose
                                                    completion issued it (HSDP's all_reduce after
                                                    its reduce_scatter) or None, and the
                                                    ledger's phase (forward, backward, step)
    ("wait", id)                                    the code waits for collective `id`

The skeleton is one parameter per unit (`units` elements each, padded as the strategy pads them)
in a model whose forward computes the blocks in order and then the root (head and loss), and
whose backward computes the root first and then the blocks in reverse - as a GPT does; each
compute is a custom autograd function that only appends its event, so the strategy's own hooks
(gather before a block, free after, a bucket's collective when its gradients are complete) fire
around it exactly as around a real block. The order of events does not depend on the units'
sizes, so a schedule is recorded once per (stage, blocks, root, options) and cached; the replay
puts sizes and compute seconds in (`costmodel.step_time`).

Left out of the events: the collectives of the guards (ZeRO-3's agreement check between ranks,
32 bytes a backward; the used-parameter flags of find_unused_parameters) and of the setup
(rank 0's weights): the training loop's checks, not the algorithm; `what == "metric"` records
other than the gradient norm's are dropped.
"""
from __future__ import annotations

import functools

import torch

from ..comm import Comm, Handle
from .. import theory

N_RECORD = 2                # ranks of the recorded world (hybrid: two nodes of k)


class RecordingComm(Comm):
    """A Comm over no process group: every collective is appended to `events` (and to the
    ledger, `records`) and completes at once; nothing moves. rank 0 of `world_size`; `ranks`:
    its members' global ranks; `node_comms(k)`: the intra / inter Comms of nodes of k
    (zerolab.variants.tiers.node_comms asks a parent that has it)."""

    def __init__(self, world_size: int, ranks=None, events=None, parent=None, tier=""):
        self.group, self.rank, self.world_size = None, 0, world_size
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(world_size))
        self.events = events if events is not None else []
        self.root = parent.root if parent is not None else self
        self.records = parent.records if parent is not None else []
        self.tier, self.children, self.backend, self.link = tier, [], "recording", None
        self._step, self._phase, self._pending, self.waiting = 0, "setup", [], []
        self.passes, self.parents = {0: 0}, {}

    def node_comms(self, k: int):
        """(intra, inter): rank 0's node (ranks 0..k-1) and its peers across nodes (0, k, ...)."""
        return (RecordingComm(k, range(k), self.events, self, "intra"),
                RecordingComm(self.world_size // k, range(0, self.world_size, k), self.events,
                              self, "inter"))

    def _issue(self, op, full, what, unit, async_op, call, post=None) -> Handle:
        record = self._record(op, full, what, unit)
        waiting = self.root.waiting
        self.events.append(["issue", len(self.events), op, what, unit, full.numel(), self.tier,
                            waiting[-1] if waiting else None, self.current_phase])
        handle = _Recorded(work=None, record=record, started=0.0, comm=None)
        handle.root, handle.id = self.root, self.events[-1][1]
        if not async_op:
            handle.wait()
        return handle

    def settle(self, block: bool = True):
        pass


class _Recorded(Handle):
    def wait(self):
        if self.done:
            return
        self.root.events.append(["wait", self.id])
        self.root.waiting.append(self.id)   # what on_done issues, this collective's end issued
        try:
            super().wait()
        finally:
            self.root.waiting.pop()


class _Unit(torch.nn.Module):
    def __init__(self, numel, events, name):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(numel, device="meta", dtype=torch.bfloat16))
        self.events, self.name = events, name

    def forward(self, x):
        return _Apply.apply(x, self.w, self.events, self.name)


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, events, name):
        ctx.events, ctx.name, ctx.shape = events, name, w.shape
        events.append(["compute", name, "fwd"])
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(["compute", ctx.name, "bwd"])
        return grad, torch.zeros(ctx.shape, device="meta", dtype=torch.bfloat16), None, None


class Skeleton(torch.nn.Module):
    """`n_blocks` blocks of one parameter each, and a root parameter used first (embedding) and
    last (head, whose compute is the root's), so its gradient is complete last."""

    def __init__(self, n_blocks: int, has_root: bool, numel: int, events: list):
        super().__init__()
        self.events = events
        self.blocks = torch.nn.ModuleList(_Unit(numel, events, f"block.{i}")
                                          for i in range(n_blocks))
        self.root = torch.nn.Parameter(torch.empty(numel, device="meta", dtype=torch.bfloat16)) \
            if has_root else None

    def zero_units(self):
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x, y):
        if self.root is not None:
            x = x * self.root[:1].sum()     # the embedding: no compute of its own here
        for b in self.blocks:
            x = b(x)
        if self.root is not None:           # head and loss: the root's compute
            x = _Apply.apply(x, self.root, self.events, "root")
        return x.sum()


@functools.lru_cache(maxsize=256)
def _record(stage: int, n_blocks: int, has_root: bool, options: tuple) -> tuple:
    from ..variants.compose import make_strategy          # (the lesson's door to every variant)
    opts = dict(options)
    k = opts.get("ranks_per_node")
    n = 2 * k if k else N_RECORD
    events: list = []
    comm = RecordingComm(n, events=events)
    model = Skeleton(n_blocks, has_root, n, events)
    strategy = make_strategy(stage, model, comm, **opts)
    x = torch.zeros(1, device="meta", dtype=torch.bfloat16, requires_grad=False)
    padded = {u.name: u.padded_numel for u in strategy.units}
    start = 0
    for step in range(2):
        comm.step = step
        start = len(events)
        strategy.backward(strategy.forward(x, x))
        strategy.step()
    stop = len(events)
    strategy.close()
    out = []
    for ev in events[start:stop]:
        if ev[0] == "issue":
            _, i, op, what, unit, numel, tier, parent, phase = ev
            if what == "metric" and unit != "grad_norm":
                continue                    # the guards' checks: not the algorithm
            ev = ("issue", i, op, what, unit, numel / padded[unit] if unit in padded else 0.0,
                  tier, parent, phase)
        out.append(tuple(ev))
    kept = {e[1] for e in out if e[0] == "issue"}
    return tuple(e for e in out if e[0] != "wait" or e[1] in kept)


def record(stage: int, n_blocks: int, has_root: bool = True, **options) -> tuple:
    """The events of one steady-state step of `stage` with `options` (zerolab.variants.compose's; hybrid
    needs ranks_per_node) on `n_blocks` blocks (and a root unit), as the module docstring says.
    Cached by its arguments."""
    return _record(theory.check_stage(stage), int(n_blocks), bool(has_root),
                   tuple(sorted(options.items())))
