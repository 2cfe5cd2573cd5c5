"""`DistributedDataParallel`: torch's DDP interface over zerolab's DDP strategy (stage 0).

    model = DistributedDataParallel(module, bucket_cap_mb=25)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)      # any torch optimizer
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        loss.backward()             # buckets all_reduced as they fill, overlapped with backward
        opt.step()
        opt.zero_grad()             # set_to_none=True (torch's default) is fine

The gradients live in zerolab's flat buckets (`p.grad` is a view: torch's
gradient_as_bucket_view=True), one bucket per block of the model's own structure
(`sharding.module_blocks`: each module that holds parameters, merged up to `bucket_cap_mb` MiB),
or per block of `module.zero_units()` when it has them.
"""
from __future__ import annotations

import contextlib

import torch

from .. import DDP
from ..comm import Comm
from ..sharding import module_blocks
from .backward import arm


class DistributedDataParallel(torch.nn.Module):
    """torch.nn.parallel.DistributedDataParallel's interface (the reference), zerolab's DDP inside.

    module: any nn.Module (fp32 or low precision; its trainable parameters share one dtype per
    bucket). process_group: a torch.distributed group (None: the default) unless `comm` (a
    zerolab.comm.Comm) is given. bucket_cap_mb: MiB (2**20 bytes) of gradients per all_reduce
    (torch's default 25). find_unused_parameters: as torch's (one all_reduce of a flag per
    parameter a step). broadcast_buffers: rank 0's buffers are broadcast before every forward,
    as torch does. Rank 0's parameters and buffers are broadcast at construction.
    Attributes: module, comm (the ledger: `comm.records`), strategy (zerolab.ddp.DDP).
    Raises RuntimeError (torch.distributed not initialised) and ValueError (bucket_cap_mb not a
    number > 0), one line each."""

    def __init__(self, module, process_group=None, *, bucket_cap_mb=25.0,
                 find_unused_parameters=False, broadcast_buffers=True, comm=None):
        super().__init__()
        self.module = module
        self.comm = comm if comm is not None else Comm(process_group)
        blocks = None if hasattr(module, "zero_units") else module_blocks(module)
        self.strategy = DDP(module, self.comm, bucket_mb=bucket_cap_mb, blocks=blocks,
                            find_unused_parameters=find_unused_parameters, own_step=False)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.comm.world_size > 1:
            buffers = [b for b in self.module.buffers() if b.numel()]
            with torch.no_grad(), self.comm.phase("forward"):
                for b in buffers:
                    self.comm.broadcast(b, 0, what="init", unit="buffers")
        with self.comm.phase("forward"):
            out = self.module(*args, **kwargs)
        sync = self.require_backward_grad_sync
        return arm(out, lambda: self.strategy.begin_backward(sync), self.strategy.end_backward)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside the block accumulate gradients locally, with no traffic; the first
        backward outside it all_reduces the sum (torch's no_sync)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
