"""When the loop's own `loss.backward()` begins and ends: the two moments a wrapper must act.

zerolab's strategies have `backward(loss)`, which does its set-up, calls `loss.backward()`, and
finishes (waits for the last bucket's collective, reduces buckets whose parameters got no
gradient). Behind torch's interfaces the loop calls `loss.backward()` itself, so the set-up runs
when the gradient of the wrapped module's output arrives (a tensor hook: FSDP2's root
pre-backward hook; torch DDP prepares in forward) and the finish is queued on autograd's engine
to run once the whole backward is done (`queue_callback`: torch DDP's and FSDP2's final
callback). Once per backward however many outputs the forward returned.
"""
from __future__ import annotations

import torch


def arm(output, begin, end):
    """Hook every tensor of `output` (a tensor, or a tuple / list / dict of them) that requires
    grad: when the first gradient arrives, call `begin()` and queue `end()` for the end of this
    backward. Returns `output` unchanged."""
    tensors = _tensors(output)
    if not tensors or not torch.is_grad_enabled():
        return output
    state = {"armed": False}

    def finish():
        state["armed"] = False
        end()

    def hook(grad):
        if not state["armed"]:
            state["armed"] = True
            begin()
            torch.autograd.Variable._execution_engine.queue_callback(finish)
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
        return tuple(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj
