"""A parameter that gets no gradient: why DDP frameworks have `find_unused_parameters`.

Idea (notebooks/04_ddp.ipynb): DDP all-reduces a bucket when every parameter in it has its
gradient. A parameter used only in a data-dependent branch gets no gradient on a rank whose
micro-batch skipped the branch, so its bucket never becomes ready there: without a fallback that
bucket is never all-reduced and the ranks drift apart in silence. Here every GPT block is
followed by an `extra` Linear that only rows starting with a byte below `--threshold` use. The
program trains zerolab's DDP (or any `--stage`): without `--find-unused-parameters` the strategy
stops the run at the end of the first backward in which a parameter got no gradient on a rank,
naming it (that rank raises; the launcher stops the others); with it, a fixed all-reduce order,
an end-of-backward fallback and one all_reduce of "used" flags per step make every rank equal a
single-process torch AdamW run on the whole batch (which every rank also trains, as reference),
where a parameter no rank used is left as torch's AdamW leaves it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zerolab.course.demos.unused --out runs/unused
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zerolab.course.demos.unused --find-unused-parameters

Each rank writes OUT/rank{r}.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ... import STRATEGIES
from ...comm import Comm
from ...data import get_batch, load_tokens, rank_slice
from ...model import GPT, get_config
from ...sharding import make_optimizer


class BranchBlock(nn.Module):
    """A GPT block, then `extra` (a Linear) added on the rows whose first byte is below the
    threshold: rows [B] bool, set by the model before each forward. No such row: not called."""

    def __init__(self, block: nn.Module, dim: int):
        super().__init__()
        self.block, self.extra, self.rows = block, nn.Linear(dim, dim), None

    def forward(self, x):
        x = self.block(x)
        if self.rows.any():                             # data-dependent control flow
            x = x + torch.where(self.rows[:, None, None], self.extra(x), 0.0)
        return x


def branchy_gpt(preset: str, threshold: int, seed: int) -> GPT:
    """zerolab's GPT whose every block is a BranchBlock (fp32, same weights for every seed)."""
    torch.manual_seed(seed)
    cfg = get_config(preset)
    model = GPT(cfg)
    model.blocks = nn.ModuleList(BranchBlock(b, cfg.n_embd) for b in model.blocks)

    def mark(module, args):
        for b in module.blocks:
            b.rows = args[0][:, 0] < threshold
    model.register_forward_pre_hook(mark)
    return model


def train(args, tokens, comm) -> dict:
    """zerolab's strategy on this rank's rows; returns its final weights and the ledger."""
    model = branchy_gpt(args.preset, args.threshold, args.seed)
    s = STRATEGIES[args.stage](model, comm, max_grad_norm=0.0, lr=args.lr,
                               find_unused_parameters=args.find_unused_parameters)
    comm.records.clear()
    for step in range(args.steps):
        comm.step = step
        x, y = get_batch(tokens, step, args.batch_size, model.cfg.block_size, args.seed)
        xm, ym = (rank_slice(t, comm.rank, comm.world_size) for t in (x, y))
        s.backward(s.forward(xm, ym))
        s.step()
    params = s.full_parameters()
    s.close()
    return {"params": params, "ledger": comm.to_json()}


def reference(args, tokens) -> dict:
    """One process, the whole batch, torch AdamW with the same groups."""
    model = branchy_gpt(args.preset, args.threshold, args.seed)
    opt = make_optimizer(list(model.parameters()), lr=args.lr)
    for step in range(args.steps):
        x, y = get_batch(tokens, step, args.batch_size, model.cfg.block_size, args.seed)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zerolab.course.demos.unused", description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--preset", default="nano")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (rows)")
    p.add_argument("--threshold", type=int, default=40, help="rows whose first byte is below it "
                   "take the branch (bytes are mostly >= 32: few rows do)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--find-unused-parameters", action="store_true")
    p.add_argument("--out", default="runs/unused")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        comm = Comm()
        tokens, _ = load_tokens(None, get_config(args.preset).block_size)
        ref = reference(args, tokens)
        rows = []                                       # which ranks' rows took the branch
        for step in range(args.steps):
            x, _ = get_batch(tokens, step, args.batch_size, get_config(args.preset).block_size,
                             args.seed)
            rows.append([bool((rank_slice(x, r, comm.world_size)[:, 0] < args.threshold).any())
                         for r in range(comm.world_size)])
        run = train(args, tokens, comm)
        out = {"rank": comm.rank, "world_size": comm.world_size, "stage": args.stage,
               "find_unused_parameters": args.find_unused_parameters,
               "branch_taken_by_rank": rows, "ledger": run["ledger"],
               "max_diff_vs_reference": max((run["params"][k] - ref[k]).abs().max().item()
                                            for k in ref)}
        path = Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"rank{comm.rank}.json").write_text(json.dumps(out, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ...run.rank import rank_entry
    rank_entry(main)
