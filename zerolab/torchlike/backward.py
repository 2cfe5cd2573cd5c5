"""When the loop's own `loss.backward()` begins and ends: the two moments a wrapper must act.

zerolab's strategies have `backward(loss)`, which does its set-up, calls `loss.backward()`, and
finishes (waits for the last bucket's collective, reduces buckets whose parameters got no
gradient). Behind torch's interfaces the loop calls `loss.backward()` itself, so the set-up runs
when the backward first reaches the wrapped model and the finish is queued on autograd's engine
to run once the whole backward is done (`queue_callback`: torch DDP's and FSDP2's final
callback). `Backward` is that pair for one wrapped model: `arm(output)` hooks the gradient of the
model's outputs (FSDP2's root pre-backward hook; torch DDP prepares in forward), and `enter()` is
what any other hook calls that can run first - FSDP2 lets whichever module's pre-backward hook
fires first do the root's set-up: when the model returns a sharded block's output directly
(`return self.head(x)`), the block's hook on that tensor was registered before the root's.
Once per backward however many outputs, and however many forwards, it runs through.
"""
from __future__ import annotations

import torch

_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_backward() -> bool:
    """True while autograd's engine runs a backward in this thread."""
    return _task() != -1


class Backward:
    """begin(*args) when a backward first reaches the model, end() at that backward's end.

    `arm(output, *args)` hooks every tensor of `output` (a tensor, or a tuple / list / dict of
    them) that requires grad: the first gradient to arrive calls `enter(*args)`. `enter` calls
    `begin(*args)` and queues `end()` on autograd's engine, once per backward: further calls
    until that backward has ended do nothing. `reset()` (the next forward outside a backward)
    forgets a backward that raised before its end ran."""

    def __init__(self, begin, end):
        self.begin, self.end, self.active = begin, end, False

    def enter(self, *args):
        if self.active:
            return
        self.active = True
        try:
            self.begin(*args)
        except BaseException:
            self.active = False
            raise
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self):
        self.active = False
        self.end()

    def reset(self):
        if not in_backward():
            self.active = False

    def arm(self, output, *args):
        """Returns `output` unchanged."""
        tensors = _tensors(output)
        if not tensors or not torch.is_grad_enabled():
            return output

        def hook(grad):
            self.enter(*args)
            return grad
        for t in tensors:
            t.register_hook(hook)
        return output


def _tensors(output) -> list:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    return []


def cast_floats(obj, dtype):
    """`obj` (tensors in tuples / lists / dicts) with every floating tensor cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        items = [cast_floats(o, dtype) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)   # namedtuple
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def not_picklable(wrapper: str, instead: str) -> str:
    """The one line refusing torch.save(model) / pickle / copy.deepcopy of a wrapped model."""
    return (f"a {wrapper} model cannot be pickled whole (torch.save(model), copy.deepcopy): it "
            "holds this rank's process group and its gradient hooks; save its weights instead, "
            f"torch.save({instead}, path), and load them into a model built and wrapped again")
