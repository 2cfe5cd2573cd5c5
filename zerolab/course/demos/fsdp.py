"""FSDP2 next to zerolab: the same GPT on the same data, the same losses, every collective counted.

Idea (notebooks/08_fsdp.ipynb): PyTorch's FSDP is an implementation of ZeRO. `fully_shard` with
`reshard_after_forward=True` frees each block's gathered weights after forward and gathers them
again for backward (FULL_SHARD, ZeRO-3); with `False` it keeps them until backward is done
(SHARD_GRAD_OP: ZeRO-2's traffic, but it reshards after backward, so between steps it holds
ZeRO-3's bytes). This program trains zerolab's ZeRO-2 / ZeRO-3, FSDP2 in both modes (and the
default), torch's ZeRO-1 (DDP + `ZeroRedundancyOptimizer`) and a single-process AdamW reference,
one after another from the same seed and batches, all in fp32 so that the losses can be compared
to rounding. Every run samples the bytes of weights, gradients and exp_avg / exp_avg_sq its rank
holds (`torch_held` / `zerolab_held`, at each block's start and after forward, backward and the
step): what is held between steps and the peak within a step. A small TorchDispatchMode sees every c10d
collective (zerolab's and FSDP2's alike) with its size and process group: an independent count
next to zerolab's ledger. With `--replicate 2` (4 ranks) it then also builds FSDP2's hybrid
layout: a 2-D mesh (replicate, shard), parameters sharded within a group of 2 and replicated
across the 2 groups; the comparison runs first on the first shard group (ranks 0-1) while the
other ranks wait, so that one launch does both.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zerolab.course.demos.fsdp --out runs/fsdp
    python -m torch.distributed.run --standalone --nproc-per-node 4 -m zerolab.course.demos.fsdp --replicate 2 --out runs/fsdp

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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from ...comm import Comm
from ...variants.compose import make_strategy
from ...data import get_batch, load_tokens, rank_slice
from ...model import GPT, get_config, num_params
from ...sharding import decays, make_optimizer, storage_bytes

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


# --- what a rank holds: the same count for zerolab, FSDP2 and torch's ZeRO-1 -----------------
def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def torch_held(model, optimizer, sharded=()) -> dict[str, int]:
    """Bytes this rank holds now (distinct storages; a DTensor counts its local shard; freed
    storages count 0): "weights" = the parameters registered on the modules now (FSDP2 swaps in
    the unsharded ones while a unit is gathered) plus `sharded` (FSDP2's sharded DTensors, which
    stay allocated); "grads" = their .grad; "optimizer" = every non-scalar tensor of
    `optimizer.state` (exp_avg, exp_avg_sq)."""
    params = [*sharded, *model.parameters()]
    state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
    return {"weights": storage_bytes(_local(p) for p in params),
            "grads": storage_bytes(_local(p.grad) for p in params if p.grad is not None),
            "optimizer": storage_bytes(_local(v) for st in state.values() for v in st.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0)}


def zerolab_held(strategy) -> dict[str, int]:
    """The same three numbers from a zerolab strategy's `state_tensors()`: weights = resident
    params + gathered_params, grads = grads + grad_buckets, optimizer = exp_avg + exp_avg_sq
    (zerolab's separate fp32 master copy is left out: FSDP2 and torch have none in fp32)."""
    ts = strategy.state_tensors()
    return {"weights": storage_bytes([*ts["params"], *ts.get("gathered_params", [])]),
            "grads": storage_bytes([*ts["grads"], *ts.get("grad_buckets", [])]),
            "optimizer": storage_bytes([*ts["exp_avg"], *ts["exp_avg_sq"]])}


class Sampler:
    """Samples `held()` at named points of a step: as each block starts its forward (after the
    strategy's own pre-forward hook has gathered it), and where `step_fn` calls it ("forward
    done", "backward done", "step done"). `rows` holds the samples of the current step."""

    def __init__(self, held, blocks):
        self.held, self.rows = held, []
        for i, block in enumerate(blocks):   # registered last: runs after FSDP2's / zerolab's gather
            block.register_forward_pre_hook(lambda *_, i=i: self(f"forward block.{i}"))

    def __call__(self, tag):
        self.rows.append({"tag": tag, **self.held()})


# --- the runs: each returns its losses and the collectives of every step --------------------
def train(step_fn, args, tokens, cfg, group=None, sampler=None) -> dict:
    """Run `args.steps` steps of `step_fn(step, x, y, counter) -> local loss` on the ranks of
    `group` (None: all); average the loss over them (outside the counter).
    Returns {"losses", "collectives": [[rows of step 0], ...], "held": [[samples], ...]}."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    losses, per_step, held = [], [], []
    for step in range(args.steps):
        x, y = get_batch(tokens, step, args.batch_size, cfg.block_size, args.seed)
        xm, ym = rank_slice(x, rank, n), rank_slice(y, rank, n)
        if sampler is not None:
            sampler.rows = []
        with CollectiveCounter() as counter:
            loss = step_fn(step, xm, ym, counter).detach().clone()
        dist.all_reduce(loss, group=group)
        losses.append(loss.item() / n)
        per_step.append(counter.rows)
        held.append(sampler.rows if sampler is not None else [])
    return {"losses": losses, "collectives": per_step, "held": held}


def fresh_model(cfg, seed) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)                                             # fp32 everywhere


def run_zerolab(stage, args, tokens, cfg, group=None) -> dict:
    """zerolab's ZeRO-2 or ZeRO-3 (fp32, no clipping) over `group`, with its ledger."""
    comm = Comm(group=group)
    # ZeRO-3 one block at a time, like FSDP2's forward on CPU (no stream to prefetch on); zerolab's
    # default gathers one block ahead (prefetch.DEFAULT_PREFETCH)
    kwargs = {"prefetch": 0} if stage == 3 else {}      # (zerolab/variants/prefetch.py's variant)
    strategy = make_strategy(stage, fresh_model(cfg, args.seed), comm, max_grad_norm=0.0,
                             lr=args.lr, weight_decay=args.weight_decay, **kwargs)

    sample = Sampler(lambda: zerolab_held(strategy), strategy.model.blocks)

    def step_fn(step, x, y, counter):
        comm.step = step
        counter.phase = "forward"
        loss = strategy.forward(x, y)
        sample("forward done")
        counter.phase = "backward"
        strategy.backward(loss)
        sample("backward done")
        counter.phase = "step"
        strategy.step()
        sample("step done")
        return loss

    out = train(step_fn, args, tokens, cfg, group, sample)
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
    sharded = list(model.parameters())                          # the DTensor shards
    optimizer = make_optimizer(sharded, lr=args.lr, weight_decay=args.weight_decay)
    sample = Sampler(lambda: torch_held(model, optimizer, sharded), model.blocks)
    out = train(_torch_step(model, optimizer, sample), args, tokens, cfg,
                mesh.get_group() if mesh.ndim == 1 else None, sample)
    out["model"] = model
    return out


def _torch_step(model, optimizer, sample):
    """One step of a torch-wrapped model (FSDP2 or DDP): forward, backward, step, zero_grad
    (grads set to None), with `sample` after each phase."""
    def step_fn(step, x, y, counter):
        counter.phase = "forward"
        loss = model(x, y)
        sample("forward done")
        counter.phase = "backward"
        loss.backward()
        sample("backward done")
        counter.phase = "step"
        optimizer.step()
        optimizer.zero_grad()
        sample("step done")
        return loss
    return step_fn


def run_torch_zero1(args, tokens, cfg, group) -> dict:
    """torch's own ZeRO-1: DDP (all_reduce of every gradient, in buckets) plus
    `torch.distributed.optim.ZeroRedundancyOptimizer` over plain AdamW (same hyper-parameters):
    each rank keeps exp_avg / exp_avg_sq of its own whole parameters (greedy partition by size,
    not flat ranges), updates them, and broadcasts them to the others (one broadcast per rank
    with `parameters_as_bucket_view=True`)."""
    model = DDP(fresh_model(cfg, args.seed), process_group=group)
    ref = make_optimizer([torch.zeros(1)], lr=args.lr, weight_decay=args.weight_decay).defaults
    params = list(model.parameters())       # the same decay groups as make_optimizer
    optimizer = ZeroRedundancyOptimizer(
        [{"params": [p for p in params if decays(p)]},
         {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
        optimizer_class=torch.optim.AdamW, process_group=group,
        parameters_as_bucket_view=True,
        **{k: ref[k] for k in ("lr", "betas", "eps", "weight_decay")})
    sample = Sampler(lambda: torch_held(model, optimizer), model.module.blocks)
    return train(_torch_step(model, optimizer, sample), args, tokens, cfg, group, sample)


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
    runs["torch ZeroRedundancyOptimizer"] = run_torch_zero1(args, tokens, cfg, group)
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
    p = argparse.ArgumentParser(prog="zerolab.course.demos.fsdp", description=__doc__.split("\n")[0])
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
    from ...run.rank import rank_entry
    rank_entry(main)
