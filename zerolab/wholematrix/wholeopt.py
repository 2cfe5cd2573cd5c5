"""What the three distributed-Muon layouts share: the AdamW fallback split, owners, buffers, step.

Idea: a whole-matrix optimizer (torch.optim.Muon, torch.optim.Adafactor, zerolab.wholematrix.lamb.Lamb)
cannot step ZeRO's flat 1/N ranges. Each layout (muon_owner.py, muon_a2a.py,
muon_replicate.py) is a torch-like optimizer over a replicated model's parameters whose step is
the same four methods in the same order, so `diff zerolab/wholematrix/muon_owner.py zerolab/wholematrix/muon_a2a.py`
shows only where the matrix is made whole:

    reduce      sum this rank's gradients with the others' (a reduce_scatter into pieces)
    route       bring each matrix's pieces to the rank(s) that step it whole
    update      torch's own optimizer classes on the whole matrices (zerolab writes the routing,
                torch the arithmetic), the element-wise fallback where the layout keeps it
    route_back  every rank's weights made equal again

Usage (after torch.distributed.init_process_group; every rank builds the same model):

    groups = muon_param_groups(model, muon=dict(lr=0.02), adamw=dict(lr=3e-4))
    opt = MuonOwner(groups, comm=Comm())    # or MuonAllToAll, MuonReplicate
    loss.backward(); opt.step(); opt.zero_grad()

The loop does not average gradients itself (no DDP wrapper): `step()` reduces each rank's own
`p.grad` (the mean over ranks is what a single process stepping the global batch would see) and
leaves `p.grad` as the loop left it. Under a DDP wrapper the gradients arrive averaged already;
averaging N equal copies again gives the same values (to rounding for N not a power of 2) but
moves the gradient bytes twice: give these optimizers the plain model. Parameter groups: dicts with "params" and "use_muon" (True:
the whole-matrix `optimizer_class`, False: the element-wise `fallback_class`), plus either
class's hyperparameters (modded-nanogpt's MuonWithAuxAdam uses the same "use_muon" key). A
parameter whose grad is None on every rank is skipped as torch skips it; None on some ranks
only is refused in one line on every rank (one all_reduce of a flag per parameter, ledger what
"metric"). Every parameter must have one dtype and device (torch's ZeroRedundancyOptimizer's
rule); fp32 is the tested case. Exactness: tests/test_muon.py holds each layout to
single-process torch.optim.Muon + AdamW, Adafactor and Lamb; bytes to `muon_theory`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import muon_theory as mt
from ..comm import Comm
from ..loop.replicas import check_replicas


def muon_param_groups(model: nn.Module, *, muon: dict | None = None, adamw: dict | None = None,
                      output: str | None = None) -> list[dict]:
    """Two parameter groups as torch's Muon docs recommend: the 2-D weights of hidden layers
    ("use_muon": True, with the `muon` hyperparameters) and everything else - embeddings (every
    nn.Embedding's weight), the output layer (`output`: a submodule's name; default the last
    nn.Linear of model.modules()), norms' weights and biases - ("use_muon": False, `adamw`).
    Tied parameters appear once (the embedding's group wins)."""
    mods = list(model.named_modules())
    head = (model.get_submodule(output) if output is not None
            else next((m for _, m in reversed(mods) if isinstance(m, nn.Linear)), None))
    aside = {id(p) for _, m in mods if isinstance(m, nn.Embedding) for p in m.parameters()}
    aside |= {id(p) for p in (head.parameters() if head is not None else [])}
    hidden, other = [], []
    for p in model.parameters():                 # distinct parameters, in order
        if p.requires_grad:
            (hidden if p.dim() == 2 and id(p) not in aside else other).append(p)
    return [{"params": hidden, "use_muon": True, **(muon or {})},
            {"params": other, "use_muon": False, **(adamw or {})}]


class WholeOptimizer(torch.optim.Optimizer):
    """The frame of a layout (subclasses set `layout` and write hold / reduce / route / update /
    route_back). params: tensors (all to optimizer_class) or groups with "use_muon".
    optimizer_class: the whole-matrix optimizer (default torch.optim.Muon), **defaults its
    keywords; fallback_class (default torch.optim.AdamW) with fallback_defaults: the "use_muon":
    False groups. comm: a zerolab.comm.Comm (default: one over the default group).
    Attributes: whole / fallback (this rank's inner torch optimizers, None when it steps
    nothing of that kind), owners (owning rank per parameter, None: not owned), comm.
    Raises ValueError (one line, on every rank: every rank sees the same parameters) for mixed
    dtypes or devices, and for a non-2-D parameter in a Muon group."""

    layout = ""

    def __init__(self, params, optimizer_class=torch.optim.Muon, *, comm: Comm | None = None,
                 fallback_class=torch.optim.AdamW, fallback_defaults: dict | None = None,
                 **defaults):
        super().__init__(params, {})
        self.comm = comm if comm is not None else Comm()
        self.n, self.rank = self.comm.world_size, self.comm.rank
        self.classes = {True: optimizer_class, False: fallback_class}
        self.kw = {True: defaults, False: dict(fallback_defaults or {})}
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.whole_mask = [bool(g.get("use_muon", True)) for g in self.param_groups
                           for _ in g["params"]]
        self.group_of = [k for k, g in enumerate(self.param_groups) for _ in g["params"]]
        self._check()
        check_replicas([p for p in self.params if not getattr(p, "_zerolab_shard", False)],
                       self.comm, type(self).__name__)
        self.shapes = [tuple(p.shape) for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.hold()
        self._set_defaults()

    def add_param_group(self, param_group):
        if getattr(self, "params", None) is not None:
            raise RuntimeError(f"{type(self).__name__}: add_param_group after construction is not "
                               "supported (owners and buffers are laid out once): build a new one")
        super().add_param_group(param_group)

    def _check(self):
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"{type(self).__name__}: parameters of several dtypes/devices "
                             f"{sorted(map(str, kinds))}; give it parameters of one dtype and "
                             "device (cast the model first)")
        if issubclass(self.classes[True], torch.optim.Muon):
            for i, (p, w) in enumerate(zip(self.params, self.whole_mask)):
                if w and p.dim() != 2:
                    raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is in a Muon group "
                                     "(use_muon=True) but Muon steps 2-D matrices only: put it "
                                     "in a use_muon=False group (muon_param_groups does)")

    # --- inner optimizers: torch's classes over what this rank steps -----------------------
    def inner(self, whole: bool, tensors: dict, **override):
        """optimizer_class (whole=True) or fallback_class over {parameter index: tensor to
        step}, grouped as this optimizer's groups with their hyperparameters (+ override);
        None when `tensors` holds none of that kind."""
        groups = []
        for k, g in enumerate(self.param_groups):
            ps = [t for i, t in tensors.items() if self.group_of[i] == k
                  and self.whole_mask[i] == whole]
            if ps:
                hyper = {key: v for key, v in g.items() if key not in ("params", "use_muon")}
                groups.append({"params": ps, **hyper, **override, "_group": k})
        if not groups:
            return None
        for g in groups:
            g.pop("_group")
        opt = self.classes[whole](groups, **self.kw[whole])
        opt._zerolab_groups = [k for k, g in enumerate(self.param_groups)
                               if any(self.group_of[i] == k and self.whole_mask[i] == whole
                                      for i in tensors)]
        opt._zerolab_override = override
        return opt

    def _set_defaults(self):
        """Every group shows its class's hyperparameters (as torch's optimizers do)."""
        for whole in (True, False):
            full = self.classes[whole]([torch.zeros(2, 2, requires_grad=True)],
                                       **self.kw[whole]).defaults
            for g in self.param_groups:
                if bool(g.get("use_muon", True)) == whole:
                    for key, value in full.items():
                        g.setdefault(key, value)

    def _sync(self, opt):
        """The loop's hyperparameters (an lr scheduler's) into an inner optimizer's groups."""
        if opt is not None:
            for k, g in zip(opt._zerolab_groups, opt.param_groups):
                g.update({key: v for key, v in self.param_groups[k].items()
                          if key not in ("params", "use_muon")}, **opt._zerolab_override)

    # --- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient on every rank (torch semantics);
        returns closure()'s loss. Collectives: see the layout's module and muon_theory."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.comm.phase("step"):
            used = self.used()
            self.reduce(used)           # summed gradients, averaged, in this layout's pieces
            self.route(used)            # whole matrices where they are stepped
            self.update(used)           # torch's optimizer classes on them
            self.route_back(used)       # every rank's weights equal again
        return loss

    def used(self) -> list[bool]:
        """Which parameters have a gradient (on every rank: one all_reduce of [P] flags)."""
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                             device=self.params[0].device)
        self.comm.all_reduce(flags, what="metric", unit="grads_present")
        some = [i for i, f in enumerate(flags.tolist()) if 0 < f < self.n]
        if some:
            raise RuntimeError(f"parameter {some[0]} (shape {self.shapes[some[0]]}) has a gradient "
                               f"on {int(flags[some[0]])} of {self.n} ranks: every rank must give "
                               "it one, or none (set p.grad = zeros on a rank that did not use it)")
        return [f == self.n for f in flags.tolist()]

    def grad_or_zeros(self, i, used):
        p = self.params[i]
        return p.grad if used[i] else torch.zeros_like(p)

    def step_whole(self, opt, grads: dict, used):
        """Run `opt` with `.grad` of each stepped tensor set to grads[i] (whole, averaged); the
        tensors' own .grad are put back afterwards. Parameters no rank used get None (skipped)."""
        if opt is None:
            return
        self._sync(opt)
        saved = {}
        for i, t in self.stepped[opt].items():
            saved[i] = t.grad
            t.grad = grads[i].view(t.shape) if used[i] else None
        opt.step()
        for i, t in self.stepped[opt].items():
            t.grad = saved[i]

    # --- state ----------------------------------------------------------------------------
    def state_dict(self):
        """This rank's inner optimizers' state, with the rank, world size and layout it
        belongs to (each rank saves and loads its own, as zerolab's ZeroRedundancyOptimizer)."""
        return {"zerolab_rank": self.rank, "zerolab_world_size": self.n, "layout": self.layout,
                "whole": self.whole.state_dict() if self.whole is not None else None,
                "fallback": self.fallback.state_dict() if self.fallback is not None else None}

    def load_state_dict(self, state_dict):
        """What `state_dict()` returned on this rank of a group of this size and layout;
        ValueError (one line) otherwise."""
        mine = (self.rank, self.n, self.layout)
        theirs = tuple(state_dict.get(k) for k in ("zerolab_rank", "zerolab_world_size", "layout"))
        if theirs != mine:
            raise ValueError(f"this state is rank {theirs[0]} of {theirs[1]} ({theirs[2]}); rank "
                             f"{mine[0]} of {mine[1]} ({mine[2]}) needs its own state_dict()")
        for opt, key in ((self.whole, "whole"), (self.fallback, "fallback")):
            if opt is not None:
                opt.load_state_dict(state_dict[key])

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the layout: "state" (the inner optimizers' tensors) and
        "buffers" (the layout's flat and routing buffers, `self.buffers`)."""
        state = sum(t.numel() * t.element_size() for opt in (self.whole, self.fallback)
                    if opt is not None for s in opt.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        buffers = sum(t.numel() * t.element_size() for t in self.buffers)
        return {"state": state, "buffers": buffers}

    def costs(self, elem_bytes: int | None = None) -> list[dict]:
        """muon_theory.layout_costs for this optimizer's parameters (per rank)."""
        b = elem_bytes or self.params[0].element_size()
        return mt.layout_costs(self.layout, self.shapes, self.whole_mask, self.n, b,
                               groups=self.group_of)


class Dim0:
    """Every parameter's dim-0 shards in one flat buffer `flat` [N·S]: rank r's segment
    [r·S, (r+1)·S) holds rows [r·k_p, (r+1)·k_p) of each parameter p (k_p = ⌈R_p/N⌉ rows,
    zero-padded), end to end (muon_theory.shard_numel). A reduce_scatter of it leaves rank r
    the sum of its rows; an all_gather gives every rank every row."""

    def __init__(self, params, n: int, rank: int):
        self.shapes = [tuple(p.shape) for p in params]
        self.n, self.rank = n, rank
        self.sizes = [mt.shard_numel(s, n) for s in self.shapes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.S = sum(self.sizes)
        self.flat = torch.zeros(n * self.S, dtype=params[0].dtype, device=params[0].device)

    def grid(self, buf=None):
        return (self.flat if buf is None else buf).view(self.n, -1)

    def reduce_scatter(self, comm, grads):
        """`grads` (one per parameter, in order) packed into `flat`, reduce-scattered over `comm`
        and averaged: this rank's segment [S] of `flat` holds the mean of its rows (returned)."""
        for i, g in enumerate(grads):
            self.pack(i, g)
        own = self.grid()[self.rank]
        comm.reduce_scatter(own, self.flat, what="grads", unit="dim0")
        return own.div_(self.n)                              # sum -> average

    def pack(self, i, t, buf=None, off=None):
        """Write t (parameter i's shape) into every rank's segment of `buf` (default flat) at
        column `off` (default parameter i's offset)."""
        s, off = self.sizes[i], self.offsets[i] if off is None else off
        R = mt.rows(self.shapes[i])
        rows = t.reshape(R, -1)
        pad = self.n * (s // rows.shape[1] if rows.shape[1] else 0) - R
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        self.grid(buf)[:, off:off + s].copy_(rows.reshape(self.n, s))

    def unpack(self, i, buf=None, off=None):
        """Parameter i whole (a copy), read from every rank's segment of `buf`."""
        s, off = self.sizes[i], self.offsets[i] if off is None else off
        R = mt.rows(self.shapes[i])
        width = mt.numel(self.shapes[i]) // R
        return self.grid(buf)[:, off:off + s].reshape(-1, width)[:R].reshape(self.shapes[i])

    def mine(self, i):
        """(view of this rank's rows of parameter i in `flat`, first row, last row + 1)."""
        R = mt.rows(self.shapes[i])
        k = self.sizes[i] // (mt.numel(self.shapes[i]) // R)
        lo, hi = min(self.rank * k, R), min((self.rank + 1) * k, R)
        width = mt.numel(self.shapes[i]) // R
        off = self.rank * self.S + self.offsets[i]
        return self.flat[off:off + (hi - lo) * width], lo, hi
