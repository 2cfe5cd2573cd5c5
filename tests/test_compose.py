"""A stage with its variants: zerolab.variants.compose builds the class each option asks for, the strategy
says what it is (`strategy.options`, which the run's result JSON reads), and an option a stage
has no variant for is refused in one line before anything is built.

The lesson's classes (zerolab.ddp / zero1 / zero2 / zero3) take no variant's option at all: each
variant is a subclass or mixin in its own module (pyproject's contract "the stages and their
frame import no variant" holds the imports; here the classes). Exactness of every variant against
single-process torch is held by its own tests (test_offload, test_gather_placement, test_knobs,
test_quant, test_hybrid, test_equivalence).
"""
from __future__ import annotations

import types

import pytest
import torch

from conftest import make_model
from zerolab import STRATEGIES
from zerolab.variants import compose, offload, placement, prefetch, quant, zero1rs

ONE_RANK = types.SimpleNamespace(world_size=1, rank=0)     # no collective at setup


def build(stage, **opts):
    return compose.make_strategy(stage, make_model("nano"), ONE_RANK, **opts)


@pytest.mark.parametrize("stage, opts, mixins, base, says", [
    (0, {}, (), "DDP", {}),
    (1, {"grad_op": "reduce_scatter"}, (), zero1rs.ReduceScatterZeRO1,
     {"grad_op": "reduce_scatter", "gather": "after_step"}),
    (1, {"gather": "before_forward", "offload": True}, (placement.Deferred, offload.Offloaded),
     "ZeRO1", {"grad_op": "all_reduce", "gather": "before_forward"}),
    (2, {"gather": "before_forward"}, (placement.Deferred,), "ZeRO2", {"gather": "before_forward"}),
    (2, {"offload": True}, (offload.Offloaded,), "ZeRO2", {"gather": "after_step"}),
    (3, {}, (), "ZeRO3", {"prefetch": 1, "keep_root": False, "quantize": None}),
    (3, {"prefetch": 0, "keep_root": True}, (prefetch.PrefetchDepth, prefetch.KeepRoot), "ZeRO3",
     {"prefetch": 0, "keep_root": True}),
    (3, {"quantize": {"weights": "int8"}}, (), "ZeRO3",
     {"quantize": quant.Quantize(weights="int8")}),
])
def test_each_option_builds_its_variant_and_the_strategy_says_so(stage, opts, mixins, base, says):
    s = build(stage, **opts)
    cls = STRATEGIES[stage] if isinstance(base, str) else base
    mro = type(s).__mro__                   # the composed class, then its mixins in order
    assert mro[1:1 + len(mixins)] == mixins if mixins else type(s) is cls
    assert isinstance(s, cls)
    assert [c for c in type(s).__mro__ if c.__module__ == "zerolab.variants.placement"
            or c.__module__ == "zerolab.variants.offload" or c.__module__ == "zerolab.variants.prefetch"] == \
        list(mixins)
    got = s.options
    assert got["name"] == STRATEGIES[stage].name
    for key, value in says.items():
        assert got[key] == value, key
    assert (got["offload"] is not None) == bool(opts.get("offload"))
    s.close()


def test_the_default_configuration_is_the_lesson_itself():
    """No option: the stage's own class, not a composition (what the notebooks show runs)."""
    for stage, cls in STRATEGIES.items():
        s = build(stage)
        assert type(s) is cls
        s.close()


@pytest.mark.parametrize("stage, opts, says", [
    (0, {"grad_op": "reduce_scatter"}, "grad_op 'reduce_scatter' is ZeRO-1's (stage 1), not stage 0's"),
    (3, {"gather": "before_forward"}, "ZeRO-1 and ZeRO-2's"),
    (3, {"offload": True}, "offload True is ZeRO-1 and ZeRO-2's"),
    (2, {"prefetch": 2}, "prefetch 2 is ZeRO-3's"),
    (1, {"keep_root": True}, "keep_root True is ZeRO-3's"),
    (2, {"quantize": {"grads": "int4"}}, "quantize is ZeRO-3's"),
    (3, {"prefetch": -2}, "prefetch -2 must be a bool, a depth >= 0, or -1"),
    (1, {"grad_op": "all_gather"}, "grad_op 'all_gather' is not one of"),
    (3, {"hybrid": "hsdp"}, "hybrid and ranks_per_node go together"),
    (3, {"bucket_mb": 4}, "ZeRO-3 gathers and reduces one block at a time"),
])
def test_an_option_the_stage_has_no_variant_for_is_one_line(stage, opts, says):
    with pytest.raises(ValueError, match=None) as err:
        build(stage, **opts)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_lesson_classes_take_no_variant_option(stage):
    for key, value in (("prefetch", 2), ("offload", True), ("gather", "before_forward"),
                       ("grad_op", "reduce_scatter"), ("quantize", {"weights": "int8"})):
        with pytest.raises(TypeError, match="compose.make_strategy") as err:
            STRATEGIES[stage](torch.nn.Linear(2, 2), ONE_RANK, **{key: value})
        assert repr(key) in str(err.value) and "\n" not in str(err.value)
