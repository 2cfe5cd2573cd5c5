"""Bring your own model: a model that is not the course's GPT, a torch optimizer built by hand, and
torch's own wrapper names - with zerolab's stages underneath, every byte held and sent counted.

Idea (labs/lab7_bring_your_own_model.ipynb): `zerolab.torchlike` gives torch's interfaces -
`DistributedDataParallel`, `ZeroRedundancyOptimizer`, FSDP2's `fully_shard` - over zerolab's own
DDP / ZeRO-1 / ZeRO-3. This program builds a small model of its own from a fixed seed (a CNN
with a frozen stem, or a `torch.nn.TransformerEncoder` classifier with a frozen embedding), an
AdamW in two parameter groups (decay / no decay, chosen by name before any wrapping), and trains
it a few steps with each of

    ddp     DistributedDataParallel(model)                                   DDP (stage 0)
    zero1   DistributedDataParallel(model) + ZeroRedundancyOptimizer(AdamW)  ZeRO-1
    dim0    fully_shard(block, layout="dim0") per block, then the root       ZeRO-3, FSDP2's layout
    flat    fully_shard(block, layout="flat") per block, then the root       ZeRO-3, DeepSpeed / FSDP1's

from the same weights on the same batches, all fp32. Each run writes, per rank: `held_bytes` by
state after the last optimizer step; from the ledger (`comm.records`), every step's bytes and
number of collectives by op; the units (buckets, groups or fully_shard units) with their padding
and this rank's piece of every parameter; the losses; and the largest difference of the trained
weights to the same loop in one process on the whole batch (torch alone).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zerolab.course.demos.byom --out runs/byom

Every rank writes OUT/rank{r}.json.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...sharding import decays
from ...torchlike import DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard, held_bytes
from .rankfiles import write_rank_json

PROGRAM = "zerolab.course.demos.byom"
WRAPPERS = {"ddp": "DistributedDataParallel", "zero1": "DDP + ZeroRedundancyOptimizer",
            "dim0": 'fully_shard layout="dim0"', "flat": 'fully_shard layout="flat"'}
STAGE = {"ddp": 0, "zero1": 1, "dim0": 3, "flat": 3}


# --- two models that are not the course's GPT ----------------------------------------------------
class SmallCNN(nn.Module):
    """Images 3 x 8 x 8 -> 5 classes: a frozen stem (a fixed, "pretrained" feature extractor),
    two blocks Conv-GroupNorm-ReLU with 13 channels (a row count 2 ranks do not divide), a head."""
    classes = 5

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c_in, 13, 3, padding=1), nn.GroupNorm(1, 13), nn.ReLU())
            for c_in in (8, 13))
        self.head = nn.Linear(13, self.classes)
        self.stem.requires_grad_(False)

    def forward(self, x):
        h = F.relu(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean((2, 3)))

    @classmethod
    def batch(cls, g, rows):
        return torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, cls.classes, (rows,), generator=g)


class EncoderClassifier(nn.Module):
    """Token sequences (vocabulary 31, length 7) -> 5 classes: a frozen embedding, a learned
    position embedding of shape (1, T, d) (as ViT's pos_embed: one row), two
    torch.nn.TransformerEncoder layers (d = 21, 3 heads, feed-forward 32: row counts of 21, 63,
    32; each layer 3,329 elements), a head on the mean over tokens."""
    vocab, T, d, heads, ff, classes = 31, 7, 21, 3, 32, 5

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.vocab, self.d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, self.T, self.d))
        layer = nn.TransformerEncoderLayer(self.d, self.heads, self.ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(self.d, self.classes)
        self.emb.requires_grad_(False)

    @property
    def blocks(self):
        return self.encoder.layers

    def forward(self, x):
        return self.head(self.encoder(self.emb(x) + self.pos).mean(1))

    @classmethod
    def batch(cls, g, rows):
        x = torch.randint(0, cls.vocab, (rows, cls.T), generator=g)
        return x, x.sum(1) % cls.classes            # a label the model can learn


MODELS = {"cnn": SmallCNN, "transformer": EncoderClassifier}


def build(name: str, seed: int) -> nn.Module:
    """The model `name` (MODELS) with weights from `seed`: every run starts from the same ones."""
    torch.manual_seed(seed)
    return MODELS[name]()


def decay_names(model: nn.Module) -> set[str]:
    """Names of the trainable parameters that get weight decay (the GPT-2 recipe,
    `sharding.decays`: 2-D and larger). Read on the unwrapped model: once sharded with
    layout "flat" every parameter the optimizer sees is a 1-D piece and p.dim() says nothing."""
    return {n for n, p in model.named_parameters() if p.requires_grad and decays(p)}


def param_groups(module: nn.Module, decay: set[str], weight_decay: float) -> list[dict]:
    """AdamW's two parameter groups over `module`'s trainable parameters, chosen by name."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


# --- one run per wrapper -----------------------------------------------------------------------------
def wrap(key, args, decay):
    """(model, optimizer, comm, module) for wrapper `key`; module: the unwrapped nn.Module."""
    module = build(args.model, args.seed)
    hyper = {"lr": args.lr, "betas": (0.9, 0.95)}
    if key in ("ddp", "zero1"):
        model = DistributedDataParallel(module, bucket_cap_mb=args.bucket_mb)
        groups = param_groups(module, decay, args.weight_decay)
        opt = (torch.optim.AdamW(groups, **hyper) if key == "ddp" else
               ZeroRedundancyOptimizer(groups, torch.optim.AdamW, comm=model.comm, **hyper))
        return model, opt, model.comm, module
    for block in module.blocks:                     # each block one unit, then the root: the rest
        fully_shard(block, layout=key)
    model = fully_shard(module, layout=key)
    opt = torch.optim.AdamW(param_groups(model, decay, args.weight_decay), **hyper)
    return model, opt, model.zerolab_strategy.comm, module


def run(key, args, decay, rank, n, reference) -> tuple[dict, dict]:
    """Train `args.steps` steps with wrapper `key`; return what this rank measured and the
    trained full state dict (`reference`: the single process's, to compare with)."""
    model, opt, comm, module = wrap(key, args, decay)
    losses, held = [], None
    for step in range(args.steps):
        comm.step = step
        x, y = batch(args, step)
        rows = len(x) // n
        loss = F.cross_entropy(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        opt.step()
        held = held_bytes(model, opt)               # between steps: after step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)                       # not through comm: not in the ledger
        losses.append(mean.item() / n)
    out = {"wrapper": WRAPPERS[key], "stage": STAGE[key], "held": held, **ledger(comm, args.steps),
           "losses": losses, "final_loss": losses[-1],
           "shard_dims": {name: p.dim() for name, p in model.named_parameters() if p.requires_grad}}
    if key in ("ddp", "zero1"):
        out["buckets"] = units_of(model.strategy.units)
        full = module.state_dict()
    else:
        out["units"] = units_of(model.zerolab_strategy.units)
        full = model.full_state_dict()              # a collective (ledger phase "eval")
    if key == "zero1":
        out["groups"] = units_of(opt.units)
    out["diff_vs_reference"] = diffs(full, reference)
    return out, full


def diffs(state: dict, reference: dict) -> dict[str, float]:
    """{name: largest |state - reference|}: every tensor of the full state dicts."""
    return {k: (state[k].float() - v.float()).abs().max().item() for k, v in reference.items()}


def ledger(comm, steps) -> dict:
    """The ledger, per step: bytes and count by op of the collectives that move weights or
    gradients (what "params" / "grads"), and the others apart (a flag, a buffer); setup
    (construction's broadcast of rank 0's weights) apart. Read before any "eval" collective."""
    data, other = ("params", "grads"), {}
    per_step = [{"bytes": {}, "count": {}, "other_count": 0, "other_bytes": 0.0}
                for _ in range(steps)]
    setup = {"count": 0, "bytes": 0.0}
    last = []
    for r in comm.records:
        if r.phase == "setup":
            setup["count"] += 1
            setup["bytes"] += r.bytes
            continue
        if r.phase == "eval":
            continue
        row = per_step[r.step]
        if r.what in data:
            row["bytes"][r.op] = row["bytes"].get(r.op, 0.0) + r.bytes
            row["count"][r.op] = row["count"].get(r.op, 0) + 1
        else:
            row["other_count"] += 1
            row["other_bytes"] += r.bytes
            other[f"{r.op} {r.what} {r.unit}"] = r.numel
        if r.step == steps - 1:
            last.append({"phase": r.phase, "op": r.op, "what": r.what, "unit": r.unit,
                         "numel": r.numel, "bytes": r.bytes})
    return {"steps": per_step, "setup": setup, "other_collectives": other, "last_step": last}


def units_of(units) -> list[dict]:
    """A FlatUnit's layout as JSON: elements, padding, and this rank's piece of each parameter."""
    return [{"name": u.name, "layout": u.layout, "numel": u.numel, "padded_numel": u.padded_numel,
             "shard_numel": u.shard_numel, "padding_in_shard": u.padding_in_shard(),
             "params": list(u.names), "shapes": [list(s) for s in u.shapes],
             "offsets": list(u.offsets), "shard_shapes": [list(s) for s in u.shard_shapes()]}
            for u in units]


def batch(args, step):
    """The global batch of `step` (every rank draws the same, then takes its rows)."""
    g = torch.Generator().manual_seed(1000 * args.seed + step)
    return MODELS[args.model].batch(g, args.batch_size)


def single_process(args, decay) -> tuple[dict, list[float]]:
    """The same loop in one process on the whole global batch, torch alone: trained state, losses."""
    model = build(args.model, args.seed)
    opt = torch.optim.AdamW(param_groups(model, decay, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95))
    losses = []
    for step in range(args.steps):
        x, y = batch(args, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def describe(model: nn.Module, decay: set[str]) -> dict:
    params = [{"name": n, "shape": list(p.shape), "numel": p.numel(), "trainable": p.requires_grad,
               "decay": n in decay} for n, p in model.named_parameters()]
    return {"psi": sum(p["numel"] for p in params if p["trainable"]),
            "psi_frozen": sum(p["numel"] for p in params if not p["trainable"]), "params": params}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="transformer", choices=sorted(MODELS))
    p.add_argument("--wrappers", default=",".join(WRAPPERS), help="comma list of " + ", ".join(WRAPPERS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows), all ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/byom")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    keys = [k.strip() for k in args.wrappers.split(",") if k.strip()]
    bad = [k for k in keys if k not in WRAPPERS]
    if bad or not keys or args.steps < 1:
        raise SystemExit(f"--wrappers {args.wrappers!r} must name some of {', '.join(WRAPPERS)} "
                         f"and --steps {args.steps} be >= 1")
    dist.init_process_group("gloo")
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        if args.batch_size % n:
            raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {n} ranks")
        decay = decay_names(build(args.model, args.seed))
        reference, ref_losses = single_process(args, decay)
        result = {"demo": PROGRAM, "rank": rank, "world_size": n, "model": args.model,
                  "model_class": MODELS[args.model].__name__, "steps": args.steps,
                  "batch_size": args.batch_size, "lr": args.lr, "weight_decay": args.weight_decay,
                  "bucket_mb": args.bucket_mb, "seed": args.seed, "precision": "fp32",
                  "backend": "gloo", **describe(build(args.model, args.seed), decay),
                  "reference_losses": ref_losses, "wrappers": {}}
        trained = {}
        for key in keys:
            out, full = run(key, args, decay, rank, n, reference)
            if key != "ddp" and "ddp" in trained:         # the same split of the batch as DDP
                out["diff_vs_ddp"] = diffs(full, trained["ddp"])
            trained[key] = full
            result["wrappers"][key] = out
            dist.barrier()
        write_rank_json(args.out, rank, result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ...run.rank import rank_entry
    rank_entry(main)
