"""FSDP2 next to zerolab: the same GPT on the same data, the same losses, every collective counted.

Idea (notebooks/08_fsdp.ipynb): PyTorch's FSDP is an implementation of ZeRO. `fully_shard` with
`reshard_after_forward=True` frees each block's gathered weights after forward and gathers them
again for backward (FULL_SHARD, ZeRO-3); with `False` it keeps them until backward is done
(SHARD_GRAD_OP, ZeRO-2). This program trains zerolab's ZeRO-2 / ZeRO-3 and FSDP2 in both modes,
plus a single-process AdamW reference, one after another from the same seed and batches, all in
fp32 so that the losses can be compared to rounding. A small TorchDispatchMode sees every c10d
collective (zerolab's and FSDP2's alike) with its size and process group: an independent count
next to zerolab's ledger. With `--replicate 2` (4 ranks) it then also builds FSDP2's hybrid
layout: a 2-D mesh (replicate, shard), parameters sharded within a group of 2 and replicated
across the 2 groups; the comparison runs first on the first shard group (ranks 0-1) while the
other ranks wait, so that one launch does both.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zerolab.demos.fsdp --out runs/fsdp
    python -m torch.distributed.run --standalone --nproc-per-node 4 -m zerolab.demos.fsdp --replicate 2 --out runs/fsdp

Ranks of the comparison write OUT/compare/rank{r}.json, every rank of the hybrid run
OUT/hybrid/rank{r}.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import Comm
from ..data import get_batch, load_tokens, rank_slice
from ..model import GPT, get_config, num_params
from ..sharding import make_optimizer
from ..zero2 import ZeRO2
from ..zero3 import ZeRO3

OPS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
       "broadcast": "broadcast"}


class CollectiveCounter(TorchDispatchMode):
    """Records every c10d collective issued inside the `with` block: op, full size S (elements,
    the largest tensor argument), dtype, the ranks of its group, and the caller-set `phase`."""

    def __init__(self):
        super().__init__()
        self.rows, self.phase = [], "setup"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            op = next((v for k, v in OPS.items() if k in name), None)
            if op is not None:
                self.rows.append({"phase": self.phase, "op": op, "c10d": name,
                                  **_size_and_group(args)})
        return func(*args, **(kwargs or {}))


def _size_and_group(args) -> dict:
    numel, dtype, ranks = 0, None, None
    for a in args:
        tensors = a if isinstance(a, (list, tuple)) else [a]
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        if tensors and sum(t.numel() for t in tensors) > numel:
            numel, dtype = sum(t.numel() for t in tensors), str(tensors[0].dtype)
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))
    return {"numel": numel, "dtype": dtype, "group": ranks}


# --- the runs: each returns its losses and the collectives of every step --------------------
def train(step_fn, args, tokens, cfg, group=None) -> dict:
    """Run `args.steps` steps of `step_fn(step, x, y, counter) -> local loss` on the ranks of
    `group` (None: all); average the loss over them (outside the counter).
    Returns {"losses", "collectives": [[rows of step 0], ...]}."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    losses, per_step = [], []
    for step in range(args.steps):
        x, y = get_batch(tokens, step, args.batch_size, cfg.block_size, args.seed)
        xm, ym = rank_slice(x, rank, n), rank_slice(y, rank, n)
        with CollectiveCounter() as counter:
            loss = step_fn(step, xm, ym, counter).detach().clone()
        dist.all_reduce(loss, group=group)
        losses.append(loss.item() / n)
        per_step.append(counter.rows)
    return {"losses": losses, "collectives": per_step}


def fresh_model(cfg, seed) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)                                             # fp32 everywhere


def run_zerolab(stage, args, tokens, cfg, group=None) -> dict:
    """zerolab's ZeRO-2 or ZeRO-3 (fp32, no clipping) over `group`, with its ledger."""
    comm = Comm(group=group)
    strategy = {2: ZeRO2, 3: ZeRO3}[stage](fresh_model(cfg, args.seed), comm, max_grad_norm=0.0,
                                            lr=args.lr, weight_decay=args.weight_decay)

    def step_fn(step, x, y, counter):
        comm.step = step
        counter.phase = "forward"
        loss = strategy.forward(x, y)
        counter.phase = "backward"
        strategy.backward(loss)
        counter.phase = "step"
        strategy.step()
        return loss

    out = train(step_fn, args, tokens, cfg, group)
    out["ledger"] = [{"step": r.step, "phase": r.phase, "op": r.op, "unit": r.unit,
                      "numel": r.numel, "group_size": r.group_size, "bytes": r.bytes}
                     for r in comm.records if r.what in ("grads", "params")]
    return out


def shard_model(model, mesh, reshard):
    """fully_shard bottom-up: each block is one group (one all-gather / reduce-scatter), then
    the root (tied embedding/head, position embedding, final LayerNorm)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def run_fsdp2(reshard, args, tokens, cfg, mesh) -> dict:
    """FSDP2 with `reshard_after_forward=reshard` on `mesh`, plain torch AdamW (same hyper-
    parameters as zerolab's make_optimizer) over the sharded DTensor parameters."""
    model = shard_model(fresh_model(cfg, args.seed), mesh, reshard)
    optimizer = make_optimizer(list(model.parameters()), lr=args.lr,
                               weight_decay=args.weight_decay)

    def step_fn(step, x, y, counter):
        counter.phase = "forward"
        loss = model(x, y)
        counter.phase = "backward"
        loss.backward()
        counter.phase = "step"
        optimizer.step()
        optimizer.zero_grad()
        return loss

    out = train(step_fn, args, tokens, cfg, mesh.get_group() if mesh.ndim == 1 else None)
    out["model"] = model
    return out


def run_reference(args, tokens, cfg) -> list[float]:
    """One process, the whole global batch, plain AdamW: what every sharded run must equal."""
    model = fresh_model(cfg, args.seed)
    optimizer = make_optimizer(list(model.parameters()), lr=args.lr,
                               weight_decay=args.weight_decay)
    losses = []
    for step in range(args.steps):
        x, y = get_batch(tokens, step, args.batch_size, cfg.block_size, args.seed)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# --- the two programs ------------------------------------------------------------------------
def compare(args, tokens, cfg, mesh) -> dict:
    """zerolab ZeRO-2/3 and FSDP2 (reshard True / False / None) on the ranks of a 1-D mesh."""
    group = mesh.get_group()
    runs = {"zerolab ZeRO-2": run_zerolab(2, args, tokens, cfg, group),
            "zerolab ZeRO-3": run_zerolab(3, args, tokens, cfg, group)}
    for label, reshard in (("FSDP2 reshard_after_forward=False", False),
                           ("FSDP2 reshard_after_forward=True", True),
                           ("FSDP2 reshard_after_forward=None", None)):
        runs[label] = run_fsdp2(reshard, args, tokens, cfg, mesh)
        runs[label].pop("model")
    return {"runs": runs, "group": dist.get_process_group_ranks(group)}


def hybrid(args, tokens, cfg, mesh) -> dict:
    """HSDP: shard within each row of a (replicate, shard) mesh, replicate across rows."""
    run = run_fsdp2(True, args, tokens, cfg, mesh)
    model = run.pop("model")
    wte = model.wte.weight                                      # DTensor [256, C], Shard(0)
    local = wte.to_local()
    coord = mesh.get_coordinate()
    rows = wte.shape[0] // mesh.size(1)
    return {"runs": {"FSDP2 hybrid": run},
            "mesh": mesh.mesh.tolist(), "mesh_dim_names": list(mesh.mesh_dim_names),
            "coordinate": coord,
            "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
            "replicate_group": dist.get_process_group_ranks(mesh.get_group("replicate")),
            "placements": [str(p) for p in wte.placements],
            "wte_rows": [coord[1] * rows, (coord[1] + 1) * rows],
            "wte_local_shape": list(local.shape),
            "wte_local_checksum": float(local.detach().double().sum()),
            "wte_local_head": [round(v, 6) for v in local.detach().reshape(-1)[:3].tolist()]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerolab.demos.fsdp", description=__doc__.split("\n")[0])
    p.add_argument("--replicate", type=int, default=1,
                   help="replica groups: > 1 adds the hybrid run on a (replicate, shard) mesh")
    p.add_argument("--preset", default="nano")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (rows), all ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/fsdp")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dist.init_process_group("gloo")
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        if n % args.replicate or args.batch_size % n:
            raise ValueError(f"world size {n} must be divisible by --replicate {args.replicate} "
                             f"and divide --batch-size {args.batch_size}")
        cfg = get_config(args.preset)
        tokens, _ = load_tokens(None, cfg.block_size)
        model = GPT(cfg)
        common = dict(world_size=n, preset=args.preset, steps=args.steps, batch_size=args.batch_size,
                      num_params=num_params(model),
                      units={"root": num_params(model) - sum(num_params(b) for b in model.blocks),
                             **{f"block.{i}": num_params(b) for i, b in enumerate(model.blocks)}},
                      reference=run_reference(args, tokens, cfg) if rank == 0 else None)
        # rows of the mesh are shard groups, columns replicate groups: rank = row * (n / R) + col
        mesh = init_device_mesh("cpu", (args.replicate, n // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
        if mesh.get_coordinate()[0] == 0:                  # the comparison: first shard group only
            write(args.out, "compare", {**compare(args, tokens, cfg, mesh["shard"]), **common,
                                        "rank": dist.get_rank(mesh.get_group("shard")),
                                        "world_size": mesh.size(1)})
        if args.replicate > 1:
            dist.barrier()
            write(args.out, "hybrid", {**hybrid(args, tokens, cfg, mesh), **common, "rank": rank})
        dist.barrier()
        if rank == 0:
            folders = "{compare,hybrid}" if args.replicate > 1 else "compare"
            print(f"wrote {Path(args.out).resolve()}/{folders}/rank*.json", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def write(out, folder, result):
    path = Path(out) / folder
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    from zerolab.launch import rank_entry
    rank_entry(main)
