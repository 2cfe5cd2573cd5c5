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

from .. import theory
from ..comm import Comm
from ..variants.loopstep import LoopStepDDP
from ..sharding import module_blocks
from .backward import Backward, not_picklable


class DistributedDataParallel(torch.nn.Module):
    """torch.nn.parallel.DistributedDataParallel's interface (the reference), zerolab's DDP inside.

    module: any nn.Module (fp32 or low precision; its trainable parameters share one dtype per
    bucket). The arguments are torch's, in torch's order. process_group: a torch.distributed
    group (None: the default) unless `comm` (a zerolab.comm.Comm) is given. bucket_cap_mb: MiB
    (2**20 bytes) of gradients per all_reduce (None: torch's 25). find_unused_parameters: as
    torch's (one all_reduce of a flag per parameter a step). broadcast_buffers: rank 0's
    buffers are broadcast before every forward, as torch does. Rank 0's parameters and buffers
    are broadcast at construction, whatever init_sync says (replicas that start apart would
    only drift). device_ids / output_device: the module's own device is used (one device per
    rank, torch's recommended use); gradient_as_bucket_view, static_graph, check_reduction:
    accepted, no effect (gradients are always bucket views). dim other than 0 is refused.
    Attributes: module, comm (the ledger: `comm.records`), strategy (zerolab.variants.loopstep.LoopStepDDP).
    Raises RuntimeError (torch.distributed not initialised) and ValueError (bucket_cap_mb not a
    number > 0, dim != 0, device_ids naming more than one device), one line each."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, *, comm=None):
        super().__init__()
        if dim != 0:
            raise ValueError(f"dim {dim!r}: zerolab's DistributedDataParallel does not scatter "
                             "inputs; each rank passes its own batch (dim=0)")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"device_ids {device_ids!r}: one device per rank (torch's "
                             "multi-device DDP is deprecated too)")
        if bucket_cap_mb is not None:
            if isinstance(bucket_cap_mb, (bool, str)):
                raise ValueError(f"bucket_cap_mb {bucket_cap_mb!r} must be a number > 0 (MiB)")
            theory.check_finite("bucket_cap_mb", bucket_cap_mb, positive=True)
        if any(getattr(m, "_zerolab_fsdp", None) is not None for m in module.modules()):
            raise ValueError(f"{type(module).__name__} was given to fully_shard already: it "
                             "holds only shards; DistributedDataParallel over it is not offered")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameter that requires a gradient: "
                             "DistributedDataParallel has nothing to average (torch refuses too)")
        self.module = module
        self.comm = comm if comm is not None else Comm(process_group)
        blocks = None if hasattr(module, "zero_units") else module_blocks(module)
        self.strategy = LoopStepDDP(module, self.comm, blocks=blocks,
                                    bucket_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
                                    find_unused_parameters=find_unused_parameters)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self._backward = Backward(self.strategy.begin_backward, self.strategy.end_backward)

    def __getstate__(self):
        raise TypeError(not_picklable("DistributedDataParallel", "model.module.state_dict()"))

    def forward(self, *args, **kwargs):
        self._backward.reset()
        phase = "forward" if torch.is_grad_enabled() else "eval"      # (as the stages name it)
        if self.broadcast_buffers and self.comm.world_size > 1:
            buffers = [b for b in self.module.buffers() if b.numel()]
            with torch.no_grad(), self.comm.phase(phase):
                for b in buffers:
                    self.comm.broadcast(b, 0, what="init", unit="buffers")
        with self.comm.phase(phase):
            out = self.module(*args, **kwargs)
        return self._backward.arm(out, self.require_backward_grad_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside the block accumulate gradients locally, with no traffic; the first
        backward outside it all_reduces the sum (torch's no_sync)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
