"""Distributed Muon, owner per parameter: whole matrices assigned to ranks, greedy by size.

Idea (torch's ZeroRedundancyOptimizer, for any optimizer): rank r owns whole parameters - the
largest first, each to the rank owning the fewest elements so far (`muon_theory.assign_owners`)
- and keeps their optimizer state only (Muon's momentum, AdamW's two moments): 1/N of the state
when the owners are even. The gradients are laid out owner by owner in one flat buffer of N
segments of L elements (L: the largest owner's load, the others padded), so one reduce_scatter
brings each owner the summed gradients of its own matrices, whole; the owner steps them with
torch's classes; one all_gather of the same buffer brings every rank every updated parameter.

    per rank a step: reduce_scatter (N-1)·L·b + all_gather (N-1)·L·b bytes (b = element bytes);
    Newton-Schulz only on its own matrices; nothing computed twice.

Cost: one owner holding more than Ψ/N (the embedding, a vocabulary-sized head) makes every
rank's piece L long (bytes) and that owner the step's straggler (time); `imbalance()` reports it.

    opt = MuonOwner(muon_param_groups(model, muon=dict(lr=0.02)), comm=Comm())
"""
from __future__ import annotations

import torch

from . import muon_theory as mt
from .wholeopt import WholeOptimizer


class MuonOwner(WholeOptimizer):
    """Owner-per-parameter layout (WholeOptimizer's arguments; any optimizer_class: Muon,
    Adafactor, Lamb, ...). Attributes: owners[i] (owning rank of parameter i), loads (elements
    owned per rank), L (the padded segment), flat ([N·L], gradients then weights)."""

    layout = "owner"

    # --- who holds what: whole parameters on their owner, one owner-major flat buffer ---------
    def hold(self):
        self.owners = mt.assign_owners(self.numels, self.n, self.group_of)
        self.loads = mt.loads(self.numels, self.owners, self.n)
        self.L = max(self.loads)
        self.offsets, seen = [], [0] * self.n
        for k, r in zip(self.numels, self.owners):
            self.offsets.append(r * self.L + seen[r])
            seen[r] += k
        p0 = self.params[0]
        self.flat = torch.zeros(self.n * self.L, dtype=p0.dtype, device=p0.device)
        self.mine = [i for i, r in enumerate(self.owners) if r == self.rank]
        tensors = {i: self.params[i] for i in self.mine}
        self.whole, self.fallback = self.inner(True, tensors), self.inner(False, tensors)
        self.stepped = {opt: {i: t for i, t in tensors.items() if self.whole_mask[i] == w}
                        for opt, w in ((self.whole, True), (self.fallback, False))}
        self.buffers = [self.flat]

    def piece(self, i):
        return self.flat[self.offsets[i]:self.offsets[i] + self.numels[i]]

    def own_segment(self):
        return self.flat[self.rank * self.L:(self.rank + 1) * self.L]

    # --- reduce: one reduce_scatter brings each owner its matrices' summed gradients ---------
    def reduce(self, used):
        self.flat.zero_()
        for i, p in enumerate(self.params):
            self.piece(i).copy_(self.grad_or_zeros(i, used).reshape(-1))
        self.comm.reduce_scatter(self.own_segment(), self.flat, what="grads", unit="owners")
        self.own_segment().div_(self.n)                     # sum -> average

    # --- route: nothing to move, the owner's segment holds its matrices whole -----------------
    def route(self, used):
        self.grads = {i: self.piece(i) for i in self.mine}      # views: no copy

    # --- update: torch's classes on the owner's whole parameters ------------------------------
    def update(self, used):
        self.step_whole(self.whole, self.grads, used)
        self.step_whole(self.fallback, self.grads, used)
        self.grads = None

    # --- route back: one all_gather of the owners' updated parameters -------------------------
    def route_back(self, used):
        for i in self.mine:
            self.piece(i).copy_(self.params[i].reshape(-1))
        self.comm.all_gather(self.flat, self.own_segment(), what="params", unit="owners")
        for i, p in enumerate(self.params):
            if self.owners[i] != self.rank:
                p.copy_(self.piece(i).view_as(p))

    def imbalance(self) -> dict:
        """Owners' load: elements per rank, max/mean of elements and of Newton-Schulz FLOPs."""
        flops = [c["ns_flops"] for c in self.costs()]
        return {"loads": self.loads, "elements": mt.imbalance(self.loads),
                "ns_flops": mt.imbalance(flops)}
