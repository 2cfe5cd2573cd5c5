"""What `zerolab fit` asks about: a preset, a GPT shape or the learner's own model, and the
device it must fit on.

A `Target` is a model built on the meta device and a batch of the real shapes; `target_of(args)`
makes one from `zerolab fit`'s flags (`--preset`, `--n-layer` ..., `--model pkg.module:build`),
and `device_memory` reads `--device-memory` (GB, or a named device of `timing.hardware`).
Errors: ValueError, one line naming the bad value and what is accepted.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..model import GPT, get_config
from ..timing import hardware
from . import options

#: GB, the unit --device-memory takes
GB = 1e9


@dataclass
class Target:
    """What is trained: `build()` returns the model (called under torch.device("meta"));
    `batch(rows)` returns (x, y) of `rows` rows on the meta device; `cfg`: the GPTConfig when
    it is the course's GPT (activation checkpointing is then its own flag)."""
    name: str
    build: object
    batch: object
    cfg: object = None


def gpt_target(cfg, name: str) -> Target:
    """The course's GPT with `cfg`; its batch is built as `data.get_batch` builds it (global
    rows of cfg.block_size + 1 token ids, gathered by index, then shifted views)."""
    def batch(rows: int):
        tokens = torch.zeros(rows * (cfg.block_size + 1) + 1, dtype=torch.uint8, device="meta")
        starts = torch.zeros(rows, dtype=torch.long, device="meta")
        got = tokens[starts[:, None] + torch.arange(cfg.block_size + 1, device="meta")].long()
        return got[:, :-1], got[:, 1:]
    return Target(name, lambda: GPT(cfg), batch, cfg)


def load_model(spec: str) -> Target:
    """--model pkg.module:build -> a Target. `build()` returns an nn.Module whose forward(x, y)
    returns the scalar loss and whose `example_inputs(rows)` returns (x, y) of `rows` rows on
    the current default device. ValueError (one line) for a spec that does not import, does not
    build, or builds something else."""
    accepted = ("accepted: pkg.module:function, a function with no arguments returning an "
                "nn.Module with forward(x, y) -> loss and example_inputs(rows) -> (x, y)")
    modname, sep, attr = str(spec).partition(":")
    if not sep or not modname or not attr.isidentifier():
        raise ValueError(f"--model {spec!r} is not of the form pkg.module:function ({accepted})")
    try:
        module = importlib.import_module(modname)
    except Exception as err:  # noqa: BLE001 - any import failure: one line
        raise ValueError(f"--model {spec!r}: module {modname!r} does not import "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                         ) from None
    build = getattr(module, attr, None)
    if not callable(build):
        raise ValueError(f"--model {spec!r}: {modname} has no function {attr!r} ({accepted})")
    try:
        with torch.device("meta"):
            model = build()
    except Exception as err:  # noqa: BLE001 - the learner's build failed: one line
        raise ValueError(f"--model {spec!r}: {attr}() failed on the meta device "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                         ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {attr}() returned {type(model).__name__}, not an "
                         f"nn.Module ({accepted})")
    if not callable(getattr(model, "example_inputs", None)):
        raise ValueError(f"--model {spec!r}: {type(model).__name__} has no example_inputs(rows) "
                         f"method ({accepted})")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"--model {spec!r}: {type(model).__name__} has no trainable parameter")

    def batch(rows: int):
        with torch.device("meta"):
            return model_holder[0].example_inputs(rows)
    model_holder = [model]

    def fresh():
        model_holder[0] = build()
        return model_holder[0]
    return Target(spec, fresh, batch)


def gpt_shape(args) -> dict:
    """--n-layer / --d-model / --n-head / --vocab-size over the preset's config; ValueError
    (one line) for a value below 1 or a width the heads do not divide."""
    shape = {}
    for flag, key in (("n_layer", "n_layer"), ("d_model", "n_embd"), ("n_head", "n_head"),
                      ("vocab_size", "vocab_size")):
        value = getattr(args, flag, None)
        if value is not None:
            if value < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1")
            shape[key] = value
    return shape


def target_of(args) -> Target:
    """The Target that `args` name: --model, else --preset with --block-size and the shape flags."""
    if getattr(args, "model", None):
        if gpt_shape(args):
            raise ValueError("--model builds its own shape: drop --n-layer / --d-model / "
                             "--n-head / --vocab-size, or drop --model")
        return load_model(args.model)
    cfg = options.model_config(args)
    shape = gpt_shape(args)
    if shape:
        cfg = get_config(args.preset, **{**cfg.__dict__, **shape})
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"--d-model {cfg.n_embd} is not divisible by --n-head {cfg.n_head} "
                         f"(accepted: a d_model that is a multiple of the heads)")
    name = args.preset + (" " + ",".join(f"{k}={v}" for k, v in shape.items()) if shape else "")
    return gpt_target(cfg, name)


def device_memory(text) -> tuple[float, str]:
    """--device-memory: a number of GB, or a named device of `hardware.DEVICES` (its HBM).
    Returns (bytes, label); ValueError (one line) otherwise."""
    if text is None:
        raise ValueError("give --device-memory GB or a named device")
    name = str(text).strip().lower()
    if name in hardware.DEVICES and hardware.DEVICES[name].memory:
        return hardware.DEVICES[name].memory, name
    try:
        gb = float(name.removesuffix("gb"))
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        named = ", ".join(n for n, d in hardware.DEVICES.items() if d.memory)
        raise ValueError(f"--device-memory {text!r} is neither a size in GB (> 0) nor a named "
                         f"device ({named})")
    return gb * GB, f"{gb:g} GB"
