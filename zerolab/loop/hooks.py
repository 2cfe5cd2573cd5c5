"""When gradients are ready, and when a module's backward begins and ends: the hooks every
strategy's backward runs on.

Idea: a strategy communicates during backward, so it must know *when* - when each unit's
gradients are all accumulated (`GradReady`, a post-accumulate-grad hook per parameter, callbacks
in one fixed order on every rank), when a block's backward is about to begin (`on_pre_backward`,
a hook on the gradient of the block's output: ZeRO-2 opens a bucket, ZeRO-3 gathers the weights)
and when it has ended (`on_post_backward`, an autograd node on the block's inputs: ZeRO-3 counts
the block's forward calls down). FSDP2's pre-/post-backward hooks and final callback are the
model. `zerolab.sharding` re-exports them.
"""
from __future__ import annotations

import functools

import torch


class GradReady:
    """Call `callback(unit)` once per backward for every unit, in one fixed order on every rank.

    A unit is ready when each of its parameters has accumulated its gradient (a post-accumulate
    -grad hook per parameter). Callbacks run in torch DDP's bucket order - blocks in reverse
    forward order, the root unit last - so every rank issues its collectives in the same order
    even when a parameter gets no gradient on some rank (unused, a branch not taken, frozen
    later): such a unit, and the ones after it, wait for `finish()` (end of backward: every
    unit not yet ready is taken as ready) or `flush_before(unit)` (ZeRO-3: a unit's backward
    starts, so the units after it in forward order whose forward calls have all finished their
    backward are done). Without this a unit's hook never
    fires and its gradients are never reduced: ranks drift apart in silence.
    A gradient that arrives for a unit already handed to `callback` raises RuntimeError naming
    the parameter (it is used outside its unit's module). `close()` removes the hooks.
    """

    def __init__(self, units: list, callback):
        self.units, self.callback = units, callback
        self.order = list(reversed(units))      # units: root first, then blocks in forward order
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u, i))
                        for u in units for i, p in enumerate(u.params)]
        self.start()

    def start(self):
        """Call before each backward."""
        self.next = 0
        for u in self.units:
            u.got, u.is_ready, u.reduced = [False] * len(u.params), False, False

    def _on_grad(self, u, i, p):
        if u.reduced:
            raise RuntimeError(f"parameter {u.names[i]} got its gradient after unit {u.name} was "
                               "reduced: it is used outside that unit's module")
        if u.grad_views is not None and p.grad is not None:   # fp32 grads of bf16 weights
            u.grad_views[i].add_(p.grad)
            p.grad = None
        u.got[i] = u.used[i] = True
        if all(u.got):
            u.is_ready = True
            self._advance()

    def _advance(self):
        while self.next < len(self.order) and self.order[self.next].is_ready:
            u = self.order[self.next]
            self.next += 1
            u.reduced = True
            self.callback(u)

    def flush_before(self, unit):
        """`unit`'s backward begins: every unit before it in the order whose forward calls have
        all finished their backward (`u.pending == 0`, ZeRO-3 counts them) is done. A unit
        still pending (called in a second forward whose backward has not reached it yet) waits
        for its gradients or for `finish()`."""
        for u in self.order[:self.order.index(unit)]:
            if not getattr(u, "pending", 0):
                u.is_ready = True
        self._advance()

    def finish(self):
        """End of backward: units whose parameters got no gradient are ready too."""
        for u in self.order:
            u.is_ready = True
        self._advance()

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


def on_grads_ready(units: list, callback) -> GradReady:
    """`GradReady(units, callback)`: callback(unit) once per backward per unit, in one order."""
    return GradReady(units, callback)


def on_pre_backward(module: torch.nn.Module, callback):
    """Call `callback()` when the gradient of `module`'s output arrives, i.e. just before the
    module's own backward runs (FSDP's pre-backward hook). Output: a tensor or tuple of them.
    Returns a handle whose remove() takes away the forward hook and drops `callback` from the
    gradient hooks already put on output tensors (a memory tracker, say, may keep those tensors
    alive: they must not keep the strategy alive with them)."""
    box = [callback]

    def forward_hook(mod, args, output):
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = []
        for t in tensors:
            def grad_hook(grad):
                if not fired and box[0] is not None:
                    fired.append(True)
                    box[0]()
                return grad
            t.register_hook(grad_hook)
    return _PreBackwardHandle(module.register_forward_hook(forward_hook), box)


def on_post_backward(args: tuple, callback) -> tuple:
    """`args` with every tensor that requires grad passed through an autograd node that calls
    `callback()` when their gradients are computed, i.e. when the backward of the module that
    receives them is done (FSDP2's RegisterPostBackwardFunction). Once per call, however many
    tensors; never when no tensor of `args` requires grad (the caller then waits for the end of
    backward)."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not idx or not torch.is_grad_enabled():
        return args
    outs = _PostBackward.apply(callback, *(args[i] for i in idx))
    outs = outs if isinstance(outs, tuple) else (outs,)
    new = list(args)
    for i, t in zip(idx, outs):
        new[i] = t
    return tuple(new)


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        outs = tuple(t.view_as(t) for t in tensors)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        if ctx.callback is not None:
            ctx.callback()
            ctx.callback = None
        return (None, *grads)


class _PreBackwardHandle:
    def __init__(self, handle, box):
        self.handle, self.box = handle, box

    def remove(self):
        self.handle.remove()
        self.box[0] = None
