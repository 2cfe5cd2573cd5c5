"""The known list (zerolab.optim.OPTIMIZERS) against the installed torch and against experiment.

Every torch.optim.Optimizer subclass of the installed torch must be in the table (a class a new
torch adds fails here until it is classified), and each claim is checked in one process: the
same optimizer stepping a weight whole, and stepping it in pieces - its rows split in two (the
"dim0" layout of fully_shard) and its elements split at an odd place (ZeRO's flat ranges) - each
piece with its own optimizer instance, as on two ranks. An element-wise update must come out the
same, bit for bit; a whole-tensor one must come out different on some split.
"""
from __future__ import annotations

import pytest
import torch

from zerolab.optim import (OPTIMIZERS, check_elementwise, declare_elementwise, refusal,
                           update_kind)

STEPS = 8       # RAdam's rectification starts after 5 steps; ASGD averages from t0
# hyperparameters that switch each class's options on (momentum, amsgrad, centred, decay ...)
ARGS = {
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    "Adam": {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "Adamax": {"lr": 0.01, "weight_decay": 0.1},
    "Adagrad": {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1},
    "Adadelta": {"lr": 1.0, "weight_decay": 0.1},
    "RMSprop": {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.1},
    "NAdam": {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "RAdam": {"lr": 0.01, "weight_decay": 0.1},
    "ASGD": {"lr": 0.05, "t0": 2, "weight_decay": 0.1},
    "Rprop": {"lr": 0.01},
    "Adafactor": {"lr": 0.01, "weight_decay": 0.1},
    "Muon": {"lr": 0.02},
    "LBFGS": {"lr": 0.5, "max_iter": 2},
    "SparseAdam": {"lr": 0.01},
}


def torch_optimizer_classes() -> dict[str, type]:
    """Every Optimizer subclass torch.optim defines: its public names and, walked through
    __subclasses__, any class of a torch.optim module."""
    out = {n: c for n in dir(torch.optim) if isinstance(c := getattr(torch.optim, n), type)
           and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    todo = list(torch.optim.Optimizer.__subclasses__())
    while todo:
        c = todo.pop()
        todo += c.__subclasses__()
        if c.__module__.split(".")[:2] == ["torch", "optim"]:
            out.setdefault(c.__name__, c)
    return out


CLASSES = torch_optimizer_classes()
SPLITS = {  # (pieces of a [6, 5] tensor, how to put them back)
    "rows": (lambda w: [w[:2], w[2:]], lambda ps: torch.cat(ps)),
    "flat": (lambda w: [w.reshape(-1)[:13], w.reshape(-1)[13:]],
             lambda ps: torch.cat(ps).view(6, 5)),
}


def train(cls, kwargs, pieces, sparse=False):
    """Step each [(w0, a, b)] piece with its own optimizer instance on the separable loss
    Σ a w^2 + b w (so that a piece's gradient is the whole's gradient there) for STEPS steps."""
    out = []
    for w0, a, b in pieces:
        w = w0.clone().requires_grad_()
        opt = cls([w], **kwargs)

        def closure(w=w, a=a, b=b, opt=opt):
            opt.zero_grad()
            loss = (a * w * w + b * w).sum()
            loss.backward()
            if sparse:
                w.grad = w.grad.to_sparse()
            return loss
        for _ in range(STEPS):
            opt.step(closure)
        out.append(w.detach())
    return out


def whole_and_split(cls, split, sparse=False):
    g = torch.Generator().manual_seed(0)
    w0, b = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    a = torch.rand(6, 5, generator=g) + 0.5
    kwargs = ARGS[cls.__name__]
    whole = train(cls, kwargs, [(w0, a, b)], sparse)[0]
    cut, join = SPLITS[split]
    split_ = join(train(cls, kwargs, list(zip(cut(w0), cut(a), cut(b))), sparse))
    return w0, whole, split_


def test_every_torch_optimizer_class_is_in_the_table():
    assert {"Muon", "Adafactor", "LBFGS", "SparseAdam", "AdamW"} <= set(CLASSES)
    missing = sorted(set(CLASSES) - set(OPTIMIZERS))
    assert not missing, f"torch.optim classes zerolab.optim.OPTIMIZERS does not classify: {missing}"
    for name, cls in CLASSES.items():
        assert update_kind(cls)[0] == OPTIMIZERS[name][0], name
        assert name in ARGS, f"tests/test_optimizer_table.py: give {name} its ARGS"


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_the_table_holds_by_experiment(name):
    cls, kind = CLASSES[name], OPTIMIZERS[name][0]
    if kind == "element-wise":
        for split in SPLITS:
            w0, whole, split_ = whole_and_split(cls, split)
            assert (whole - w0).abs().max() > 1e-3, "the weight did not move"
            assert torch.equal(whole, split_), (split, (whole - split_).abs().max())
    elif kind == "whole-tensor":
        diffs = {}
        for split in SPLITS:
            try:
                w0, whole, split_ = whole_and_split(cls, split)
            except ValueError as e:              # Muon: 2-D parameters only
                assert "2D" in str(e) or "2-D" in str(e), e
                continue
            diffs[split] = float((whole - split_).abs().max() / (whole - w0).abs().max())
        # far above fp32 rounding (~1e-7): LBFGS's is the smallest, ~1e-3 of its movement
        assert diffs and max(diffs.values()) > 1e-5, diffs
    else:                                       # sparse: element-wise on sparse gradients ...
        assert kind == "sparse"
        for split in SPLITS:
            w0, whole, split_ = whole_and_split(cls, split, sparse=True)
            assert (whole - w0).abs().max() > 1e-3 and torch.equal(whole, split_), split
        with pytest.raises(RuntimeError, match="dense"):     # ... and dense ones refused
            whole_and_split(cls, "rows")
    assert (refusal(cls, "shards") is None) == (kind == "element-wise")


class LambLike(torch.optim.SGD):
    """A made-up member of the kind: SGD whose step is scaled by a whole-tensor trust ratio
    (LAMB's ||w|| / ||update||), overriding step()."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = p.norm() / p.grad.norm().clamp(min=1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(trust))
        return loss


def test_an_unknown_or_whole_tensor_class_is_refused_and_a_declared_one_runs():
    assert update_kind(LambLike)[0] == "unknown"
    msg = refusal(LambLike, "fully_shard's shard parameters")
    assert "LambLike" in msg and "declare_elementwise" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="elementwise=True"):
        check_elementwise(LambLike)
    for cls in (torch.optim.Adafactor, torch.optim.Muon, torch.optim.LBFGS):
        with pytest.raises(ValueError, match=cls.__name__):     # vouching cannot overrule
            check_elementwise(cls, elementwise=True)
        with pytest.raises(ValueError, match="not element-wise"):
            declare_elementwise(cls)
    assert "zerolab.torchlike.Adafactor" in refusal(torch.optim.Adafactor, "x")
    assert "DistributedDataParallel" in refusal(torch.optim.Muon, "x")

    class Scaled(torch.optim.SGD):          # overrides step, still element-wise
        def step(self, closure=None):
            return super().step(closure)
    assert refusal(Scaled, "x") is not None
    assert declare_elementwise(Scaled) is Scaled and refusal(Scaled, "x") is None
    check_elementwise(Scaled)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_loop_optimizer_over_a_stage_with_sharded_gradients_is_refused_naming_the_way(stage):
    """ZeRO-2/3 leave each rank only its range of the averaged gradient: a loop's own optimizer
    (here torch's Adafactor, and AdamW) reading p.grad is refused in one line that says to step
    with strategy.step() and where Muon lives - the weights unchanged (rank 0 of a fake world of
    2: the collectives move nothing, the placeholders are the ones a real run leaves)."""
    from zerolab.comm import Comm
    from zerolab.variants.compose import make_strategy
    from zerolab.model import GPT, get_config
    from zerolab.timing import whatif
    cfg = get_config("nano")
    with whatif.fake_world(2):
        torch.manual_seed(0)
        model = GPT(cfg)
        s = make_strategy(stage, model, Comm())
        x = torch.zeros(1, cfg.block_size, dtype=torch.long)
        s.backward(s.forward(x, x))
        with s.gathered():
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for cls in (torch.optim.Adafactor, torch.optim.AdamW):
            with pytest.raises(RuntimeError) as err:
                cls(model.parameters(), lr=0.1).step()
            said = str(err.value)
            assert "\n" not in said and "strategy.step()" in said and "make_muon" in said, said
            assert cls.__name__ + ".step() read its" in said, said
        with s.gathered():
            after = model.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)
        s.close()


def test_each_advice_names_an_entry_that_exists():
    """Every dotted zerolab name an advice gives imports, and the Muon advice's layouts are the
    ones make_muon accepts (it once named a module that does not exist, `zerolab.muon`)."""
    import importlib
    import re

    from zerolab.wholematrix import muon_theory
    from zerolab.optim import ADVICE
    for cls, text in ADVICE.items():
        for dotted in re.findall(r"zerolab(?:\.\w+)+", text):
            module, _, attr = dotted.rpartition(".")
            try:
                obj = importlib.import_module(dotted)
            except ImportError:
                obj = getattr(importlib.import_module(module), attr, None)
            assert obj is not None, (cls, dotted)
    named = re.findall(r'"(\w+)"', ADVICE["Muon"])
    assert "zerolab.variants.compose.make_muon" in ADVICE["Muon"]
    assert tuple(named) == muon_theory.LAYOUTS, named
