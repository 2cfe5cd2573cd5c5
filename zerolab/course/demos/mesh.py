"""ZeRO inside the data-parallel group of a 2-D mesh: tensor parallelism across, ZeRO along.

Idea (notebooks/09_tensor_parallel.ipynb, the notes' "tp_size=2, dp_size=4"): 8 ranks form a
(dp=4, tp=2) device mesh. The two ranks of a TP group [0,1] [2,3] [4,5] [6,7] hold the two halves
of every weight of one model replica and compute each layer together: a column-parallel Linear
(each TP rank holds half of the output features) then a row-parallel Linear (half of the input
features), whose partial outputs are all-reduced in the TP group (Megatron's "g"; its backward
twin "f" all-reduces the input gradient). The four ranks of a DP group [0,2,4,6] [1,3,5,7] hold
the *same* TP half for four different slices of the batch; zerolab's ZeRO-2 runs on that group
only, so each rank keeps 1/4 of its TP half of the gradients and optimizer states. A
single-process model with the full weights, trained on the whole batch, is the reference.

    python -m torch.distributed.run --standalone --nproc-per-node 8 -m zerolab.course.demos.mesh --out runs/mesh

Each rank writes OUT/mesh/rank{r}.json (layout, units, losses, both ledgers).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ...comm import Comm
from ...sharding import make_optimizer
from ...zero2 import ZeRO2
from .rankfiles import write_rank_json


# --- the two TP collectives as autograd functions (Megatron's f and g) -----------------------
class CopyToTP(torch.autograd.Function):
    """f: identity in forward; in backward, all_reduce the input gradient over the TP group
    (each TP rank only saw the part of d(loss)/dx that flows through its half of the layer)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad, what="activation_grads", unit="f")
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all_reduce the partial outputs over the TP group in forward; identity in backward."""

    @staticmethod
    def forward(ctx, partial, comm):
        out = partial.clone()
        comm.all_reduce(out, what="activations", unit="g")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPBlock(nn.Module):
    """x [B, D] -> x + W2 gelu(W1 x), W1 [H, D] split by rows and W2 [D, H] by columns."""

    def __init__(self, d_model, hidden, tp_comm):
        super().__init__()
        self.tp = tp_comm
        self.fc = nn.Linear(d_model, hidden // tp_comm.world_size, bias=False)    # column-parallel
        self.proj = nn.Linear(hidden // tp_comm.world_size, d_model, bias=False)  # row-parallel

    def forward(self, x):
        h = F.gelu(self.fc(CopyToTP.apply(x, self.tp)))          # [B, H/tp]
        return x + ReduceFromTP.apply(self.proj(h), self.tp)      # [B, D], summed over TP


class TPModel(nn.Module):
    def __init__(self, d_model, hidden, n_blocks, tp_comm):
        super().__init__()
        self.blocks = nn.ModuleList(TPBlock(d_model, hidden, tp_comm) for _ in range(n_blocks))

    def zero_units(self):
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y)


# --- full weights, the TP slices of them, the data -------------------------------------------
def full_weights(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(W1 [H, D], W2 [D, H]) per block], the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(args.seed)
    return [(torch.randn(args.hidden, args.d_model, generator=g) * 0.2,
             torch.randn(args.d_model, args.hidden, generator=g) * 0.2)
            for _ in range(args.blocks)]


def tp_slices(w1, w2, tp_rank, tp_size):
    """Rows of W1 and columns of W2 that TP rank `tp_rank` holds."""
    h = w1.shape[0] // tp_size
    return w1[tp_rank * h:(tp_rank + 1) * h], w2[:, tp_rank * h:(tp_rank + 1) * h]


def global_batch(step, args):
    """(x, y) [batch, D]: the same on every rank; DP rank d takes its own rows."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch_size, args.d_model, generator=g)
    return x, torch.sin(x.flip(1))


def reference(args, weights) -> tuple[list[float], list[torch.Tensor]]:
    """One process, full weights, whole batch, plain AdamW: what the 8 ranks must reproduce."""
    params = [nn.Parameter(w.clone()) for pair in weights for w in pair]
    optimizer = make_optimizer(params, lr=args.lr, weight_decay=args.weight_decay)
    losses = []
    for step in range(args.steps):
        x, y = global_batch(step, args)
        for w1, w2 in zip(params[0::2], params[1::2]):
            x = x + F.gelu(x @ w1.t()) @ w2.t()
        loss = F.mse_loss(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach() for p in params]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zerolab.course.demos.mesh", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks per TP group)")
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/mesh")
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        dp_size = world // args.tp
        # --- the layout: rows of the mesh are TP groups, columns are DP groups --------------------
        mesh = init_device_mesh("cpu", (dp_size, args.tp), mesh_dim_names=("dp", "tp"))
        tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        tp_comm, dp_comm = Comm(group=tp_group), Comm(group=dp_group)
        dp_rank, tp_rank = mesh.get_coordinate()

        # --- the model: this rank's TP half of every weight, ZeRO-2 over the DP group ----------
        weights = full_weights(args)
        model = TPModel(args.d_model, args.hidden, args.blocks, tp_comm)
        with torch.no_grad():
            for block, (w1, w2) in zip(model.blocks, weights):
                s1, s2 = tp_slices(w1, w2, tp_rank, args.tp)
                block.fc.weight.copy_(s1)
                block.proj.weight.copy_(s2)
        strategy = ZeRO2(model, dp_comm, max_grad_norm=0.0, lr=args.lr,
                         weight_decay=args.weight_decay)

        losses = []
        for step in range(args.steps):
            tp_comm.step = dp_comm.step = step
            x, y = global_batch(step, args)
            rows = args.batch_size // dp_size                     # same rows for both TP ranks
            xm, ym = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
            with tp_comm.phase("forward"):
                loss = strategy.forward(xm, ym)
            with tp_comm.phase("backward"):
                strategy.backward(loss)
            strategy.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp_group)                 # outside the ledgers
            losses.append(mean.item() / dp_size)

        # --- compare with the single-process reference ------------------------------------------
        ref_losses, ref_params = reference(args, weights)
        diffs = []
        for i, block in enumerate(model.blocks):
            s1, s2 = tp_slices(ref_params[2 * i], ref_params[2 * i + 1], tp_rank, args.tp)
            diffs += [(block.fc.weight - s1).abs().max().item(),
                      (block.proj.weight - s2).abs().max().item()]

        def ledger(comm, group):
            ranks = dist.get_process_group_ranks(group)
            return [{"step": r.step, "phase": r.phase, "op": r.op, "what": r.what, "unit": r.unit,
                     "numel": r.numel, "group_size": r.group_size, "group": ranks,
                     "bytes": r.bytes} for r in comm.records]

        result = {
            "rank": dist.get_rank(), "world_size": world, "tp_size": args.tp, "dp_size": dp_size,
            "mesh": mesh.mesh.tolist(), "mesh_dim_names": list(mesh.mesh_dim_names),
            "coordinate": {"dp": dp_rank, "tp": tp_rank},
            "tp_group": dist.get_process_group_ranks(tp_group),
            "dp_group": dist.get_process_group_ranks(dp_group),
            "full_params": sum(w.numel() for pair in weights for w in pair),
            "tp_half_params": sum(p.numel() for p in model.parameters()),
            "units": [{"name": u.name, "numel": u.numel, "padded_numel": u.padded_numel,
                       "shard_numel": u.shard_numel, "start": u.start,
                       "master_numel": u.master.numel(), "grad_shard_numel": u.grad_shard.numel()}
                      for u in strategy.units],
            "losses": losses, "reference_losses": ref_losses,
            "max_weight_diff_vs_reference": max(diffs),
            "ledger": ledger(tp_comm, tp_group) + ledger(dp_comm, dp_group),
        }
        write_rank_json(Path(args.out) / "mesh", result["rank"], result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ...run.rank import rank_entry
    rank_entry(main)
