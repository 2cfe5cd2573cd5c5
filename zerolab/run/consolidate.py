"""Offline consolidation: a sharded checkpoint back into one plain `GPT` state dict.

Idea: like DeepSpeed's zero_to_fp32.py, and without a process group or a GPU, read every rank's
file of a checkpoint (`checkpoint.open_checkpoint`) and rebuild the full fp32 weights from the
master weights, with every key of GPT(config).state_dict() (the tied lm_head.weight included),
so that `load_state_dict(strict=True)` accepts them; optionally the AdamW state in torch's own
`optimizer.state_dict()` layout (torch.optim.AdamW over the trainable parameters, each with
its own step count; frozen parameters are in model.pt only), or a torch.distributed.checkpoint
folder of the model that an FSDP2 (`fully_shard`) model loads at any world size.
`weights_only_copy` shows what a rank-0 `torch.save(model.state_dict())` loses (notebook 11).
Every file written gets NAME.sha256 beside it (`sha256sum -c model.pt.sha256` checks it,
`integrity.check_sidecar` in Python); OUT is written atomically, and an OUT that is a folder or
cannot be written is refused in one line before anything is read.

    zerolab checkpoint consolidate runs/a/stage2/checkpoints runs/a/model.pt --optimizer adamw.pt
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from ..model import GPT, GPTConfig
from ..optim import set_adam_state
from ..sharding import make_optimizer
from .checkpoint import Checkpoint, full_state_dict, open_checkpoint, param_names
from .folders import atomic_path, atomic_write, check_out_dir, remove_tree
from .integrity import seal, sha256_file, sidecar, sidecar_text
from .resources import describe


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
    remove_tree(dst)                        # a link is removed itself, never followed
    dst.mkdir(parents=True)
    files, hashes = {}, {}
    for r, state in enumerate(ckpt.ranks):
        units = {name: {"params": t["params"].clone(), "master": t["params"].float(),
                        "exp_avg": torch.zeros_like(t["exp_avg"]),
                        "exp_avg_sq": torch.zeros_like(t["exp_avg_sq"])}
                 for name, t in state["units"].items()}
        kept = {k: v for k, v in state.items() if k != "steps"}    # every count: 0
        torch.save({**kept, "units": units}, dst / f"rank{r}.pt")
        files[f"rank{r}.pt"] = (dst / f"rank{r}.pt").stat().st_size
        hashes[f"rank{r}.pt"] = sha256_file(dst / f"rank{r}.pt")
    atomic_write(dst / "meta.json", json.dumps(seal({**ckpt.meta, "files": files, "sha256": hashes,
                                                     "optimizer_step": 0}), indent=1))
    return dst


def check_target(path, what: str) -> Path:
    """ValueError (one line) unless `path` can become a file: not a folder, in a folder that is
    (or can be made) writable."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a folder; give a file path in it "
                         f"(e.g. {str(p / 'model.pt')!r})")
    check_out_dir(p.parent, f"{what} {str(p)!r}: its folder")
    return p


def _export(path: Path, write) -> Path:
    """write(tmp) into a temporary file beside `path`, then rename it to `path` and write
    NAME.sha256 beside it. OSError (a full disk) becomes one line naming what ran out."""
    try:
        with atomic_path(path) as tmp:
            write(tmp)
        atomic_write(sidecar(path), sidecar_text(path, sha256_file(path)))
    except OSError as err:
        why = describe(err)
        raise ValueError(f"cannot write {str(path)!r}: {why[0] if why else err}; nothing was "
                         f"written there; {why[1] if why else 'choose another path'}") from None
    return path


def consolidate_command(args) -> int:
    """`zerolab checkpoint consolidate DIR OUT [--safetensors] [--optimizer PATH] [--dcp DIR]`."""
    out = check_target(args.out, "OUT")
    if args.optimizer:
        check_target(args.optimizer, "--optimizer")
    if args.dcp:
        if Path(args.dcp).exists() and not Path(args.dcp).is_dir():
            raise ValueError(f"--dcp {args.dcp!r} is a file; give a folder path")
        check_out_dir(args.dcp, "--dcp")
    if args.safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("--safetensors needs the safetensors package (pip install "
                             "safetensors), or omit it for a torch.save file") from None
    state_dict, ckpt = consolidate(args.dir)
    if args.safetensors:        # safetensors stores no shared tensors: the tied key gets a copy
        _export(out, lambda tmp: save_file({k: v.clone().contiguous() for k, v in state_dict.items()},
                                           str(tmp), metadata={"step": str(ckpt.step), "format": "pt"}))
    else:
        _export(out, lambda tmp: torch.save(state_dict, tmp))
    print(f"wrote {out} (and {sidecar(out).name}): {len(state_dict)} keys, fp32, step "
          f"{ckpt.step}, from {ckpt.world_size} rank file(s) of stage {ckpt.stage} at {ckpt.folder}")
    if args.optimizer:
        optim = optimizer_state_dict(ckpt, state_dict)
        _export(Path(args.optimizer), lambda tmp: torch.save(optim, tmp))
        print(f"wrote {args.optimizer}: AdamW state in torch's optimizer.state_dict() layout "
              f"({len(ckpt.index)} trainable parameters; frozen, in model.pt only: "
              f"{', '.join(ckpt.frozen) or 'none'})")
    if args.dcp:
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
        dcp = Path(args.dcp)
        try:
            dcp.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dcp.name}.", suffix=".pt", dir=dcp.parent)
            os.close(fd)                        # a temporary file of its own: never a link
            try:
                torch.save(state_dict, tmp)
                torch_save_to_dcp(tmp, dcp)
            finally:
                os.unlink(tmp)
        except OSError as err:
            why = describe(err)
            raise ValueError(f"cannot write --dcp {args.dcp!r}: {why[0] if why else err}; "
                             f"{why[1] if why else 'choose another folder'}") from None
        print(f"wrote {args.dcp}: torch.distributed.checkpoint format (loads into FSDP2 at any N)")
    return 0
