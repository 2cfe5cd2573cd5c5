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
refuses the others in one line, saying why). As torch's: every parameter of one dense type
(torch's check and message), and `consolidate_state_dict(to)` then `state_dict()` on rank `to`
gives the whole state in torch's per-parameter layout (each parameter's pieces joined), which
`load_state_dict` takes back on every rank - torch's class's too.
"""
from __future__ import annotations

import io

import torch

from ..comm import Comm
from ..optim import check_elementwise
from ..loop.replicas import check_replicas
from ..sharding import FlatUnit
from ..zero1 import publish_update


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch.distributed.optim.ZeroRedundancyOptimizer's interface (the reference).

    params: an iterable of tensors or of parameter-group dicts (each group's own lr,
    weight_decay, ... honoured). optimizer_class: a torch.optim.Optimizer class whose update is
    element-wise (SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, NAdam, RAdam, ASGD,
    Rprop; elementwise=True vouches for another, never for one `optim.OPTIMIZERS` knows to be
    whole-tensor). **defaults: its keyword arguments.
    parameters_as_bucket_view: accepted; always True here (the parameters become views of the
    group's flat buffer). overlap_with_ddp=True is refused.
    process_group / comm: as DistributedDataParallel. Gradients must already be averaged over
    the ranks (a DDP wrapper does it). step(): this rank's range of every group updated (the
    loop's optimizer on per-parameter pieces of it, fp32 masters for weights of lower
    precision; fp32 and fp64 weights are stepped in place), then one all_gather per group
    (ledger: what "params", phase "step"). Parameters whose grad is None are skipped, as torch
    skips them. Attributes: optim (this rank's optimizer over its pieces), units (the flat
    groups), comm.
    Raises TypeError / ValueError (one line) for a class that is not an optimizer or whose update
    reads whole tensors (Adafactor, Muon, LBFGS, ...), and as torch's class for params that are
    not an iterable of tensors or of groups with a "params" key, an empty list, and parameters
    of more than one dense type (float32 with float64, CPU with CUDA) or sparse ones."""

    def __init__(self, params, optimizer_class, process_group=None,
                 parameters_as_bucket_view=False, overlap_with_ddp=False, *, comm=None,
                 elementwise=None, **defaults):
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True is not offered: zerolab's ZeRO-1 update runs "
                             "in step(), after backward (torch's runs inside DDP's comm hook)")
        check_elementwise(optimizer_class, elementwise)
        params = _verify_params(params)
        super().__init__(params, defaults)
        self.comm = comm if comm is not None else Comm(process_group)
        check_replicas([p for g in self.param_groups for p in g["params"]
                        if not getattr(p, "_zerolab_shard", False)],     # (refused at step)
                       self.comm, "ZeroRedundancyOptimizer")
        self.optimizer_class, self.units, inner = optimizer_class, [], []
        n, rank = self.comm.world_size, self.comm.rank
        for k, group in enumerate(self.param_groups):
            u = FlatUnit(f"group{k}", group["params"], n, rank,
                         names=[f"group{k}[{i}]" for i in range(len(group["params"]))])
            u.param_flat = u.flatten()                          # [Ψ_g] replicated
            u.bind_params(u.param_flat)
            own = u.own(u.param_flat)                           # [Ψ_g/N] this rank's range
            u.master = own if own.dtype in WIDE else own.float().clone()    # fp32 for bf16
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
        self._consolidated = None               # consolidate_state_dict's, on rank `to`

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
        """After `consolidate_state_dict(to)`, on rank `to`: torch's - the whole optimizer
        state as one torch optimizer over all the parameters would hold it ({"state": {index:
        per-parameter state}, "param_groups": [... "params": [index, ...]]}, indices over the
        groups in order), as of that consolidation, with the current hyperparameters. Otherwise
        zerolab's own: this rank's state (its pieces only) with the rank and world size it
        belongs to, for `load_state_dict` on the same rank (torch's class raises there)."""
        if self._consolidated is not None:
            groups = super().state_dict()["param_groups"]
            return {"state": self._consolidated, "param_groups": groups}
        return {"zerolab_rank": self.comm.rank, "zerolab_world_size": self.comm.world_size,
                "optim": self.optim.state_dict() if self.optim is not None else None}

    def load_state_dict(self, state_dict):
        """Load torch's whole state (what `state_dict()` returns after consolidation, or torch's
        class's, on every rank: each takes its own pieces and the hyperparameters), or what
        zerolab's `state_dict()` returned on this same rank of a group of the same size;
        ValueError (one line) for another rank's or another world size's state."""
        if "zerolab_rank" not in state_dict and "state" in state_dict:
            return self._load_whole(state_dict)
        mine = (self.comm.rank, self.comm.world_size)
        theirs = (state_dict.get("zerolab_rank"), state_dict.get("zerolab_world_size"))
        if theirs != mine:
            raise ValueError(f"this state is rank {theirs[0]} of {theirs[1]}'s shard; rank "
                             f"{mine[0]} of {mine[1]} needs its own (each rank saves and loads "
                             "its own state_dict())")
        if self.optim is not None:
            self.optim.load_state_dict(state_dict["optim"])

    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0):
        """torch's: gather every rank's optimizer state on rank `to`, whose `state_dict()` then
        returns the whole (torch's layout: each parameter's state tensors whole, as one torch
        optimizer over all the parameters holds them; fp32 for low-precision weights, the
        masters'). A collective: call it on every rank. Each rank's state travels as torch's
        does (a broadcast of its size, then of its torch.save bytes; ledger phase "eval", what
        "optim_state")."""
        if not (isinstance(to, int) and 0 <= to < self.comm.world_size):
            raise ValueError(f"to={to!r} is not a rank of this group (0 .. "
                             f"{self.comm.world_size - 1})")
        if self.optim is not None:              # the hyperparameters the loop set since
            for k, g in zip(self._inner_groups, self.optim.param_groups):
                g.update({key: v for key, v in self.param_groups[k].items() if key != "params"})
        mine = self.optim.state_dict()["state"] if self.optim is not None else {}
        states = []
        device = self.units[0].master.device
        with self.comm.phase("eval"):
            for r in range(self.comm.world_size):
                data = _to_bytes(mine, device) if r == self.comm.rank else None
                size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64,
                                    device=device)
                self.comm.broadcast(size, r, what="optim_state", unit=f"rank{r}.size")
                if data is None:
                    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
                self.comm.broadcast(data, r, what="optim_state", unit=f"rank{r}")
                if self.comm.rank == to:
                    states.append(torch.load(io.BytesIO(data.cpu().numpy().tobytes()),
                                             weights_only=True))
        self._consolidated = self._whole(states) if self.comm.rank == to else None

    def _layout(self, rank):
        """[(group k, parameter i, lo, hi)]: the pieces rank `rank`'s inner optimizer holds, in
        its own order (lo, hi: the piece's elements within the parameter)."""
        out = []
        for k, u in enumerate(self.units):
            start = rank * u.shard_numel
            for i, (p, off) in enumerate(zip(u.params, u.offsets)):
                lo, hi = max(off, start), min(off + p.numel(), start + u.shard_numel)
                if hi > lo:
                    out.append((k, i, lo - off, hi - off))
        return out

    def _whole(self, states) -> dict:
        index, n = {}, 0                        # (group, parameter) -> torch's global index
        for k, u in enumerate(self.units):
            for i in range(len(u.params)):
                index[(k, i)], n = n, n + 1
        pieces: dict = {}
        for rank, state in enumerate(states):
            for j, (k, i, lo, hi) in enumerate(self._layout(rank)):
                if j in state:
                    pieces.setdefault((k, i), []).append((lo, hi, state[j]))
        out = {}
        for (k, i), parts in sorted(pieces.items(), key=lambda kv: index[kv[0]]):
            p = self.units[k].params[i]
            whole = {}
            for key, v in parts[0][2].items():
                if torch.is_tensor(v) and v.dim() > 0:
                    flat = torch.cat([st[key].reshape(-1) for _, _, st in sorted(
                        parts, key=lambda x: x[0])])
                    whole[key] = flat.view(p.shape).clone()
                else:
                    whole[key] = v.clone() if torch.is_tensor(v) else v
            out[index[(k, i)]] = whole
        return out

    def _load_whole(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"])
                for g, mine in zip(groups, self.param_groups)):
            raise ValueError("this optimizer state has other parameter groups than this "
                             "ZeroRedundancyOptimizer's (group sizes differ)")
        for g, mine in zip(groups, self.param_groups):        # the hyperparameters, as torch's
            mine.update({key: v for key, v in g.items() if key != "params"})
        if self.optim is None:
            return
        index = {}
        for k, g in enumerate(groups):
            for i, g_index in enumerate(g["params"]):
                index[(k, i)] = g_index
        inner = {}
        for j, (k, i, lo, hi) in enumerate(self._layout(self.comm.rank)):
            whole = state_dict["state"].get(index[(k, i)])
            if whole is None:
                continue
            piece = self.units[k].pieces[i]
            inner[j] = {key: (v.reshape(-1)[lo:hi].view(piece.shape).clone()
                              if torch.is_tensor(v) and v.dim() > 0 else v)
                        for key, v in whole.items()}
        own = self.optim.state_dict()
        for k, g in zip(self._inner_groups, own["param_groups"]):
            g.update({key: v for key, v in self.param_groups[k].items() if key != "params"})
        self.optim.load_state_dict({"state": inner, "param_groups": own["param_groups"]})


WIDE = (torch.float32, torch.float64)      # stepped in place; narrower weights get fp32 masters


def _to_bytes(obj, device) -> torch.Tensor:
    """`obj` saved by torch.save (its tensors on the CPU) as a uint8 tensor on `device`; read
    back with torch.load(weights_only=True): tensors and plain values only, never code."""
    cpu = {j: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
           for j, s in obj.items()}
    buf = io.BytesIO()
    torch.save(cpu, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)


def _verify_params(params):
    """torch's ZeroRedundancyOptimizer's checks of `params`, with its messages: an iterable of
    tensors, or of dicts each with a "params" key; not empty; one dense type for all (the type
    names torch.typename gives: dtype and device)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("`params` argument should be an iterable of Tensors, but got "
                        f"{torch.typename(params)}")
    try:
        all_params = list(params)
    except TypeError as e:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)}") from e
    if not all_params:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, torch.Tensor) for p in all_params):
        tensors = all_params
    elif all(isinstance(p, dict) for p in all_params):
        tensors = []
        for group in all_params:
            if "params" not in group:
                raise ValueError("Each parameter group passed-in via `params` must have a "
                                 "'params' key mapping to the parameters in the group")
            ps = group["params"]
            tensors += [ps] if isinstance(ps, torch.Tensor) else list(ps)
            group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
    else:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    if tensors:
        first = torch.typename(tensors[0])
        if tensors[0].is_sparse:
            raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type "
                             f"for all parameters but got {first}")
        for p in tensors[1:]:
            if torch.typename(p) != first:
                raise ValueError("ZeroRedundancyOptimizer only supports using the same dense "
                                 f"type for all parameters but got both {first} and "
                                 f"{torch.typename(p)}")
    return all_params
