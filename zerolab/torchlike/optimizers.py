"""The loop's optimizer on fully_shard's shards: the check before every step, and Adafactor.

fully_shard replaces each parameter with this rank's rows of it, and the loop's own torch
optimizer steps those. That gives torch's result only when the update is element-wise
(`zerolab.optim.OPTIMIZERS`); Adafactor, Muon, LBFGS and any class zerolab cannot vouch for
would train silently wrong on a piece of each weight. So the first fully_shard call registers
one global step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook: it runs before
the step of every optimizer, whenever it was built and whatever its param groups mix) that
refuses such a step in one line - on every rank, since each rank steps the same optimizer
over its own shards - before anything changes, naming the class, why, and what to use
instead. It also refuses an optimizer built before fully_shard (its parameters were replaced
by the shards: it would step nothing; build it after, as FSDP2 needs). The check runs once per
optimizer and set of parameters.

`Adafactor` is torch.optim.Adafactor for fully_shard's dim-0 shards (`zerolab.wholematrix.factored`): built
and used as torch's, the same arithmetic, with two small all_reduces a step.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..wholematrix.factored import RowShardedAdafactor
from ..optim import refusal
from ..loop.replicas import check_replicas

_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # optimizer -> param ids
_HOOK: list = []


def install_step_check():
    """Register `check_step` as a global optimizer step pre-hook (once per process)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(check_step))


def check_step(optimizer, args, kwargs):
    """Before `optimizer.step()`: RuntimeError (one line) if it holds parameters fully_shard
    replaced by shards; ValueError (one line, `optim.refusal`) if it holds shard parameters
    and its update is not element-wise (unless its class steps shards itself)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    key = tuple(map(id, params))
    if _CHECKED.get(optimizer) == key:
        return None
    if any(getattr(p, "_zerolab_sharded_away", False) for p in params):
        raise RuntimeError(f"{type(optimizer).__name__} holds parameters that fully_shard has "
                           "since replaced by this rank's shards (it would step nothing): build "
                           "the optimizer after fully_shard, over model.parameters()")
    if any(getattr(p, "_zerolab_shard", False) for p in params):
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":   # torch's or zerolab's
            raise ValueError("ZeroRedundancyOptimizer over fully_shard's shard parameters would "
                             "shard them again, as if whole: fully_shard already gives each rank "
                             "its own optimizer state; build the optimizer class itself over "
                             "model.parameters() (e.g. torch.optim.AdamW)")
        why = refusal(type(optimizer), "fully_shard's shard parameters")
        if why is not None:
            raise ValueError(why)
    _CHECKED[optimizer] = key
    return None


class Adafactor(RowShardedAdafactor):
    """torch.optim.Adafactor for a fully_shard'ed model, built as torch's:

        opt = zerolab.torchlike.Adafactor(model.parameters(), lr=1e-2)

    Arguments and defaults are torch's (lr, beta2_decay, eps, d, weight_decay, foreach,
    maximize). Shard parameters of layout "dim0" (fully_shard's default) are stepped with
    torch's arithmetic over the whole weight (`zerolab.wholematrix.factored`: per step one all_reduce of
    each 2-D weight's C column sums, its row-statistic sum and every shard's squared-weight
    sum, and one of every shard's squared-update sum: 4 (2 P_s + Σ_2-D (C_i + 1)) bytes, in the
    model's ledger, what "optim_stats"); other parameters (ignored_params) as torch's class
    steps them. Raises ValueError (one line) for shards of layout "flat" (whole rows are what
    makes it cheap) or shards of two different models."""

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0, *, foreach=None, maximize=False):
        params = list(params)
        tensors = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
        shards = [p for p in tensors if getattr(p, "_zerolab_shard", False)]
        flat = [p for p in shards if p.__dict__.get("_zerolab_layout") != "dim0"]
        if flat:
            raise ValueError("zerolab.torchlike.Adafactor steps fully_shard's layout 'dim0' "
                             f"(whole rows per rank); {len(flat)} parameter(s) were sharded with "
                             "layout='flat': call fully_shard(..., layout='dim0')")
        states = list({id(p.__dict__["_zerolab_state"]): p.__dict__["_zerolab_state"]
                       for p in shards}.values())
        roots = {id(s.root or s) for s in states}
        if len(roots) > 1:
            raise ValueError(f"these parameters belong to {len(roots)} fully_shard models; "
                             "build one Adafactor per model")
        super().__init__(params, lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                         weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                         full_shape=lambda p: p.__dict__.get("_zerolab_full_shape"),
                         comm=(lambda: states[0].comm) if states else None)
        if states:                          # the parameters fully_shard left replicated
            check_replicas([p for p in tensors if not getattr(p, "_zerolab_shard", False)],
                           states[0].comm, "Adafactor")
