"""Distributed Muon, replicated compute: every rank gathers every gradient and steps everything.

Idea (the simplest layout, Megatron-LM#5533's first): the gradients are reduce_scattered into
dim-0 shards as ZeRO-2 does (`wholeopt.Dim0`), then all_gathered, so every rank holds every
summed gradient matrix whole; every rank runs torch's optimizer on every parameter - Muon's
Newton-Schulz on every matrix, N times in all - and ends with the same weights without another
collective. reduce_scatter + all_gather is an all_reduce (the ring does exactly that), so the
bytes are DDP's.

    per rank a step: reduce_scatter (N-1)·S·b + all_gather (N-1)·S·b bytes (S ≈ Ψ/N, each
    parameter's rows padded to a multiple of N); Newton-Schulz on every matrix: (N-1)/N of the
    world's compute is redundant; the whole optimizer state on every rank.

    opt = MuonReplicate(muon_param_groups(model, muon=dict(lr=0.02)), comm=Comm())
"""
from __future__ import annotations

from .wholeopt import Dim0, WholeOptimizer


class MuonReplicate(WholeOptimizer):
    """Replicated-compute layout (WholeOptimizer's arguments; any optimizer_class). Attributes:
    owners (None for every parameter: every rank steps it), dim0 (the flat dim-0 layout)."""

    layout = "replicate"

    # --- who holds what: every parameter's whole state on every rank -------------------------
    def hold(self):
        self.owners = [None] * len(self.params)
        self.dim0 = Dim0(self.params, self.n, self.rank)
        tensors = dict(enumerate(self.params))
        self.whole, self.fallback = self.inner(True, tensors), self.inner(False, tensors)
        self.stepped = {opt: {i: t for i, t in tensors.items() if self.whole_mask[i] == w}
                        for opt, w in ((self.whole, True), (self.fallback, False))}
        self.buffers = [self.dim0.flat]

    # --- reduce: a reduce_scatter into dim-0 shards, averaged ---------------------------------
    def reduce(self, used):
        self.dim0.reduce_scatter(self.comm, (self.grad_or_zeros(i, used)
                                             for i in range(len(self.params))))

    # --- route: an all_gather of every shard: every rank holds every matrix whole -------------
    def route(self, used):
        d = self.dim0
        self.comm.all_gather(d.flat, d.grid()[self.rank], what="grads", unit="dim0")
        self.grads = {i: d.unpack(i) for i in range(len(self.params))}

    # --- update: torch's classes on every parameter, on every rank ----------------------------
    def update(self, used):
        self.step_whole(self.whole, self.grads, used)
        self.step_whole(self.fallback, self.grads, used)
        self.grads = None

    # --- route back: nothing to move, every rank computed the same weights --------------------
    def route_back(self, used):
        pass
