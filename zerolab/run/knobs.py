"""The strategies' knobs: from a run's parsed options to the keyword arguments each stage's
strategy takes, with their one-line checks.

Idea: `options.py` defines every flag once; this module says what the flags that tune a stage
mean to its strategy - DDP / ZeRO-1 / ZeRO-2's gradient buckets and all_gather placement,
ZeRO-3's prefetch depth, root, quantized collectives (ZeRO++'s qwZ / qgZ) and hybrid sharding
(HSDP, hpZ), the optimizer's state ladder, ZeRO-Offload (ZeRO-1/2's optimizer on the host), and
the emulated network's tiers - so that the ranks build the strategy (`stage.make_strategy`), write the result (`result.py`) and check the
options (`options.check`) from the same reading.

    kwargs = strategy_kwargs(3, args, meter)     # {"prefetch": 1, "keep_root": False, ...}

Errors: ValueError with one line naming the flag and what is accepted (`check`).
"""
from __future__ import annotations

import os

import torch

from .. import theory
from ..variants import quant
from ..variants.offload import Offload
from ..variants.hybrid import HYBRIDS
from ..variants.placement import DEFAULT_GATHER
from ..timing import hardware, linkemu
from ..variants.prefetch import DEFAULT_PREFETCH

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OFFLOAD_LINK = "pcie4"          # --offload-link's default (zerolab/timing/hardware.py)


def check(args, world_size: int, stages: list[int]):
    """ValueError (one line) for a knob no run of `stages` on `world_size` ranks could use."""
    theory.check_optimizer_states(*optimizer_ladder(args).values(), args.precision,
                                  getattr(args, "grad_dtype", None))
    depth = getattr(args, "zero3_prefetch_depth", None)
    if depth is not None and depth < -1:
        raise ValueError(f"--zero3-prefetch-depth {depth} must be >= 0, or -1 (all blocks)")
    linkemu.from_args(getattr(args, "link_gbps", None), getattr(args, "link_latency_us", None),
                      world_size)          # ValueError for a bad emulated link
    tiers(args, world_size)                 # ValueError for bad emulated tiers
    quantize(args, stages)                  # ValueError: a bad block, or not ZeRO-3
    offload(args, stages)                   # ValueError: not ZeRO-1/2, a bad link, bf16-master
    hybrid(args, world_size, stages)        # ValueError: not ZeRO-3, k, unsupported company
    if getattr(args, "master_rounding", None) == "kahan" and (
            getattr(args, "save_every", None) is not None or getattr(args, "resume", None)):
        raise ValueError("--master-rounding kahan cannot be checkpointed yet (the compensation "
                         "buffer is not saved, so a resume would differ): drop --save-every / "
                         "--resume, or use --master-rounding stochastic")


def strategy_kwargs(stage: int, args, meter=None) -> dict:
    """The keyword arguments of `zerolab.variants.compose.make_strategy(stage, ...)` for these options
    (`stage.make_strategy`; --hybrid's kind and ranks_per_node: `hybrid`). What was built is
    then the strategy's to say (`strategy.options`: the result JSON reads it)."""
    kwargs = dict(max_grad_norm=args.max_grad_norm, meter=meter, lr=args.lr,
                  weight_decay=args.weight_decay,
                  find_unused_parameters=getattr(args, "find_unused_parameters", False),
                  grad_dtype=DTYPES[args.grad_dtype] if getattr(args, "grad_dtype", None) else None)
    ladder = optimizer_ladder(args)         # FlatAdamW's state dtypes (zerolab.optim)
    if ladder["states"] != "fp32":
        kwargs.update(optimizer_states=ladder["states"], master_rounding=ladder["rounding"],
                      rounding_seed=args.seed)
    if stage in (0, 1, 2):
        kwargs["bucket_mb"] = getattr(args, "bucket_mb", None)
    if stage == 1:
        kwargs["grad_op"] = args.zero1_grad_op
    if stage in (1, 2):
        kwargs["gather"] = getattr(args, "zero12_gather", None) or DEFAULT_GATHER
        kwargs["offload"] = offload(args)       # ZeRO-Offload (zerolab.variants.offload), or None
    if stage == 3:
        kwargs["prefetch"] = zero3_prefetch_depth(args)
        kwargs["keep_root"] = getattr(args, "zero3_keep_root", False)
        kwargs["quantize"] = quantize(args)     # ZeRO++ qwZ / qgZ (zerolab.variants.quant), or None
    return kwargs


def hybrid(args, world_size: int, stages: list[int] | None = None) -> tuple[str, int] | None:
    """(kind, k) of --hybrid hsdp|hpz (zerolab.variants.hybrid), or None. k, the ranks of a node: the
    emulated --ranks-per-node if given, else torchrun's LOCAL_WORLD_SIZE (the ranks this node
    launched), else the whole world (one node). ValueError (one line) for a stage other than 3,
    a k that does not divide world_size, or a combination it does not support."""
    kind = getattr(args, "hybrid", None)
    if kind is None:
        return None
    if kind not in HYBRIDS:
        raise ValueError(f"--hybrid {kind!r} is not one of {', '.join(HYBRIDS)}")
    other = [str(s) for s in stages or () if s != 3]
    if other:
        raise ValueError(f"--hybrid {kind} shards ZeRO-3 by node, not stage {', '.join(other)}: "
                         "run it with --stage 3")
    k = getattr(args, "ranks_per_node", None) or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if k < 1 or world_size % k:
        given = "--ranks-per-node" if getattr(args, "ranks_per_node", None) else "LOCAL_WORLD_SIZE"
        fits = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ValueError(f"--hybrid {kind}: {given} {k} does not divide the world size "
                         f"{world_size}; ranks per node {fits} are accepted")
    given = [f for f, on in (("--quantize-weights", kind == "hsdp"
                              and getattr(args, "quantize_weights", None)),
                             ("--quantize-grads", kind == "hsdp"
                              and getattr(args, "quantize_grads", None)),
                             ("--find-unused-parameters",
                              kind == "hsdp" and getattr(args, "find_unused_parameters", False)),
                             ("--save-every", kind == "hsdp" and getattr(args, "save_every", None)
                              is not None),
                             ("--resume", kind == "hsdp" and getattr(args, "resume", None)))
             if on]
    if given and given[0].startswith("--quantize"):
        raise ValueError(f"--hybrid hsdp does not take {given[0]} (HSDP's collectives stay inside "
                         "a node but one all_reduce): ZeRO++ (hpZ + qwZ + qgZ) is --hybrid hpz")
    if given:
        raise ValueError(f"--hybrid {kind} does not take {given[0]} yet (zerolab/variants/hybrid.py)")
    return kind, k


def tiers(args, world_size: int):
    """The emulated two-tier network of --ranks-per-node / --intra / --inter / --nics-per-node
    (a hardware.Topology), or None; ValueError (one line) for a bad combination or value
    (`linkemu.tiers_from_args`). --ranks-per-node without --intra / --inter / --nics-per-node
    only groups the ranks into nodes, for --hybrid (no emulated links)."""
    nics = getattr(args, "nics_per_node", None)
    if getattr(args, "hybrid", None) and not (getattr(args, "intra", None)
                                              or getattr(args, "inter", None)) and nics is None:
        return None
    return linkemu.tiers_from_args(getattr(args, "ranks_per_node", None), getattr(args, "intra", None),
                                   getattr(args, "inter", None), world_size,
                                   getattr(args, "link_gbps", None), nics_per_node=nics)


def quantize(args, stages: list[int] | None = None):
    """ZeRO-3's `quant.Quantize` of --quantize-weights / --quantize-grads / --quant-block, or None;
    ValueError (one line) for --quant-block alone or < 1, or a stage other than 3 in `stages`."""
    w, g, b = (getattr(args, k, None) for k in ("quantize_weights", "quantize_grads", "quant_block"))
    if w is None and g is None:
        if b is not None:
            raise ValueError(f"--quant-block {b} needs --quantize-weights or --quantize-grads")
        return None
    flag = "--quantize-weights" if w is not None else "--quantize-grads"
    other = [str(s) for s in stages or () if s != 3]
    if other:
        raise ValueError(f"{flag} quantizes ZeRO-3's collectives only, not stage "
                         f"{', '.join(other)}: run it with --stage 3")
    if b is not None and b < 1:
        raise ValueError(f"--quant-block {b} must be >= 1 (elements per scale)")
    return quant.Quantize(weights=w, grads=g, block=quant.DEFAULT_BLOCK if b is None else b)


def offload(args, stages: list[int] | None = None):
    """ZeRO-Offload's `offload.Offload` of --offload-optimizer / --offload-link (a
    hardware.Link; default OFFLOAD_LINK), or None; ValueError (one line) for --offload-link
    alone, a bad link, a stage other than 1 or 2 in `stages`, or --optimizer-states
    bf16-master (its master is the device's bf16 weights: nothing to offload)."""
    spec = getattr(args, "offload_link", None)
    if not getattr(args, "offload_optimizer", False):
        if spec is not None:
            raise ValueError(f"--offload-link {spec} needs --offload-optimizer")
        return None
    other = [str(s) for s in stages or () if s not in (1, 2)]
    if other:
        raise ValueError(f"--offload-optimizer moves ZeRO-1/2's optimizer to the host, not stage "
                         f"{', '.join(other)}'s: run it with --stage 1 or 2")
    if optimizer_ladder(args)["states"] == "bf16-master":
        raise ValueError("--offload-optimizer with --optimizer-states bf16-master: its master is "
                         "the bf16 weights on the device, nothing to offload (use fp32 or "
                         "bf16-moments)")
    return Offload(hardware.parse_link(spec or OFFLOAD_LINK, "--offload-link"))


def optimizer_ladder(args) -> dict:
    """{"states", "rounding"}: the rung of --optimizer-states / --master-rounding (defaults
    "fp32", "nearest"), as `theory.bytes_per_param` takes them."""
    return {"states": getattr(args, "optimizer_states", None) or "fp32",
            "rounding": getattr(args, "master_rounding", None) or "nearest"}


def zero3_prefetch_depth(args) -> int:
    """ZeRO-3's blocks gathered ahead: --zero3-prefetch-depth if given, else 1 for
    --zero3-prefetch, 0 for --no-zero3-prefetch, else prefetch.DEFAULT_PREFETCH."""
    depth = getattr(args, "zero3_prefetch_depth", None)
    if depth is not None:
        return depth
    flag = getattr(args, "zero3_prefetch", None)
    return DEFAULT_PREFETCH if flag is None else int(flag)
