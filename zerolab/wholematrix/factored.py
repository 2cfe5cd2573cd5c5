"""torch's Adafactor on dim-0 row shards: the cheap case of an optimizer that is not element-wise.

Why: ZeRO's lesson is "each rank updates its own range of an element-wise optimizer's state".
Adafactor (Shazeer & Stern 2018, arXiv:1804.04235; torch.optim.Adafactor) is not element-wise:
for a weight W [R, C] it keeps a row statistic r [R] (the mean over columns of each row's
squared gradient) and a column statistic c [C] (the mean over rows), estimates the second
moment as r c^T / mean(r), and scales the step by RMS(W) and clips it by RMS(update), each over
the whole tensor. torch's class stepping a rank's rows alone (fully_shard's layout) takes its
column means and both RMS over those rows only: a different update, silently (a 3-layer MLP on
2 ranks, 3 steps at lr 0.02, tests/test_factored.py's set-up: 9.7e-3 off, against 1.7e-2 of
movement).

On FSDP2's dim-0 layout (rank r holds rows [r*ceil(R/N), ...) of each weight) the row statistic
is already local - each rank has whole rows - and what crosses ranks is small:

    per sharded 2-D weight [R, C]:  C partial column sums of g^2, and the sum of r (for mean(r))
    per sharded parameter:          the sum of its squared weights (its RMS: the relative step)
                                    the sum of its squared update (RMS clipping, after the first)

Tensors of 3 or more dims factor their last two, which dim-0 rows do not split: only the two
RMS sums cross ranks; 1-D tensors keep a full second moment per element, also local. So one step
is two all_reduces (ledger: what "optim_stats", phase "step"), of fp32 elements

    S_1 = Σ_sharded 1 + Σ_sharded 2-D (C_i + 1),    S_2 = Σ_sharded 1          (P_s terms each)
    bytes per step = 4 (S_1 + S_2) = 4 (2 P_s + Σ_2-D (C_i + 1))

(P_s: sharded parameters with a gradient; the ledger's ring bytes are 2(N-1)/N of that), while
the state each rank keeps is R_i/N + C_i per weight instead of Adam's 2 R_i C_i / N. The
arithmetic is torch's `_single_tensor_adafactor` (torch/optim/_adafactor.py), line by line,
with each whole-tensor reduction split into the ranks' partial sums: the result equals single-
process torch.optim.Adafactor to rounding (tests/test_factored.py: fp32, <= 1e-6).
"""
from __future__ import annotations

import math

import torch

STATS = "optim_stats"       # the ledger's `what` of the two all_reduces


class RowShardedAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor (its arguments and defaults: lr, beta2_decay, eps, d,
    weight_decay, foreach, maximize) over parameters some of which are dim-0 row shards.

    full_shape: p -> the whole tensor's shape (torch.Size) when p holds some of its rows (its
    rows x the rest; the last ranks may hold none), None when p is whole (stepped as torch's
    class does, nothing exchanged). comm: a zerolab.comm.Comm over the ranks that hold the
    other rows, or a callable returning one (asked at each step that has sharded parameters).
    State per parameter as torch's (row_var [rows, 1] of this rank's rows, col_var [1, C]
    whole, the same on every rank; variance for 1-D), so state_dict() is torch's layout for the
    local tensors. foreach is accepted and the single-tensor arithmetic always runs (torch's
    default for Adafactor). Every rank must step (the all_reduces are collectives) with its
    parameters in the same order. Raises as torch's class for bad hyperparameters."""

    zerolab_shard_aware = True      # zerolab's step check: it steps shards itself

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0, *, foreach=None, maximize=False, full_shape=None, comm=None):
        super().__init__(params, lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                         weight_decay=weight_decay, foreach=foreach, maximize=maximize)
        self.full_shape = full_shape or (lambda p: None)
        self.comm = comm

    def _comm(self):
        return self.comm() if callable(self.comm) else self.comm

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (torch's semantics); returns
        closure()'s loss. Two all_reduces when any parameter is a shard (see the module)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = []
        for group in self.param_groups:
            params, grads, row_vars, col_vars, variances, steps = [], [], [], [], [], []
            self._init_group(group, params, grads, row_vars, col_vars, variances, steps)
            for it in zip(params, grads, row_vars, col_vars, variances, steps):
                items.append(_Item(group, *it, self.full_shape(it[0])))
        sharded = [it for it in items if it.full is not None]
        # 1. local: step count, row statistic, partial column sums, sum of squared weights
        for it in items:
            it.begin()
        if sharded:
            comm = self._comm()
            sums = torch.cat([it.partial_sums() for it in sharded])         # [S_1] fp32
            with comm.phase("step"):
                comm.all_reduce(sums, what=STATS, unit="adafactor.sums")
            for it, part in zip(sharded, sums.split([it.n_sums for it in sharded])):
                it.take_sums(part)
        # 2. the update; its squared sum is the second exchange
        for it in items:
            it.make_update()
        if sharded:
            usq = torch.stack([it.usq for it in sharded])                  # [S_2] fp32
            with comm.phase("step"):
                comm.all_reduce(usq, what=STATS, unit="adafactor.update_rms")
            for it, total in zip(sharded, usq.unbind()):
                it.usq = total
        for it in items:
            it.apply()
        return loss


class _Item:
    """One parameter's step, split where torch's reads the whole tensor (`full` not None)."""

    def __init__(self, group, p, grad, row_var, col_var, variance, step_t, full):
        self.group, self.p, self.row_var, self.col_var = group, p, row_var, col_var
        self.variance, self.step_t = variance, step_t
        self.full = None if full is None else torch.Size(full)
        g = grad.as_subclass(torch.Tensor)              # (a plain tensor: local norms only)
        self.g = -g if group["maximize"] else g
        # a 2-D weight split by rows: its column statistic and mean(r) cross ranks
        self.by_rows = self.full is not None and len(self.full) == 2
        self.n_sums = 1 + (self.full[-1] + 1 if self.by_rows else 0)

    def begin(self):
        group, p, g = self.group, self.p, self.g
        lr = float(group["lr"])
        self.eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
        self.step_t += 1
        step = self.step_t.item()
        self.one_minus_beta2_t = step ** group["beta2_decay"]
        self.rho_t = min(lr, 1 / (step ** 0.5))
        self.psq = p.norm(2).square().float()           # Σ W^2 (this rank's rows)
        if g.dim() > 1:
            # same as (g * g).mean(dim=-1): whole rows on every rank, so local
            row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
            self.row_var.lerp_(row_mean, self.one_minus_beta2_t)
        if self.by_rows:
            self.col_part = torch.norm(g, dim=-2, keepdim=True).square_()     # [1, C] Σ_rows
            self.rsum = self.row_var.sum()

    def partial_sums(self) -> torch.Tensor:
        """[1 (+ C + 1)] fp32: Σ W^2, then (a 2-D weight) the column sums of g^2 and Σ r."""
        parts = [self.psq.reshape(1)]
        if self.by_rows:
            parts += [self.col_part.reshape(-1).float(), self.rsum.reshape(1).float()]
        return torch.cat(parts)

    def take_sums(self, part: torch.Tensor):
        self.psq = part[0]
        if self.by_rows:
            self.col_part, self.rsum = part[1:-1], part[-1]

    def numel(self) -> int:
        return math.prod(self.full) if self.full is not None else self.p.numel()

    def make_update(self):
        group, p, g = self.group, self.p, self.g
        lr, eps1 = float(group["lr"]), self.eps1
        rms = (self.psq.sqrt().item() if self.full is not None else p.norm(2).item())
        self.alpha = max(group["eps"][1], rms / (self.numel() ** 0.5)) * self.rho_t
        if group["weight_decay"] != 0:                  # (after the RMS, as torch's)
            p.mul_(1 - lr * group["weight_decay"])
        if self.by_rows:
            rows = self.full[0]
            col_mean = self.col_part.to(self.col_var.dtype).div(rows).view_as(self.col_var)
            self.col_var.lerp_(col_mean, self.one_minus_beta2_t)
            var_estimate = self.row_var @ self.col_var
            var_estimate.div_((self.rsum / rows).to(var_estimate.dtype).clamp(min=eps1))
        elif g.dim() > 1:
            col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
            self.col_var.lerp_(col_mean, self.one_minus_beta2_t)
            var_estimate = self.row_var @ self.col_var
            var_estimate.div_(self.row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            self.variance.lerp_(g * g, self.one_minus_beta2_t)
            var_estimate = self.variance.clone()
        # square the eps1 as we sqrt after to keep eps1's magnitude (torch's)
        self.update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
        self.usq = self.update.norm(2).square().float()

    def apply(self):
        d = self.group["d"]
        norm = (self.usq.sqrt().item() if self.full is not None else self.update.norm(2).item())
        denom = max(1.0, norm / ((self.numel() ** 0.5) * d))
        self.p.add_(self.update, alpha=-self.alpha / denom)
        self.update = None


def stats_bytes(shapes) -> int:
    """Bytes one step's two all_reduces carry (S, fp32, before the ring factor) for sharded
    parameters of whole shapes `shapes` (each with a gradient): 4 (2 P_s + Σ_2-D (C_i + 1))."""
    shapes = [tuple(s) for s in shapes]
    return 4 * (2 * len(shapes) + sum(s[-1] + 1 for s in shapes if len(s) == 2))
