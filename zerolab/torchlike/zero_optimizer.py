"""`ZeroRedundancyOptimizer`: torch's sharded-optimizer interface over zerolab's ZeRO-1 update.

    model = DistributedDataParallel(module)                       # averages the gradients
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Each parameter group's parameters become views of one flat buffer (torch's
parameters_as_bucket_view=True), padded to a multiple of N; rank r keeps the optimizer state of
its own contiguous range of it (`sharding.shard_range`) and updates only that range with the
loop's optimizer class run on the range's per-parameter pieces; `zero1.publish_update` then
all_gathers every rank's range into the buffer - ZeRO-1's step, exactly. torch's class instead
gives whole parameters to ranks (greedily by size) and broadcasts each: uneven when one tensor
dominates, but any optimizer runs. Here only element-wise optimizers run (`optim.check_elementwise`
refuses the others in one line, saying why).
"""
from __future__ import annotations

import torch

from ..comm import Comm
from ..optim import check_elementwise
from ..sharding import FlatUnit
from ..zero1 import publish_update


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch.distributed.optim.ZeroRedundancyOptimizer's interface (the reference).

    params: an iterable of tensors or of parameter-group dicts (each group's own lr,
    weight_decay, ... honoured). optimizer_class: a torch.optim.Optimizer class whose update is
    element-wise (SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, NAdam, RAdam, ASGD,
    Rprop; elementwise=True vouches for another). **defaults: its keyword arguments.
    parameters_as_bucket_view: accepted; always True here (the parameters become views of the
    group's flat buffer). overlap_with_ddp=True is refused.
    process_group / comm: as DistributedDataParallel. Gradients must already be averaged over
    the ranks (a DDP wrapper does it). step(): this rank's range of every group updated (the
    loop's optimizer on per-parameter pieces of it, fp32 masters for low-precision weights),
    then one all_gather per group (ledger: what "params", phase "step"). Parameters whose grad
    is None are skipped, as torch skips them. Attributes: optim (this rank's optimizer over its
    pieces), units (the flat groups), comm.
    Raises TypeError / ValueError (one line) for a class that is not an optimizer or whose update
    reads whole tensors (Adafactor, Muon, LBFGS, ...)."""

    def __init__(self, params, optimizer_class, process_group=None,
                 parameters_as_bucket_view=False, overlap_with_ddp=False, *, comm=None,
                 elementwise=None, **defaults):
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True is not offered: zerolab's ZeRO-1 update runs "
                             "in step(), after backward (torch's runs inside DDP's comm hook)")
        check_elementwise(optimizer_class, elementwise)
        super().__init__(params, defaults)
        self.comm = comm if comm is not None else Comm(process_group)
        self.optimizer_class, self.units, inner = optimizer_class, [], []
        n, rank = self.comm.world_size, self.comm.rank
        for k, group in enumerate(self.param_groups):
            u = FlatUnit(f"group{k}", group["params"], n, rank,
                         names=[f"group{k}[{i}]" for i in range(len(group["params"]))])
            u.param_flat = u.flatten()                          # [Ψ_g] replicated
            u.bind_params(u.param_flat)
            own = u.own(u.param_flat)                           # [Ψ_g/N] this rank's range
            u.master = own if own.dtype == torch.float32 else own.float().clone()
            u.pieces = [torch.nn.Parameter(v) if v.numel() else None
                        for v in u.shard_views(u.master)]       # what the optimizer steps
            self.units.append(u)
            hyper = {key: v for key, v in group.items() if key != "params"}
            inner.append({"params": [p for p in u.pieces if p is not None], **hyper})
        inner = [g for g in inner if g["params"]]
        self.optim = optimizer_class(inner, **defaults) if inner else None
        full = (self.optim or optimizer_class([torch.zeros(1, requires_grad=True)],
                                               **defaults)).defaults
        for group in (*self.param_groups, self.defaults):     # every hyperparameter, as
            for key, value in full.items():                   # torch's class shows them
                group.setdefault(key, value)
        self._inner_groups = [k for k, u in enumerate(self.units)
                              if any(p is not None for p in u.pieces)]

    def add_param_group(self, param_group):
        if getattr(self, "units", None) is not None:
            raise RuntimeError("ZeroRedundancyOptimizer: add_param_group after construction is not "
                               "supported (the flat groups are laid out once)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (torch semantics); returns closure()."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.optim is not None:
            for k, g in zip(self._inner_groups, self.optim.param_groups):   # lr schedulers
                g.update({key: v for key, v in self.param_groups[k].items() if key != "params"})
        with self.comm.phase("step"):
            for u in self.units:
                for p, off, piece, (lo, hi) in zip(u.params, u.offsets, u.pieces,
                                                   u.segments(sharded=True)):
                    if piece is None:
                        continue
                    if p.grad is None:              # torch skips it: no update, no state
                        piece.grad = None
                        continue
                    first = max(u.start - off, 0)       # where this rank's piece begins
                    g = p.grad.reshape(-1)[first:first + (hi - lo)]     # a view: no copy
                    piece.grad = g.view(piece.shape).to(piece.dtype)    # (bf16 grads: fp32)
            if self.optim is not None:
                self.optim.step()
            for u in self.units:                    # the gradients stay the loop's (p.grad)
                for piece in u.pieces:
                    if piece is not None:
                        piece.grad = None
            handles = [publish_update(self.comm, u) for u in self.units]  # own range -> all
            for h in handles:
                h.wait()
        return loss

    def state_dict(self):
        """This rank's optimizer state (its pieces only: torch's Optimizer.state_dict of `optim`)
        with the rank and world size it belongs to. torch's class consolidates every rank's
        state on one rank first; here each rank saves its own (zerolab.run.checkpoint's way)."""
        return {"zerolab_rank": self.comm.rank, "zerolab_world_size": self.comm.world_size,
                "optim": self.optim.state_dict() if self.optim is not None else None}

    def load_state_dict(self, state_dict):
        """Load what `state_dict()` returned on this same rank of a group of the same size;
        ValueError (one line) for another rank's or another world size's state."""
        mine = (self.comm.rank, self.comm.world_size)
        theirs = (state_dict.get("zerolab_rank"), state_dict.get("zerolab_world_size"))
        if theirs != mine:
            raise ValueError(f"this state is rank {theirs[0]} of {theirs[1]}'s shard; rank "
                             f"{mine[0]} of {mine[1]} needs its own (each rank saves and loads "
                             "its own state_dict())")
        if self.optim is not None:
            self.optim.load_state_dict(state_dict["optim"])

    def consolidate_state_dict(self, to: int = 0):
        """Not offered: the state is split by elements, not by parameters, so no rank can hold
        torch's per-parameter layout without the others' ranges. RuntimeError, one line."""
        raise RuntimeError("consolidate_state_dict is not offered: save each rank's own "
                           "state_dict() and load it on the same rank of a group of the same size")
