"""torch's AdamW on flat buffers, with parameter groups and per-parameter state, as torch has them.

Idea: every strategy keeps one fp32 master buffer per unit (the whole unit for DDP, this rank's
range for ZeRO-1/2/3). A per-parameter optimizer treats parameters one by one in two ways that a
flat buffer must not blur:

- parameter groups: the GPT-2 / nanoGPT recipe decays 2-D weights but not biases or LayerNorm
  weights (`sharding.decays`). On a flat buffer this is a per-element decay mask; since each
  parameter occupies one contiguous range of it, the mask is stored as those ranges
  (`FlatUnit.segments`) with a decay flag each, which costs no memory and keeps the flat layout
  (and checkpoints written against it) unchanged;
- a parameter whose gradient is None for a whole step (used nowhere, a branch no rank took,
  frozen after the optimizer was built): torch.optim.AdamW skips it entirely - no weight decay,
  no exp_avg / exp_avg_sq update, and its own `step` count stays where it is.

`FlatAdamW.step(used)` therefore calls torch's own AdamW arithmetic
(`torch.optim.adamw.adamw`, the function torch.optim.AdamW.step runs) on per-parameter *views*
of the flat master, gradient, exp_avg and exp_avg_sq buffers, once for the decayed parameters
and once for the others, skipping the parameters that `used` marks False. The state stays flat:
`state[master] = {"exp_avg": [M] fp32, "exp_avg_sq": [M] fp32, "step": [P] fp32}`, with one step
count per parameter of the unit (P of them), as torch keeps one per parameter. A scalar "step"
(what zerolab.run.checkpoint restores) is taken as the count of every parameter.
"""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw


class FlatAdamW(torch.optim.AdamW):
    """AdamW over flat fp32 master buffers `masters` ([M_k] each), where master k holds the
    parameters at `segments[k]` = [(lo, hi), ...] (element ranges; hi <= lo: not held here)
    with `decay[k]` = [bool, ...] (weight decay or not). lr, betas, eps, weight_decay: torch's.
    """

    def __init__(self, masters, segments, decay, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1):
        super().__init__(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.segments = [list(zip(s, d)) for s, d in zip(segments, decay)]

    @torch.no_grad()
    def step(self, used=None):
        """One update. used: [[bool per parameter] per master] (None: all); a parameter marked
        False is left exactly as torch.optim.AdamW leaves a parameter whose grad is None."""
        group = self.param_groups[0]
        views = {True: ([], [], [], [], []), False: ([], [], [], [], [])}   # by decay flag
        for k, m in enumerate(group["params"]):
            if m.grad is None:
                continue
            state = self.state[m]
            if not state:                       # lazily, like torch: exp_avg appear at step 1
                state["step"] = torch.zeros(len(self.segments[k]), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            if state["step"].dim() == 0:        # one count for all (a resumed checkpoint's)
                state["step"] = state["step"].float().expand(len(self.segments[k])).clone()
            for j, ((lo, hi), decay) in enumerate(self.segments[k]):
                if hi <= lo or (used is not None and not used[k][j]):
                    continue
                for out, t in zip(views[decay], (m, m.grad, state["exp_avg"],
                                                 state["exp_avg_sq"])):
                    out.append(t[lo:hi])
                views[decay][4].append(state["step"][j])      # 0-d view: adamw adds 1 in place
        beta1, beta2 = group["betas"]
        for decay, (params, grads, exp_avgs, exp_avg_sqs, steps) in views.items():
            if params:
                adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None,
                      amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"] if decay else 0.0, eps=group["eps"],
                      maximize=False)


def make_flat_optimizer(units, sharded: bool, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                        weight_decay=0.1) -> FlatAdamW:
    """FlatAdamW over `units`' fp32 masters (`u.master`), grouped as `sharding.decays` says."""
    return FlatAdamW([u.master for u in units], [u.segments(sharded) for u in units],
                     [u.decay for u in units], lr=lr, betas=betas, eps=eps,
                     weight_decay=weight_decay)


# --- any torch optimizer on flat shards: only if its update is element-wise -------------------
# ZeRO's flat layout gives rank r a contiguous range of a bucket's elements, which may start and
# end inside a parameter: the optimizer sees pieces of weights. That is exact for an optimizer
# whose update of each element reads only that element's weight, gradient and state (and the
# step count): these, as torch implements them (their foreach / fused paths included).
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
    "ASGD", "Rprop") if hasattr(torch.optim, n))
# ... and these read a whole tensor (or all of them) to update one element
WHOLE_TENSOR = {
    "Adafactor": "its second moment is factored into the row and column means of each 2-D weight",
    "Muon": "it orthogonalises each 2-D update as a whole matrix (Newton-Schulz)",
    "LBFGS": "its quasi-Newton step and line search use all parameters at once",
    "SparseAdam": "it needs sparse gradients of whole embeddings",
    "Lamb": "its trust ratio divides the norm of each whole weight by that of its update",
    "LAMB": "its trust ratio divides the norm of each whole weight by that of its update",
    "Shampoo": "its preconditioners are matrices built from each whole weight's gradient",
}


def check_elementwise(optimizer_class, elementwise=None):
    """Raise (one line) unless `optimizer_class` can run on flat shards. TypeError: not a
    torch.optim.Optimizer class. ValueError: a whole-tensor optimizer (WHOLE_TENSOR, by class
    name anywhere in its MRO: why it is refused), or one zerolab cannot vouch for - not one of
    ELEMENTWISE, or a subclass that overrides step() - unless elementwise=True says so.
    elementwise=False refuses any."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        what = (f"an instance of {type(optimizer_class).__name__}"
                if isinstance(optimizer_class, torch.optim.Optimizer) else repr(optimizer_class))
        raise TypeError(f"optimizer_class is {what}, not a torch.optim.Optimizer subclass (pass "
                        "the class, e.g. torch.optim.AdamW, and its arguments as keywords)")
    if elementwise not in (None, True, False):
        raise ValueError(f"elementwise {elementwise!r} must be None, True or False")
    name = optimizer_class.__name__
    for cls in optimizer_class.__mro__:
        if cls.__name__ in WHOLE_TENSOR and elementwise is not True:
            raise ValueError(
                f"{name} cannot run on ZeRO's flat shards: {WHOLE_TENSOR[cls.__name__]}, and a "
                "rank holds only a contiguous range of elements that may split a weight; keep "
                "it unsharded (DDP) or give each rank whole parameters")
    if elementwise is True:
        return
    vouched = any(optimizer_class.step is base.step for base in ELEMENTWISE)
    if elementwise is False or not vouched:
        raise ValueError(
            f"{name}: zerolab cannot tell whether its update is element-wise (each element's "
            "new value reads only that element's weight, gradient and state); pass "
            "elementwise=True if it is, or use one of "
            + ", ".join(c.__name__ for c in ELEMENTWISE))
