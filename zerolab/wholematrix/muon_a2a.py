"""Distributed Muon, gather-to-owner on a sharded layout: all_to_all the shards to one owner.

Idea (torchtitan's DistributedMuon, pytorch/torchtitan#4060): the
gradients are reduce_scattered into dim-0 shards as ZeRO-2 does (`wholeopt.Dim0`); the
element-wise fallback (AdamW) steps its shards right there, as ZeRO does; each matrix has an
owner (greedy by size over the matrices only, `muon_theory.assign_owners`), and one all_to_all
sends every rank's shards of every matrix to its owner, which joins them (whole gradient),
runs Muon's momentum and Newton-Schulz, and a second all_to_all sends each rank its rows of the
update. The owner never needs the weights: its torch.optim.Muon steps a zero "direction"
tensor with lr = -1, weight_decay 0 and no lr adjustment (an adjust_lr_fn outside torch's two
names: ratio 1), which leaves exactly O = orthogonalised(momentum) in it; each rank applies
torch's two operations to its own rows, p.mul_(1 - lr·wd) then p.add_(O, alpha=-lr') with lr'
torch's adjusted lr (`_adjust_lr`) - the same roundings as one process - so it would work as
well on ZeRO-3's sharded weights. A final all_gather
makes the replicated weights equal (ZeRO-2's; under ZeRO-3 it is the next forward's gather).
The AdamW step runs while the first all_to_all is in flight (overlap).

    per rank a step: reduce_scatter (N-1)·S·b, all_to_all Σ_{m not r's} s_m·b there and
    (N-1)·Σ_{m r's} s_m·b back, all_gather (N-1)·S·b; Newton-Schulz on its own matrices only.

Only an optimizer whose update does not read the weights fits (torch.optim.Muon); Adafactor
(the weights' RMS) and LAMB (their norm) are refused in one line: use MuonOwner or
MuonReplicate.

    opt = MuonAllToAll(muon_param_groups(model, muon=dict(lr=0.02)), comm=Comm())
"""
from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr

from . import muon_theory as mt
from .wholeopt import Dim0, WholeOptimizer


NO_ADJUST = "zerolab-none"        # torch's _adjust_lr: a name not its own -> ratio 1.0


class MuonAllToAll(WholeOptimizer):
    """Gather-to-owner layout (WholeOptimizer's arguments; optimizer_class must be
    torch.optim.Muon or a subclass: ValueError otherwise). Attributes: owners[i] (owner of
    matrix i; None for the fallback's parameters), dim0, pieces (this rank's rows of each
    fallback parameter, what the fallback steps), directions (the owner's zero tensors)."""

    layout = "a2a"

    def __init__(self, params, optimizer_class=torch.optim.Muon, **kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Muon)):
            raise ValueError(f"MuonAllToAll steps only torch.optim.Muon on its owners (the update "
                             f"does not read the weights); {getattr(optimizer_class, '__name__', optimizer_class)} "
                             "reads them (Adafactor's RMS, LAMB's norm): use MuonOwner or MuonReplicate")
        super().__init__(params, optimizer_class, **kwargs)

    # --- who holds what: matrices' momentum on their owner, the fallback's state on shards ----
    def hold(self):
        whole = [i for i, w in enumerate(self.whole_mask) if w]
        self.owners = [None] * len(self.params)
        for i, r in zip(whole, mt.assign_owners([self.numels[i] for i in whole], self.n,
                                                [self.group_of[i] for i in whole])):
            self.owners[i] = r
        self.dim0 = d = Dim0(self.params, self.n, self.rank)
        self.mine = [i for i in whole if self.owners[i] == self.rank]
        self.theirs = {r: [i for i in whole if self.owners[i] == r] for r in range(self.n)}
        self.splits = [sum(d.sizes[i] for i in self.theirs[r]) for r in range(self.n)]
        self.T = self.splits[self.rank]             # one rank's shards of this rank's matrices
        p0 = self.params[0]
        self.shards = torch.zeros(sum(self.splits), dtype=p0.dtype, device=p0.device)
        self.gathered = torch.zeros(self.n * self.T, dtype=p0.dtype, device=p0.device)
        self.directions = {i: torch.zeros_like(self.params[i]) for i in self.mine}
        self.pieces = {i: d.mine(i)[0].clone() for i, w in enumerate(self.whole_mask) if not w}
        self.whole = self.inner(True, self.directions, lr=-1.0, weight_decay=0.0,
                                adjust_lr_fn=NO_ADJUST)      # directions = O exactly
        self.fallback = self.inner(False, self.pieces)
        self.stepped = {self.whole: self.directions, self.fallback: self.pieces}
        self.buffers = [d.flat, self.shards, self.gathered, *self.directions.values(),
                        *self.pieces.values()]

    def _theirs_offsets(self, r):
        """Column of each of rank r's matrices in a [N, splits[r]] block."""
        out, off = {}, 0
        for i in self.theirs[r]:
            out[i], off = off, off + self.dim0.sizes[i]
        return out

    # --- reduce: a reduce_scatter into dim-0 shards, averaged ---------------------------------
    def reduce(self, used):
        self.dim0.reduce_scatter(self.comm, (self.grad_or_zeros(i, used)
                                             for i in range(len(self.params))))

    # --- route: every rank's shards of each matrix to its owner (one all_to_all, async) -------
    def route(self, used):
        d, own, at = self.dim0, self.dim0.grid()[self.rank], 0
        for r in range(self.n):
            for i in self.theirs[r]:
                s = d.sizes[i]
                self.shards[at:at + s].copy_(own[d.offsets[i]:d.offsets[i] + s])
                at += s
        self.inflight = self.comm.all_to_all(self.gathered, self.shards, [self.T] * self.n,
                                             self.splits, what="grads", unit="to_owner",
                                             async_op=True)

    # --- update: AdamW on the shards while the shards travel, then Muon on the owner's --------
    def update(self, used):
        d = self.dim0
        grads = {i: d.mine(i)[0] for i in self.pieces}
        for i, piece in self.pieces.items():                 # this rank's rows, current weights
            _, lo, hi = d.mine(i)
            piece.copy_(self.params[i].reshape(mt.rows(self.shapes[i]), -1)[lo:hi].reshape(-1))
        self.step_whole(self.fallback, grads, used)          # overlaps the all_to_all
        self.inflight.wait()
        cols = self._theirs_offsets(self.rank)
        whole = {i: d.unpack(i, self.gathered, cols[i]) for i in self.mine}
        for t in self.directions.values():
            t.zero_()
        self.step_whole(self.whole, whole, used)             # directions = NS(momentum)

    # --- route back: each rank's rows of every direction, then the weights' all_gather --------
    def route_back(self, used):
        d, cols = self.dim0, self._theirs_offsets(self.rank)
        for i in self.mine:
            d.pack(i, self.directions[i], self.gathered, cols[i])
        self.comm.all_to_all(self.shards, self.gathered, self.splits, [self.T] * self.n,
                             what="params", unit="from_owner")
        own, at = d.grid()[self.rank], 0
        for r in range(self.n):
            for i in self.theirs[r]:
                mine, lo, hi = d.mine(i)
                g = self.param_groups[self.group_of[i]]
                rows = self.params[i][lo:hi].reshape(-1)
                if used[i]:                                  # torch's order: decay, then add
                    mine.copy_(rows * (1 - g["lr"] * g["weight_decay"]))
                    lr = _adjust_lr(g["lr"], g["adjust_lr_fn"], self.shapes[i])
                    mine.add_(self.shards[at:at + mine.numel()], alpha=-lr)
                else:
                    mine.copy_(rows)
                at += d.sizes[i]
        for i, piece in self.pieces.items():
            d.mine(i)[0].copy_(piece)
        self.comm.all_gather(d.flat, own, what="params", unit="dim0")
        for i, p in enumerate(self.params):
            p.copy_(d.unpack(i))
