"""A stage with its variants: `make_strategy(stage, model, comm, **options)`.

Idea: each stage's file (ddp.py, zero1.py, zero2.py, zero3.py) is the notes' algorithm in the
course's default configuration, and each variant lives in a module beside it as a subclass, a
mixin or a wrapped Comm (torchtitan's policies, this package's hybrid.py). This module is the one
place that knows them all: it turns a caller's options into a class - the stage's, with the
variants' mixins in front of it - and a Comm, and builds the strategy. What it chose, the
strategy itself reports (`strategy.options`, each variant adding its own): the run's result JSON
asks it.

    option           stage  a value other than the default gives          module
    grad_op          1      "reduce_scatter": ReduceScatterZeRO1           zero1rs.py
    gather           1, 2   "before_forward": Deferred                     placement.py
    offload          1, 2   an offload.Offload (True: one, no link): Offloaded   offload.py
    prefetch         3      a depth other than 1: PrefetchDepth            prefetch.py
    keep_root        3      True: KeepRoot                                 prefetch.py
    quantize         3      a quant.Quantize (or dict): quant.quantized_comm   quant.py
    hybrid           3      "hsdp" / "hpz" (with ranks_per_node): HSDP / HpZ   hybrid.py

quantize with hybrid "hpz" is ZeRO++ whole (hpZ + qwZ + qgZ, qgZ in two hops); with "hsdp" it is
refused (HSDP's collectives stay inside a node except one all_reduce).

Every other option (max_grad_norm, find_unused_parameters, grad_dtype, bucket_mb, meter, AdamW's)
goes to the stage as it is (`strategy.Strategy`). A variant option given to a stage that has no
such variant raises ValueError (one line) naming it and the stages that take it.

    from zerolab.variants.compose import make_strategy
    s = make_strategy(3, model, comm, prefetch=2, keep_root=True, lr=1e-3)
"""
from __future__ import annotations

from .. import theory
from ..wholematrix import muon_theory
from ..ddp import DDP
from .hybrid import HYBRIDS, HpZ, HSDP
from ..wholematrix.muon_a2a import MuonAllToAll
from ..wholematrix.muon_owner import MuonOwner
from ..wholematrix.muon_replicate import MuonReplicate
from .offload import Offloaded
from .placement import DEFAULT_GATHER, GATHER_MODES, Deferred
from .prefetch import DEFAULT_PREFETCH, KeepRoot, PrefetchDepth, check_depth
from .quant import Quantize, quantized_comm
from ..zero1 import ZeRO1
from .zero1rs import ReduceScatterZeRO1
from ..zero2 import ZeRO2
from ..zero3 import ZeRO3

STAGE_CLASSES = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
#: the stages that take each variant option (any other stage: its default only)
TAKES = {"grad_op": (1,), "gather": (1, 2), "offload": (1, 2), "prefetch": (3,),
         "keep_root": (3,), "quantize": (3,), "hybrid": (3,), "ranks_per_node": (3,)}
_CLASSES: dict = {}


def compose(*bases: type) -> type:
    """The class whose MRO is `bases` (mixins first, the stage last), made once and named after
    them, e.g. "Deferred+Offloaded+ZeRO2"."""
    if len(bases) == 1:
        return bases[0]
    if bases not in _CLASSES:
        _CLASSES[bases] = type("+".join(b.__name__ for b in bases), bases, {})
    return _CLASSES[bases]


def strategy_class(stage: int, *, grad_op="all_reduce", gather=DEFAULT_GATHER, offload=False,
                   prefetch=DEFAULT_PREFETCH, keep_root=False, hybrid=None) -> type:
    """The class `make_strategy` builds for these options (see the module docstring)."""
    stage = theory.check_stage(stage)
    _only("grad_op", grad_op, "all_reduce", theory.ZERO1_GRAD_OPS, stage)
    _only("gather", gather, DEFAULT_GATHER, GATHER_MODES, stage)
    _only("offload", bool(offload), False, (False, True), stage)
    _only("keep_root", keep_root, False, (False, True), stage)
    _only("hybrid", hybrid, None, (None, *HYBRIDS), stage)
    depth = check_depth(prefetch)
    _only("prefetch", depth, DEFAULT_PREFETCH, (depth,), stage)
    mixins = [Deferred] * (gather == "before_forward") + [Offloaded] * bool(offload)
    mixins += [PrefetchDepth] * (stage == 3 and depth != DEFAULT_PREFETCH) + [KeepRoot] * keep_root
    base = {"hsdp": HSDP, "hpz": HpZ}.get(hybrid) or (
        ReduceScatterZeRO1 if grad_op == "reduce_scatter" else STAGE_CLASSES[stage])
    return compose(*mixins, base)


def make_strategy(stage: int, model, comm, *, grad_op="all_reduce", gather=DEFAULT_GATHER,
                  offload=None, prefetch=DEFAULT_PREFETCH, keep_root=False, quantize=None,
                  hybrid=None, ranks_per_node=None, **options):
    """Stage `stage` (0-3) around `model` on the ranks of `comm` (zerolab.comm.Comm), with the
    variants the options ask for (module docstring). Returns the strategy; its `options` say
    what was built. ValueError (one line) for a bad value or a variant the stage has not."""
    quantize = Quantize.of(quantize)
    if quantize is not None and stage != 3:
        raise ValueError(f"quantize is ZeRO-3's (stage 3), not stage {stage}'s")
    if quantize is not None and hybrid == "hsdp":
        raise ValueError("quantize does not go with hybrid 'hsdp' (its gathers and reduce_scatters "
                         "stay inside a node): use hybrid 'hpz' (ZeRO++: hpZ + qwZ + qgZ)")
    if (hybrid is None) != (ranks_per_node is None):
        raise ValueError("hybrid and ranks_per_node go together (ZeRO-3 by node: zerolab.variants.hybrid)")
    cls = strategy_class(stage, grad_op=grad_op, gather=gather, offload=offload,
                         prefetch=prefetch, keep_root=keep_root, hybrid=hybrid)
    extra = {"offload": offload} if offload else {}
    if issubclass(cls, PrefetchDepth):
        extra["prefetch"] = prefetch
    if hybrid is not None:
        extra["ranks_per_node"] = ranks_per_node
    return cls(model, quantized_comm(comm, quantize), **extra, **options)


def _only(name, value, default, accepted, stage):
    if value not in accepted:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(map(repr, accepted))}")
    stages = TAKES[name]
    if value != default and stage not in stages:
        raise ValueError(f"{name} {value!r} is {' and '.join(theory.STAGE_NAMES[s] for s in stages)}"
                         f"'s (stage {', '.join(map(str, stages))}), not stage {stage}'s")


MUON_LAYOUTS = {"owner": MuonOwner, "a2a": MuonAllToAll, "replicate": MuonReplicate}


def make_muon(params, layout: str = muon_theory.DEFAULT_LAYOUT, *args, **kwargs):
    """A distributed whole-matrix optimizer (torch.optim.Muon by default) in `layout`: "owner"
    (muon_owner.py), "a2a" (muon_a2a.py, the default: muon_theory.DEFAULT_LAYOUT says why) or
    "replicate" (muon_replicate.py); the other arguments are wholeopt.WholeOptimizer's.
    ValueError (one line) for another layout."""
    return MUON_LAYOUTS[muon_theory.check_layout(layout)](params, *args, **kwargs)
