"""Offline consolidation: a sharded checkpoint back into one plain `GPT` state dict.

Idea: like DeepSpeed's zero_to_fp32.py, and without a process group or a GPU, read every rank's
file of a checkpoint (`checkpoint.open_checkpoint`) and rebuild the full fp32 weights from the
master weights, with every key of GPT(config).state_dict() (the tied lm_head.weight included),
so that `load_state_dict(strict=True)` accepts them; optionally the AdamW state in torch's own
`optimizer.state_dict()` layout (torch.optim.AdamW over the trainable parameters, each with
its own step count; frozen parameters are in model.pt only), or a torch.distributed.checkpoint
folder of the model that an FSDP2 (`fully_shard`) model loads at any world size.
`weights_only_copy` shows what a rank-0 `torch.save(model.state_dict())` loses (notebook 11).

    zerolab checkpoint consolidate runs/a/stage2/checkpoints runs/a/model.pt --optimizer adamw.pt
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..model import GPT, GPTConfig
from ..sharding import make_optimizer, set_adam_state
from .checkpoint import (Checkpoint, full_state_dict, open_checkpoint, param_names,
                         write_atomic)


def consolidate(path, model=None) -> tuple[dict[str, torch.Tensor], Checkpoint]:
    """Offline (no process group, like DeepSpeed's zero_to_fp32.py): the full fp32 state dict of
    the checkpoint at `path`, built from the master weights (trainable parameters) and the saved
    replicated state (frozen parameters, buffers), with every key of GPT(config)'s own
    state_dict() (tied lm_head.weight included) so that load_state_dict(strict=True) accepts it.
    model: another nn.Module whose keys to fill instead (its values are not used)."""
    ckpt = open_checkpoint(path)
    if model is None:
        with torch.device("meta"):
            model = GPT(GPTConfig(**ckpt.meta["model_config"]))

    def value(key, name):
        if name in ckpt.index:
            return ckpt.tensor(name, "master").clone()
        if key in ckpt.extra:
            return ckpt.extra[key].float().clone()
        raise ValueError(f"checkpoint {str(ckpt.folder)!r} holds no value for {key!r}")
    return full_state_dict(model, value), ckpt


def optimizer_state_dict(ckpt: Checkpoint, state_dict: dict, model=None) -> dict:
    """The AdamW state in torch's own `optimizer.state_dict()` layout: what torch.optim.AdamW
    holds when built over the *trainable* parameters of GPT(config) (or of `model`, e.g. another
    nn.Module the run trained; it gets `state_dict` loaded) in the two groups zerolab trains with
    (`sharding.make_optimizer`: 2-D weights with the run's weight_decay, then the others with
    none), i.e. `make_optimizer([p for p in model.parameters() if p.requires_grad])`. Params are
    numbered group by group in model.parameters() order; a tied weight (wte.weight is
    lm_head.weight) is one parameter; frozen parameters (in no unit of the checkpoint) are in
    no group; each parameter has its own "step" (`Checkpoint.param_step`) and one never stepped
    has no state, as in torch. ValueError when a parameter is neither saved nor frozen."""
    if model is None:
        model = GPT(GPTConfig(**ckpt.meta["model_config"]))
    model.load_state_dict(state_dict)
    frozen = set(ckpt.frozen)
    names = param_names(model)
    trainable = []
    for p in model.parameters():
        name = names[id(p)]
        if name not in ckpt.index and name not in frozen:
            raise ValueError(f"checkpoint {str(ckpt.folder)!r} holds no optimizer state for "
                             f"{name!r} and does not list it as frozen")
        p.requires_grad_(name in ckpt.index)
        if p.requires_grad:
            trainable.append(p)
    args = ckpt.meta["args"]
    opt = make_optimizer(trainable, lr=args["lr"], weight_decay=args["weight_decay"])
    for p in trainable:
        name = names[id(p)]
        set_adam_state(opt, p, ckpt.tensor(name, "exp_avg"), ckpt.tensor(name, "exp_avg_sq"),
                       ckpt.param_step(name))
    return opt.state_dict()


def weights_only_copy(src, dst) -> Path:
    """A copy of checkpoint `src` at `dst` holding only what a rank-0
    `torch.save(model.state_dict())` of the bf16 model keeps (the mistake in the bug reports):
    the fp32 master weights rebuilt from the saved parameters, exp_avg = exp_avg_sq = 0 and
    AdamW's step count 0 (the data position stays). Resuming from it shows the price: see
    notebooks/11_checkpoints.ipynb. Returns `dst`."""
    ckpt, dst = open_checkpoint(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    files = {}
    for r, state in enumerate(ckpt.ranks):
        units = {name: {"params": t["params"].clone(), "master": t["params"].float(),
                        "exp_avg": torch.zeros_like(t["exp_avg"]),
                        "exp_avg_sq": torch.zeros_like(t["exp_avg_sq"])}
                 for name, t in state["units"].items()}
        kept = {k: v for k, v in state.items() if k != "steps"}    # every count: 0
        torch.save({**kept, "units": units}, dst / f"rank{r}.pt")
        files[f"rank{r}.pt"] = (dst / f"rank{r}.pt").stat().st_size
    write_atomic(dst / "meta.json", json.dumps({**ckpt.meta, "files": files, "optimizer_step": 0},
                                              indent=1))
    return dst


def consolidate_command(args) -> int:
    """`zerolab checkpoint consolidate DIR OUT [--safetensors] [--optimizer PATH] [--dcp DIR]`."""
    out = Path(args.out)
    if args.safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("--safetensors needs the safetensors package (pip install "
                             "safetensors), or omit it for a torch.save file") from None
    state_dict, ckpt = consolidate(args.dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.safetensors:        # safetensors stores no shared tensors: the tied key gets a copy
        save_file({k: v.clone().contiguous() for k, v in state_dict.items()}, str(out),
                  metadata={"step": str(ckpt.step), "format": "pt"})
    else:
        torch.save(state_dict, out)
    print(f"wrote {out}: {len(state_dict)} keys, fp32, step {ckpt.step}, from {ckpt.world_size} "
          f"rank file(s) of stage {ckpt.stage} at {ckpt.folder}")
    if args.optimizer:
        torch.save(optimizer_state_dict(ckpt, state_dict), args.optimizer)
        print(f"wrote {args.optimizer}: AdamW state in torch's optimizer.state_dict() layout "
              f"({len(ckpt.index)} trainable parameters; frozen, in model.pt only: "
              f"{', '.join(ckpt.frozen) or 'none'})")
    if args.dcp:
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
        tmp = Path(args.dcp).with_suffix(".pt.tmp")
        torch.save(state_dict, tmp)
        torch_save_to_dcp(tmp, args.dcp)
        tmp.unlink()
        print(f"wrote {args.dcp}: torch.distributed.checkpoint format (loads into FSDP2 at any N)")
    return 0
