"""torch's AdamW on flat buffers, with parameter groups and per-parameter state, as torch has them.

Idea: every strategy keeps one fp32 master buffer per unit (the whole unit for DDP, this rank's
range for ZeRO-1/2/3). A per-parameter optimizer treats parameters one by one in two ways that a
flat buffer must not blur:

- parameter groups: the GPT-2 / nanoGPT recipe decays 2-D weights but not biases or LayerNorm
  weights (`sharding.decays`). On a flat buffer this is a per-element decay mask; since each
  parameter occupies one contiguous range of it, the mask is stored as those ranges
  (`FlatUnit.segments`) with a decay flag each, which costs no memory and keeps the flat layout
  (and checkpoints written against it) unchanged;
- a parameter whose gradient is None for a whole step (used nowhere, a branch no rank took,
  frozen after the optimizer was built): torch.optim.AdamW skips it entirely - no weight decay,
  no exp_avg / exp_avg_sq update, and its own `step` count stays where it is.

`FlatAdamW.step(used)` therefore calls torch's own AdamW arithmetic
(`torch.optim.adamw.adamw`, the function torch.optim.AdamW.step runs) on per-parameter *views*
of the flat master, gradient, exp_avg and exp_avg_sq buffers, once for the decayed parameters
and once for the others, skipping the parameters that `used` marks False. The state stays flat:
`state[master] = {"exp_avg": [M] fp32, "exp_avg_sq": [M] fp32, "step": [P] fp32}`, with one step
count per parameter of the unit (P of them), as torch keeps one per parameter. A scalar "step"
(what zerolab.run.checkpoint restores) is taken as the count of every parameter.

The low-precision state ladder (`optimizer_states`, `master_rounding`; bytes per parameter with
bf16 weights and gradients, `theory.bytes_per_param`, Megatron's 20 / 18 / 16 table there too):

    optimizer_states  master_rounding       weights grads master exp_avg exp_avg_sq  total
    "fp32"            -                        2      2     4      4       4          16
    "bf16-moments"    -                        2      2     4      2       2          12
    "bf16-master"     "kahan"                  2      2     2*     2       2          10
    "bf16-master"     "nearest"|"stochastic"   2      2     0      2       2           8

"bf16-moments": exp_avg and exp_avg_sq are stored in bf16 (Megatron-Core's precision-aware
optimizer, `exp_avg_dtype` / `exp_avg_sq_dtype`). "bf16-master": the bf16 weights themselves are
the master (Megatron's fp32-param row, where the params are the main params, in bf16); a separate
bf16 copy would hold the very same bits, so none is built (`make_flat_optimizer` points
`u.master` at the weights' own range). The update is computed in fp32 and rounded into bf16:
"nearest" (plain cast: updates below half a bf16 ulp - 2^-9 to 2^-8 of the weight - are lost:
lr * wd = 1e-4 decay stalls), "stochastic" (up or down at random with the probabilities that make the rounding
unbiased, `round_stochastic`; seeded per step, unit and - for shards - rank, so a run repeats
bit for bit) or "kahan" (*a bf16 compensation buffer carries what each rounding lost into the
next update: counted as "master_weights", since weight + compensation is what an fp32 master
holds, to ~16 bits). Source: Zamirai et al. 2020, "Revisiting BFloat16 Training" (stochastic
rounding and Kahan summation of the weight update); Megatron-Core OptimizerConfig
(`use_precision_aware_optimizer`, `main_params_dtype`, `exp_avg_dtype`, `exp_avg_sq_dtype`).
The arithmetic is torch's AdamW on fp32 copies of one parameter's range at a time (temporaries
of one parameter, as the fp32 path's), so that the rungs differ from "fp32" only in what is
stored. The Kahan compensation is not in checkpoints: a resumed run starts it at zero.
"""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from . import theory

_SEED_MIX = 1_000_003


def round_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16, up or down at random: to the neighbour above with probability
    (x - below) / (above - below), so E[result] = x (unbiased; nearest rounding is biased for
    any one value). How: add 16 random bits to the fp32 bits' low half, then drop that half (a
    carry into the upper half is the round-up). Exact values stay exact."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class FlatAdamW(torch.optim.AdamW):
    """AdamW over flat fp32 master buffers `masters` ([M_k] each), where master k holds the
    parameters at `segments[k]` = [(lo, hi), ...] (element ranges; hi <= lo: not held here)
    with `decay[k]` = [bool, ...] (weight decay or not). lr, betas, eps, weight_decay: torch's.
    """

    def __init__(self, masters, segments, decay, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1, optimizer_states="fp32", master_rounding="nearest",
                 rounding_seed=0, rank=0):
        theory.check_optimizer_states(optimizer_states, master_rounding)
        if optimizer_states == "bf16-master" and any(m.dtype != torch.bfloat16 for m in masters):
            raise ValueError("optimizer_states 'bf16-master' updates the bf16 weights themselves: "
                             "the masters must be bf16 (use --precision bf16)")
        super().__init__(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.segments = [list(zip(s, d)) for s, d in zip(segments, decay)]
        self.states, self.rounding = optimizer_states, master_rounding
        self.seed, self.rank = rounding_seed, rank      # stochastic rounding's stream

    def master_buffers(self, masters) -> list[torch.Tensor]:
        """What the memory meter counts as "master_weights" (`optimizer_states`): the
        masters; none when the bf16 weights are the master (they are counted as "params"), but
        the Kahan compensation buffers (bf16, shaped like the master) when there are any."""
        if self.states != "bf16-master":
            return list(masters)
        return [self.state[m]["kahan_comp"] for m in masters if "kahan_comp" in self.state.get(m, {})]

    @torch.no_grad()
    def step(self, used=None):
        """One update. used: [[bool per parameter] per master] (None: all); a parameter marked
        False is left exactly as torch.optim.AdamW leaves a parameter whose grad is None."""
        if self.states != "fp32":
            return self._step_low_precision(used)
        group = self.param_groups[0]
        views = {True: ([], [], [], [], []), False: ([], [], [], [], [])}   # by decay flag
        for k, m in enumerate(group["params"]):
            if m.grad is None:
                continue
            state = self.state[m]
            if not state:                       # lazily, like torch: exp_avg appear at step 1
                state["step"] = torch.zeros(len(self.segments[k]), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            if state["step"].dim() == 0:        # one count for all (a resumed checkpoint's)
                state["step"] = state["step"].float().expand(len(self.segments[k])).clone()
            for j, ((lo, hi), decay) in enumerate(self.segments[k]):
                if hi <= lo or (used is not None and not used[k][j]):
                    continue
                for out, t in zip(views[decay], (m, m.grad, state["exp_avg"],
                                                 state["exp_avg_sq"])):
                    out.append(t[lo:hi])
                views[decay][4].append(state["step"][j])      # 0-d view: adamw adds 1 in place
        beta1, beta2 = group["betas"]
        for decay, (params, grads, exp_avgs, exp_avg_sqs, steps) in views.items():
            if params:
                adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None,
                      amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"] if decay else 0.0, eps=group["eps"],
                      maximize=False)


    @torch.no_grad()
    def _step_low_precision(self, used=None):
        """The update of `optimizer_states` "bf16-moments" / "bf16-master": per parameter range,
        fp32 copies of what is stored in bf16, torch's AdamW on them, then each rounded back
        (moments: nearest; a bf16 master: `master_rounding`)."""
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        for k, m in enumerate(group["params"]):
            if m.grad is None:
                continue
            state = self._low_precision_state(k, m)
            generator = self._generator(k, m, state) if self.rounding == "stochastic" else None
            for j, ((lo, hi), decay) in enumerate(self.segments[k]):
                if hi <= lo or (used is not None and not used[k][j]):
                    continue
                w, ea, eas = m[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi]
                w32, ea32, eas32 = w.float(), ea.float(), eas.float()   # fp32 w: w itself
                adamw([w32], [m.grad[lo:hi].float()], [ea32], [eas32], [], [state["step"][j]],
                      foreach=None, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"] if decay else 0.0, eps=group["eps"],
                      maximize=False)
                ea.copy_(ea32)                          # fp32 -> bf16, nearest
                eas.copy_(eas32)
                if w32 is not w:                        # a bf16 master: round the new weights
                    self._round_into(w, w32, state, lo, hi, generator)

    def _low_precision_state(self, k, m) -> dict:
        """State of master k: bf16 moments (+ "kahan_comp"), created at the first step like
        torch's; moments of another dtype (a resumed checkpoint's fp32) are cast once."""
        state = self.state[m]
        if not state:
            state["step"] = torch.zeros(len(self.segments[k]), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state or state[key].dtype != torch.bfloat16:
                state[key] = (state[key].to(torch.bfloat16) if key in state
                              else torch.zeros_like(m, dtype=torch.bfloat16))
        if self.rounding == "kahan" and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(m, dtype=torch.bfloat16)
        if state["step"].dim() == 0:            # one count for all (a resumed checkpoint's)
            state["step"] = state["step"].float().expand(len(self.segments[k])).clone()
        return state

    def _generator(self, k, m, state) -> torch.Generator:
        """Stochastic rounding's random bits for master k this step: a generator seeded from
        (rounding_seed, rank, k, the unit's step count), so a rerun draws the same bits."""
        step = int(state["step"].max()) if state["step"].numel() else 0
        seed = ((self.seed * _SEED_MIX + self.rank) * _SEED_MIX + k) * _SEED_MIX + step
        return torch.Generator(device=m.device).manual_seed(seed % 2**63)

    def _round_into(self, w, w32, state, lo, hi, generator):
        """Store the fp32 update result `w32` into the bf16 weights `w` by `master_rounding`."""
        if self.rounding == "nearest":
            w.copy_(w32)
        elif self.rounding == "stochastic":
            w.copy_(round_stochastic(w32, generator))
        else:                                   # Kahan: carry what the rounding loses
            comp, old = state["kahan_comp"][lo:hi], w.float()
            y = (w32 - old) + comp.float()      # this update plus what earlier ones lost
            new = (old + y).to(torch.bfloat16)
            comp.copy_(y - (new.float() - old))
            w.copy_(new)


def master_range(u, sharded: bool) -> torch.Tensor:
    """The weights' own range that a "bf16-master" optimizer updates in place: ZeRO-3's bf16
    shard `param_shard`, this rank's range of `param_flat` (ZeRO-1/2) or all of it (DDP)."""
    if getattr(u, "param_shard", None) is not None:
        return u.param_shard
    if sharded and getattr(u, "layout", "flat") != "flat":
        raise ValueError(f"unit {u.name!r}: 'bf16-master' needs a flat layout (its range of the "
                         "weights must be a view)")
    return u.own(u.param_flat) if sharded else u.param_flat


def make_flat_optimizer(units, sharded: bool, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                        weight_decay=0.1, optimizer_states="fp32", master_rounding="nearest",
                        rounding_seed=0) -> FlatAdamW:
    """FlatAdamW over `units`' fp32 masters (`u.master`), grouped as `sharding.decays` says.
    optimizer_states "bf16-master": each `u.master` becomes the weights' own range
    (`master_range`: the strategy's fp32 copy is dropped, a build-time transient), so the
    strategies' `copy_(u.master)` after the step copies a tensor onto itself. Stochastic
    rounding seeds by rank only when the masters are shards (DDP's replicas must agree)."""
    theory.check_optimizer_states(optimizer_states, master_rounding)
    if optimizer_states == "bf16-master":
        for u in units:
            u.master = master_range(u, sharded)
    rank = units[0].rank if sharded and units else 0
    return FlatAdamW([u.master for u in units], [u.segments(sharded) for u in units],
                     [u.decay for u in units], lr=lr, betas=betas, eps=eps,
                     weight_decay=weight_decay, optimizer_states=optimizer_states,
                     master_rounding=master_rounding, rounding_seed=rounding_seed, rank=rank)


# --- which torch optimizers can step a piece of a tensor: the known list -----------------------
# ZeRO gives rank r a piece of each weight: a contiguous range of a bucket's elements (flat
# layout: ZeRO-1/2/3, ZeroRedundancyOptimizer) or some of its rows (fully_shard's "dim0"). A
# rank's optimizer then sees pieces of weights. Its update is torch's only when each element's
# new value reads that element's weight, gradient and state and the step count alone: then any
# split gives the same numbers. Each torch.optim class of torch 2.13, by how its update reads
# (tests/test_optimizer_table.py walks every Optimizer subclass in torch.optim, fails on one
# missing here, and checks each claim by experiment: a split update against the whole).
OPTIMIZERS: dict[str, tuple[str, str]] = {
    "SGD": ("element-wise", "momentum buffer and Nesterov look-ahead per element"),
    "Adam": ("element-wise", "moments per element; bias corrections from the step count"),
    "AdamW": ("element-wise", "Adam's, with decoupled decay per element"),
    "Adamax": ("element-wise", "exp_avg and the infinity norm's running max per element"),
    "Adagrad": ("element-wise", "a running sum of squares per element"),
    "Adadelta": ("element-wise", "running averages of squared gradients and updates per element"),
    "RMSprop": ("element-wise", "squared-gradient (and centred) averages per element"),
    "NAdam": ("element-wise", "Adam's moments; the momentum schedule from the step count"),
    "RAdam": ("element-wise", "Adam's moments; the rectification from the step count"),
    "ASGD": ("element-wise", "the average per element; eta and mu from the step count"),
    "Rprop": ("element-wise", "a step size per element from the signs of its gradients"),
    "Adafactor": ("whole-tensor", "its second moment is factored into the row and column means "
                  "of each weight's squared gradient, and its step is scaled by the weight's RMS "
                  "and clipped by the update's RMS, each over the whole tensor"),
    "Muon": ("whole-tensor", "it orthogonalises each 2-D update as a whole matrix "
             "(Newton-Schulz) and scales lr by the matrix's shape"),
    "LBFGS": ("whole-tensor", "its quasi-Newton direction and step length are dot products and "
              "norms over all parameters at once"),
    "SparseAdam": ("sparse", "it needs sparse gradients (Adam on their entries) and refuses dense "
                   "ones, which every zerolab shard's gradient is"),
}
ELEMENTWISE = tuple(getattr(torch.optim, n) for n, (kind, _) in OPTIMIZERS.items()
                    if kind == "element-wise" and hasattr(torch.optim, n))
# whole-tensor optimizers of other libraries, known by class name (anywhere in an MRO)
WHOLE_TENSOR = {n: why for n, (kind, why) in OPTIMIZERS.items() if kind != "element-wise"}
WHOLE_TENSOR.update({
    "Lamb": "its trust ratio divides the norm of each whole weight by that of its update",
    "LAMB": "its trust ratio divides the norm of each whole weight by that of its update",
    "Shampoo": "its preconditioners are matrices built from each whole weight's gradient",
})
_DECLARED: set = set()      # classes a user declared element-wise (declare_elementwise)
# what a whole-tensor optimizer's user can do instead, by class name
ADVICE = {
    "Adafactor": "use zerolab.torchlike.Adafactor (torch's arithmetic on fully_shard's dim-0 "
                 "shards, with small all_reduces of its row/column sums and norms)",
    "Muon": "keep the model replicated (zerolab.torchlike.DistributedDataParallel) or use a "
            "distributed Muon over a replicated model: zerolab.variants.compose.make_muon(params, "
            "layout) with layout \"owner\", \"a2a\" or \"replicate\"",
    "SparseAdam": "use torch.optim.Adam or AdamW (its update where every entry has a gradient)",
}


def update_kind(optimizer_class) -> tuple[str, str]:
    """(kind, why) of a torch.optim.Optimizer class's update: "element-wise", "whole-tensor",
    "sparse" (`OPTIMIZERS`, matched by class name along the MRO) or "unknown" (a class zerolab
    cannot vouch for: not in the table, or a subclass that overrides step()). A class given to
    `declare_elementwise` is "element-wise"."""
    if optimizer_class in _DECLARED:
        return "element-wise", "declared element-wise (zerolab.optim.declare_elementwise)"
    if any(optimizer_class.step is base.step for base in ELEMENTWISE):
        base = next(b for b in ELEMENTWISE if optimizer_class.step is b.step)
        return "element-wise", OPTIMIZERS[base.__name__][1]
    for cls in optimizer_class.__mro__:
        if cls.__name__ in WHOLE_TENSOR:
            kind = OPTIMIZERS.get(cls.__name__, ("whole-tensor",))[0]
            return kind, WHOLE_TENSOR[cls.__name__]
    return "unknown", ("zerolab cannot tell whether its update is element-wise (each element's "
                       "new value reads only that element's weight, gradient and state)")


def declare_elementwise(optimizer_class):
    """Vouch that `optimizer_class`'s update is element-wise, so that it may step zerolab's
    shards (fully_shard's parameters; ZeroRedundancyOptimizer's elementwise=True says the same
    for one optimizer). A class the table knows to be whole-tensor: ValueError (one line).
    Returns the class (usable as a decorator)."""
    check_class(optimizer_class)
    kind, why = update_kind(optimizer_class)
    if kind in ("whole-tensor", "sparse"):
        raise ValueError(f"{optimizer_class.__name__} is not element-wise: {why}")
    _DECLARED.add(optimizer_class)
    return optimizer_class


def check_class(optimizer_class):
    """TypeError (one line) unless `optimizer_class` is a torch.optim.Optimizer subclass."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        what = (f"an instance of {type(optimizer_class).__name__}"
                if isinstance(optimizer_class, torch.optim.Optimizer) else repr(optimizer_class))
        raise TypeError(f"optimizer_class is {what}, not a torch.optim.Optimizer subclass (pass "
                        "the class, e.g. torch.optim.AdamW, and its arguments as keywords)")


def refusal(optimizer_class, where: str) -> str | None:
    """The one-line reason `optimizer_class` may not step pieces of weights `where` (e.g.
    "fully_shard's shard parameters"), with what to do instead; None when it may (element-wise,
    declared, or a class that steps zerolab's shards itself: `zerolab_shard_aware = True`)."""
    if getattr(optimizer_class, "zerolab_shard_aware", False):
        return None
    kind, why = update_kind(optimizer_class)
    if kind == "element-wise":
        return None
    name = optimizer_class.__name__
    if kind == "unknown":
        return (f"{name} cannot step {where}: {why}; if it is, call "
                f"zerolab.optim.declare_elementwise({name}) first, or use one of "
                + ", ".join(c.__name__ for c in ELEMENTWISE))
    base = next((c.__name__ for c in optimizer_class.__mro__ if c.__name__ in WHOLE_TENSOR), name)
    advice = ADVICE.get(base, "keep the model replicated (zerolab.torchlike."
                        "DistributedDataParallel) or use an element-wise optimizer such as AdamW")
    return (f"{name} cannot step {where}: {why}, and a rank holds only a piece of each weight; "
            f"{advice}")


def check_elementwise(optimizer_class, elementwise=None):
    """Raise (one line) unless `optimizer_class` can run on flat shards. TypeError: not a
    torch.optim.Optimizer class. ValueError: a whole-tensor or sparse optimizer (`OPTIMIZERS`,
    `WHOLE_TENSOR`: by class name anywhere in its MRO; elementwise=True cannot overrule it), or
    one zerolab cannot vouch for - not element-wise by the table, or a subclass that overrides
    step() - unless elementwise=True says so. elementwise=False refuses any."""
    check_class(optimizer_class)
    if elementwise not in (None, True, False):
        raise ValueError(f"elementwise {elementwise!r} must be None, True or False")
    kind, _ = update_kind(optimizer_class)
    if kind in ("whole-tensor", "sparse") or (kind == "unknown" and elementwise is not True):
        raise ValueError(refusal(optimizer_class, "ZeRO's flat shards").replace(
            "call zerolab.optim.declare_elementwise(" + optimizer_class.__name__ + ") first",
            "pass elementwise=True"))
    if elementwise is False:
        raise ValueError(f"{optimizer_class.__name__}: elementwise=False refuses it")


# --- the clipping norm, and one unit's AdamW state out and in (zerolab.run.checkpoint) -------
def clip_grad_norm_(masters: list[torch.Tensor], max_norm: float, comm=None) -> torch.Tensor:
    """Global L2 norm of the gradients in `masters[i].grad` (fp32), summed over ranks when they
    hold disjoint shards (`comm` given: one all_reduce of a scalar), then scaled like
    torch.nn.utils.clip_grad_norm_ (coef = max_norm / (norm + 1e-6), capped at 1). max_norm <= 0
    only measures. Returns the norm (fp32 scalar tensor), equal on every rank."""
    sq = torch.zeros((), dtype=torch.float32, device=masters[0].device)
    for m in masters:               # no [Ψ_u] temporary: vector_norm reduces in place
        sq += torch.linalg.vector_norm(m.grad, dtype=torch.float32).square()
    if comm is not None:
        comm.all_reduce(sq, what="metric", unit="grad_norm")
    norm = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for m in masters:
            m.grad.mul_(coef)
    return norm


def optimizer_states(optimizer, masters) -> dict[str, list[torch.Tensor]]:
    """{"master_weights", "exp_avg", "exp_avg_sq"} tensors of `optimizer` (empty before step 1)."""
    state = [optimizer.state.get(m, {}) for m in masters] if optimizer is not None else []
    return {"master_weights": getattr(optimizer, "master_buffers", list)(masters),   # optim's ladder
            "exp_avg": [s["exp_avg"] for s in state if "exp_avg" in s],
            "exp_avg_sq": [s["exp_avg_sq"] for s in state if "exp_avg_sq" in s]}


def adam_state(optimizer, master: torch.Tensor, own=None) -> dict[str, torch.Tensor]:
    """{"master", "exp_avg", "exp_avg_sq"} of the fp32 tensor `master` (views, fp32), each
    through `own` (e.g. FlatUnit.own, when `master` is a full replica); zeros before step 1."""
    own = own or (lambda t: t)
    state = optimizer.state.get(master, {})
    zeros = torch.zeros_like(master)
    return {"master": own(master), "exp_avg": own(state.get("exp_avg", zeros)),
            "exp_avg_sq": own(state.get("exp_avg_sq", zeros))}


def set_adam_state(optimizer, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, step: int):
    """Give torch's AdamW the state of `master` after `step` updates, laid out as AdamW itself
    stores it (an fp32 scalar "step", moments shaped like `master`). step 0: no state."""
    optimizer.state.pop(master, None)
    if step > 0:
        optimizer.state[master] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                   "exp_avg": exp_avg.to(master).clone(),
                                   "exp_avg_sq": exp_avg_sq.to(master).clone()}
