"""Replicas checked: optimizers that assume every rank starts from the same weights.

torch's DistributedDataParallel, the stages and `fully_shard` copy rank 0's weights to every rank
at construction (`guards.sync_module_states`). An optimizer does not: it is handed parameters,
and torch's optimizers never change a parameter before their first step. So the optimizers here
that keep parameters replicated across ranks - the Muon layouts (`wholeopt`), torchlike's
ZeroRedundancyOptimizer without DDP, torchlike's Adafactor over replicated parameters - check
instead: one all_reduce of a 16-byte hash at construction, and a one-line refusal on every rank
when the ranks differ (a loop that seeded each rank with its own rank is the usual cause). They
never copy silently: that would hide the slip from the rest of the loop (its data order, its
dropout), which the same seed drives.

The hash is exact: every tensor's bytes read as 16-bit words, summed in int64 and weighted by the
tensor's position, so equal tensors give equal hashes on any device and in any order of
summation.
"""
from __future__ import annotations

import torch

MOD = 2**61 - 1


@torch.no_grad()
def fingerprint(tensors) -> int:
    """An exact hash of `tensors`' values (their bytes), in 0 .. 2**61 - 2."""
    h = 0
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.numel() == 0 or t.is_meta:
            continue
        words = t.contiguous().reshape(-1).view(torch.uint8)
        if words.numel() % 2 == 0:
            words = words.view(torch.int16)
        s = int(words.to(torch.int64).sum()) + 7 * int(words[::3].to(torch.int64).sum())
        h = (h * 1_000_003 + (i + 1) * (s % MOD) + t.numel()) % MOD
    return h


def check_replicas(tensors, comm, who: str):
    """Refuse (ValueError, one line, the same on every rank) unless every rank of `comm` holds
    the same values of `tensors`: one all_reduce (max) of 2 int64 (ledger: phase "setup", what
    "init", unit "replicas"). `who`: the class named in the message."""
    if comm is None or comm.world_size == 1 or comm.backend == "fake":
        return
    tensors = list(tensors)
    device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
    if comm.backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    h = fingerprint(tensors)
    flags = torch.tensor([h, -h], dtype=torch.int64, device=device)
    with comm.phase("setup"):
        comm.all_reduce(flags, what="init", unit="replicas", op="max")
    if int(flags[0]) != -int(flags[1]):
        raise ValueError(
            f"{who}: the ranks hold different values of the parameters it steps (e.g. each rank "
            "seeded with its own rank before building the model), so they would train apart; "
            "give every rank the same weights first: torch.manual_seed(0) on every rank before "
            "building the model, or for p in model.parameters(): "
            "torch.distributed.broadcast(p.data, 0)")
