"""`held_bytes`: what a wrapped model and its optimizer hold on this rank, by state, in bytes.

The measured column next to `theory.model_state_bytes` for a learner's own model: the distinct
storages behind the parameters, the gradients (the strategy's buckets and shards included) and
the optimizer's state (the loop's optimizer, or a ZeroRedundancyOptimizer's pieces), each
counted once however many views point into it.
"""
from __future__ import annotations

import torch

from ..sharding import storage_bytes


def held_bytes(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: bytes on this rank. model: a
    DistributedDataParallel, a fully_shard'ed module, or any module; optimizer: any torch
    optimizer or a ZeroRedundancyOptimizer (its per-rank state and fp32 masters). Between steps
    (after optimizer.step()) the figures are the resident model states of the notes' table."""
    strategy = getattr(model, "strategy", None)
    fsdp = getattr(model, "_zerolab_fsdp", None)
    if fsdp is not None and fsdp.strategy is not None:
        strategy = fsdp.strategy
    params = list(model.parameters())
    grads = [p.grad for p in params]
    extra_params = []
    if strategy is not None:
        for u in strategy.units:
            grads += [getattr(u, "grad_flat", None), getattr(u, "grad_shard", None),
                      getattr(u, "grad_master", None)]
            if getattr(u, "param_shard", None) is not None:
                extra_params.append(u.param_shard)
    inner = getattr(optimizer, "optim", optimizer)
    states = [t for s in (inner.state.values() if inner is not None else ())
              for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    masters = [u.master for u in getattr(optimizer, "units", ())]
    p_ptrs = {t.untyped_storage().data_ptr() for t in params}
    states += [m for m in masters if m.untyped_storage().data_ptr() not in p_ptrs]
    out = {"params": storage_bytes(params + extra_params), "grads": storage_bytes(grads),
           "optimizer": storage_bytes(states)}
    out["total"] = sum(out.values())
    return out
