"""The formulas: model-state bytes per rank per ZeRO stage, traffic per step, busbw factors.

Idea: with AdamW and bf16 mixed precision every parameter costs 2 + 2 + 4 + 4 + 4 = 16 bytes
(bf16 weight, bf16 gradient, fp32 master weight, fp32 exp_avg m_t, fp32 exp_avg_sq v_t). ZeRO
stage s shards some of these five states over the N data-parallel ranks; `SHARDED_FROM_STAGE`
below is the single table that says which, and everything else in zerolab (strategies, labs,
docs) reads it.

    python -m zerolab memory --params 7.5e9 --world-size 64

Sources: the notes' "参数组成" table and per-stage formulas (16Ψ, 5.5Ψ, 3.75Ψ, 2Ψ at N = 8; the
notes write N for the parameter count, we write Ψ as the ZeRO paper does), the ZeRO paper
(Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12 gives 120 / 31.4 / 16.6 / 1.9 GB),
and nccl-tests' PERFORMANCE.md for the ring-algorithm byte counts and busbw factors.
"""
from __future__ import annotations

import math
import numbers

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

# The five model states, in the notes' order, with their bytes per parameter in bf16 mixed precision.
STATES = ("params", "grads", "master_weights", "exp_avg", "exp_avg_sq")
BYTES_PER_PARAM = {"params": 2, "grads": 2, "master_weights": 4, "exp_avg": 4, "exp_avg_sq": 4}

# From which stage on each state is sharded 1/N (llm.c's "zero_stage" idea, as one table).
SHARDED_FROM_STAGE = {"params": 3, "grads": 2, "master_weights": 1, "exp_avg": 1, "exp_avg_sq": 1}

# Per-rank bytes moved by the ring algorithm, as a fraction of the full array S (nccl-tests).
# The same factor turns algbw (S / t) into busbw.
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,    # even splits: a rank keeps 1/n, sends the rest
}
ZERO1_GRAD_OPS = ("all_reduce", "reduce_scatter")

# The low-precision state ladder (zerolab.optim.FlatAdamW; `state_ladder` below): what the
# optimizer states are stored in, and how a bf16 master rounds its update.
OPTIMIZER_STATES = ("fp32", "bf16-moments", "bf16-master")
MASTER_ROUNDING = ("nearest", "stochastic", "kahan")


def check_stage(stage) -> int:
    """Return `stage` as an int; raise ValueError naming it unless it is 0, 1, 2 or 3."""
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage {stage!r} is not one of 0, 1, 2, 3 (0 = DDP, 1-3 = ZeRO stages)")
    return int(stage)


def check_world_size(world_size) -> int:
    """Return `world_size` as an int; raise ValueError unless it is an integer >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size {world_size!r} must be an integer >= 1")
    return world_size


PARAM_SUFFIXES = {"k": 3, "m": 6, "b": 9, "g": 9, "t": 12}     # 125M, 7.5B (or 7.5G), 1.5T


def parse_params(psi) -> float:
    """Ψ from a number or from text as people write it: 7.5e9, '7.5B', '70 b', '125M', '1.5T',
    '7,500,000,000'. '7.5B' is read as the number 7.5e9 (one rounding), so it is exactly what was
    typed. ValueError (one line naming the value) unless it is a finite count >= 1."""
    text = str(psi).strip().replace(",", "").replace(" ", "")
    exponent = PARAM_SUFFIXES.get(text[-1:].lower())
    try:
        value = float(text if exponent is None else f"{text[:-1]}e{exponent}")
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"Ψ = {psi!r} is not a finite number of parameters >= 1: type e.g. 7.5e9 "
                         "or 7.5B")
    return value


def check_finite(flag: str, value, *, positive: bool = False, minimum: float | None = None) -> float:
    """`value` as a float; ValueError unless it is a finite number (> 0 when `positive`,
    >= `minimum` when given)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} {value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{flag} {value!r} must be a finite number")
    if positive and not number > 0:
        raise ValueError(f"{flag} {value!r} must be > 0")
    if minimum is not None and number < minimum:
        raise ValueError(f"{flag} {value!r} must be >= {minimum:g}")
    return number


def is_sharded(state: str, stage: int) -> bool:
    """True when `state` (one of STATES) is held 1/N per rank at `stage`."""
    return check_stage(stage) >= SHARDED_FROM_STAGE[state]


def check_optimizer_states(states: str = "fp32", rounding: str = "nearest",
                           precision: str = "bf16", grad_dtype: str | None = None):
    """ValueError (one line) unless `states` is one of OPTIMIZER_STATES, `rounding` one of
    MASTER_ROUNDING, a rounding other than "nearest" comes with "bf16-master" (the only rung
    with a bf16 master to round into) and "bf16-master" with bf16 weights and gradients (the
    weights are the master; an fp32 gradient would be rounded to bf16 before the update)."""
    if states not in OPTIMIZER_STATES:
        raise ValueError(f"--optimizer-states {states!r} is not one of {', '.join(OPTIMIZER_STATES)}")
    if rounding not in MASTER_ROUNDING:
        raise ValueError(f"--master-rounding {rounding!r} is not one of {', '.join(MASTER_ROUNDING)}")
    if rounding != "nearest" and states != "bf16-master":
        raise ValueError(f"--master-rounding {rounding} rounds a bf16 master: it needs "
                         f"--optimizer-states bf16-master, not {states}")
    if states == "bf16-master" and (precision != "bf16" or grad_dtype not in (None, "bf16")):
        raise ValueError("--optimizer-states bf16-master updates the bf16 weights themselves: it "
                         f"needs --precision bf16 and bf16 gradients, not {precision} weights"
                         + (f" with {grad_dtype} gradients" if grad_dtype else ""))


def bytes_per_param(precision: str = "bf16", grad_dtype: str | None = None,
                    states: str = "fp32", rounding: str = "nearest") -> dict[str, int]:
    """Bytes per parameter of each state: 2+2+4+4+4 for "bf16", 4+4+4+4+4 for "fp32".

    In "fp32" mode zerolab still keeps a separate fp32 master copy, so that every stage runs the
    same code path as in bf16 (the exact-equivalence tests use this mode).
    grad_dtype: the gradients' own dtype when it is not the weights' ("fp32" with bf16 weights:
    2+4+4+4+4 = 18 bytes, the fp32 gradient accumulation / reduction of Megatron and DeepSpeed).
    states, rounding: the low-precision ladder (`check_optimizer_states`, zerolab.optim):
    "bf16-moments" stores exp_avg / exp_avg_sq in 2 bytes each (bf16: 2+2+4+2+2 = 12);
    "bf16-master" makes the bf16 weights the master, 0 bytes of master_weights (8 in all), or 2
    with rounding "kahan": its bf16 compensation buffer (10).
    Raises ValueError for any other precision or grad_dtype, or a bad combination.
    """
    if precision == "bf16":
        out = dict(BYTES_PER_PARAM)
    elif precision == "fp32":
        out = {state: 4 for state in STATES}
    else:
        raise ValueError(f"precision {precision!r} is not one of 'bf16', 'fp32'")
    if grad_dtype is not None:
        if grad_dtype not in ("bf16", "fp32"):
            raise ValueError(f"grad_dtype {grad_dtype!r} is not one of 'bf16', 'fp32'")
        out["grads"] = 2 if grad_dtype == "bf16" else 4
    if (states, rounding) != ("fp32", "nearest"):
        check_optimizer_states(states, rounding, precision, grad_dtype)
        out["exp_avg"] = out["exp_avg_sq"] = 2
        if states == "bf16-master":
            out["master_weights"] = 2 if rounding == "kahan" else 0
    return out


def model_state_bytes(psi: float, world_size: int, stage: int, precision: str = "bf16",
                      optimizer_bytes: float | None = None, grad_dtype: str | None = None,
                      states: str = "fp32", rounding: str = "nearest") -> dict[str, float]:
    """Per-rank bytes of each model state (activations and buffers excluded).

    psi: trainable parameter count Ψ. world_size: data-parallel ranks N. stage: 0 (DDP) to 3.
    optimizer_bytes: K, bytes of optimizer state per parameter (default 12: fp32 master + m_t +
    v_t), split as master 4 and the rest evenly over exp_avg / exp_avg_sq. grad_dtype, states,
    rounding: see `bytes_per_param` (the ladder's states are sharded as the fp32 ones).
    Returns {state: bytes} for STATES; sharded states are psi/N * bytes (a float when N does not
    divide Ψ; zerolab pads each bucket, so measured bytes equal this formula at the padded Ψ).
    Raises ValueError for a bad stage, world size or precision.
    """
    check_stage(stage)
    check_world_size(world_size)
    per_param = bytes_per_param(precision, grad_dtype, states, rounding)
    if optimizer_bytes is not None:
        per_param["master_weights"] = min(4.0, optimizer_bytes)
        rest = max(0.0, optimizer_bytes - per_param["master_weights"]) / 2
        per_param["exp_avg"] = per_param["exp_avg_sq"] = rest
    return {state: psi * per_param[state] / (world_size if is_sharded(state, stage) else 1)
            for state in STATES}


def model_state_total(psi: float, world_size: int, stage: int, precision: str = "bf16",
                      optimizer_bytes: float | None = None, grad_dtype: str | None = None,
                      states: str = "fp32", rounding: str = "nearest") -> float:
    """Sum of `model_state_bytes`: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N in bf16 (bytes per rank);
    18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N with grad_dtype "fp32"; the ladder: `state_ladder`."""
    return sum(model_state_bytes(psi, world_size, stage, precision, optimizer_bytes,
                                 grad_dtype, states, rounding).values())


def grad_copy_bytes(psi: float, world_size: int, stage: int, precision: str = "bf16",
                    grad_dtype: str | None = None, states: str = "fp32") -> float:
    """Per-rank bytes of the fp32 gradient copies alive inside the optimizer step (the
    "grad_fp32" transient): AdamW runs on fp32 master weights, so gradients held in bf16 are
    converted (`master.grad = grad.float()`) for the rank's whole update range - the full Ψ in
    DDP, its 1/N range from ZeRO-1 on: 4Ψ or 4Ψ/N. Zero when the gradients already are fp32.
    states "bf16-master": the master is bf16 like the gradients, which it reads as they are
    (none), but ZeRO-1, whose `zero1.own_gradient` hands over an fp32 copy that is then rounded
    to a bf16 one: 2Ψ/N."""
    check_stage(stage)
    if states == "bf16-master":
        return 2 * psi / check_world_size(world_size) if stage == 1 else 0.0
    if bytes_per_param(precision, grad_dtype)["grads"] == 4:
        return 0.0
    return 4 * psi / (check_world_size(world_size) if stage >= 1 else 1)


def peak_step_bytes(psi: float, world_size: int, stage: int, precision: str = "bf16",
                    grad_dtype: str | None = None, states: str = "fp32",
                    rounding: str = "nearest") -> float:
    """Per-rank bytes alive inside the optimizer step: the resident model states plus the fp32
    gradient copies. bf16: 20Ψ, 4Ψ + 16Ψ/N, 2Ψ + 18Ψ/N, 20Ψ/N (the resident 16Ψ, 4Ψ + 12Ψ/N,
    ... are what stays between steps); grad_dtype "fp32": no copy, the resident 18 bytes.
    Not counted: AdamW's own per-parameter temporaries (one parameter at a time) and scalars."""
    return (model_state_total(psi, world_size, stage, precision, grad_dtype=grad_dtype,
                              states=states, rounding=rounding)
            + grad_copy_bytes(psi, world_size, stage, precision, grad_dtype, states))


def accumulation_grad_bytes(psi: float, world_size: int, stage: int, precision: str = "bf16",
                            no_sync: bool = False, grad_dtype: str | None = None) -> float:
    """Per-rank gradient bytes held between the micro-steps of one optimizer step. DDP and
    ZeRO-1 always hold the full local gradient (2Ψ in bf16): `backward(sync=False)` (torch's
    no_sync) costs no memory there. ZeRO-2/3 reduce-scatter every micro-step and keep 2Ψ/N;
    with no_sync=True (micro-steps before the last run with sync=False, FSDP2's
    set_requires_gradient_sync(False)) they hold the full local gradient too, 2Ψ - the price of
    sending one reduce_scatter a step instead of one per micro-step (`traffic_bytes`)."""
    n = check_world_size(world_size)
    full = psi * bytes_per_param(precision, grad_dtype)["grads"]
    return full / n if is_sharded("grads", stage) and not no_sync else full


def traffic_bytes(psi: float, world_size: int, stage: int, precision: str = "bf16",
                  zero1_grad_op: str = "all_reduce", grad_accum: int = 1,
                  grad_dtype: str | None = None, no_sync: bool = False) -> dict[str, float]:
    """Per-rank bytes sent per optimizer step by the ring algorithm, by collective.

    DDP: all_reduce of the gradients, 2(n-1)/n · 2Ψ in bf16 (once per step: micro-steps before the
    last skip the sync). ZeRO-1: the same all_reduce plus an all_gather of the updated params,
    3(n-1)/n · 2Ψ (the notes' path), or reduce_scatter + all_gather = 2(n-1)/n · 2Ψ. ZeRO-2:
    reduce_scatter every micro-step + one all_gather. ZeRO-3: per micro-step two all_gathers
    (forward and backward) and one reduce_scatter, 3(n-1)/n · 2Ψ; no all_gather after the step.
    no_sync=True: micro-steps before the last ran `backward(sync=False)`; ZeRO-2/3 then
    reduce_scatter once a step (and hold the full local gradient meanwhile:
    `accumulation_grad_bytes`); ZeRO-3 still gathers twice per micro-step.
    Returns {"all_reduce": B, "reduce_scatter": B, "all_gather": B} in bytes.
    Source: ZeRO paper section 7; nccl-tests PERFORMANCE.md.
    """
    check_stage(stage)
    n = check_world_size(world_size)
    if zero1_grad_op not in ZERO1_GRAD_OPS:
        raise ValueError(f"zero1_grad_op {zero1_grad_op!r} is not one of {ZERO1_GRAD_OPS}")
    per_param = bytes_per_param(precision, grad_dtype)
    grads, params = psi * per_param["grads"], psi * per_param["params"]
    ar, rs, ag = (RING_FACTOR[op](n) for op in ("all_reduce", "reduce_scatter", "all_gather"))
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    reductions = 1 if no_sync else grad_accum          # ZeRO-2/3: reduce_scatters a step
    if stage == 0 or (stage == 1 and zero1_grad_op == "all_reduce"):
        out["all_reduce"] = ar * grads
    elif stage in (1, 2):
        out["reduce_scatter"] = rs * grads * (reductions if stage == 2 else 1)
    if stage in (1, 2):
        out["all_gather"] = ag * params
    if stage == 3:
        out["reduce_scatter"] = rs * grads * reductions
        out["all_gather"] = 2 * ag * params * grad_accum
    return out


# --- ZeRO++'s quantized collectives (zerolab.variants.quant): qwZ weights, qgZ gradients --------------------
QUANT_BITS = {"int8": 8, "int4": 4}
SCALE_BYTES = 4                 # one fp32 scale per block of quantized values


def quantized_bytes(numel: int, bits: int, block: int, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes of `numel` values quantized block-wise to `bits` bits: ceil(numel·bits/8) codes (int4:
    two a byte) + scale_bytes·ceil(numel/block) scales. Block 256: int8 0.508x bf16, int4 0.258x."""
    return math.ceil(numel * bits / 8) + scale_bytes * math.ceil(numel / block)


def quantized_traffic_bytes(shard_numels, world_size: int, weights: str | None = None,
                            grads: str | None = None, block: int = 256, precision: str = "bf16",
                            grad_accum: int = 1, grad_dtype: str | None = None,
                            no_sync: bool = False) -> dict[str, float]:
    """ZeRO-3's bytes per rank per step with ZeRO++'s quantized collectives (`traffic_bytes`' keys),
    from the units' padded shard sizes Ψ_u/N (blocks restart in every shard). weights "int8" (qwZ):
    an all_gather moves (N-1)/N of N payloads of quantized_bytes(Ψ_u/N); grads "int8"/"int4" (qgZ):
    the reduce_scatter is an all_to_all moving (N-1)/N of N such payloads; None: bf16/fp32 as
    `traffic_bytes` (its stage-3 figures at the padded Ψ)."""
    n, per_param = check_world_size(world_size), bytes_per_param(precision, grad_dtype)

    def payload(fmt, plain):        # one rank's bytes of every unit's shard
        if fmt is not None and fmt not in QUANT_BITS:
            raise ValueError(f"{fmt!r} is not one of None, {', '.join(map(repr, QUANT_BITS))}")
        return sum(quantized_bytes(s, QUANT_BITS[fmt], block) if fmt else s * plain
                   for s in shard_numels)
    w, g = payload(weights, per_param["params"]), payload(grads, per_param["grads"])
    return {"all_reduce": 0.0, "reduce_scatter": RING_FACTOR["reduce_scatter"](n) * n * g
            * (1 if no_sync else grad_accum),
            "all_gather": 2 * RING_FACTOR["all_gather"](n) * n * w * grad_accum}


def busbw(op: str, size_bytes: float, seconds: float, group_size: int) -> float:
    """Bus bandwidth in bytes/s: algbw = S / t times the op's ring factor (nccl-tests).

    size_bytes S is the full (unsharded) array, group_size n the ranks in the collective's group.
    Raises ValueError for an unknown op.
    """
    if op not in RING_FACTOR:
        raise ValueError(f"op {op!r} is not one of {sorted(RING_FACTOR)}")
    if seconds <= 0:
        return float("nan")
    return size_bytes / seconds * RING_FACTOR[op](group_size)


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of world_size, so that every rank's shard has equal size."""
    return math.ceil(numel / world_size) * world_size


# --- gradient buckets: which blocks share one collective (sharding.build_units, costmodel) ---
MIB = 2**20     # bytes in a MiB: `bucket_mb` counts MiB, as torch DDP's bucket_cap_mb does


def bucket_groups(numels, bucket_numel: float | None = None) -> list[list[int]]:
    """Group consecutive blocks into gradient buckets: indices into `numels` (elements per
    block, forward order), one list per bucket. A bucket takes the next block while its total
    stays <= `bucket_numel` elements; a block larger than the cap gets a bucket of its own.
    None: one bucket per block (zerolab's default). Raises ValueError unless bucket_numel is a
    finite number > 0. Used by the strategies (sharding.build_units) and the cost model
    (costmodel.merge_units), so both group the same blocks."""
    if bucket_numel is None:
        return [[i] for i in range(len(numels))]
    if isinstance(bucket_numel, bool) or not (isinstance(bucket_numel, numbers.Real)
                                              and 0 < bucket_numel < math.inf):
        raise ValueError(f"bucket_numel {bucket_numel!r} must be a finite number > 0 (elements)")
    groups, total = [], 0
    for i, numel in enumerate(numels):
        if groups and total + numel <= bucket_numel:
            groups[-1].append(i)
            total += numel
        else:
            groups.append([i])
            total = numel
    return groups


def bucket_name(names: list[str]) -> str:
    """"block.0" for one block, "block.0-2" for blocks block.0 .. block.2 merged."""
    return names[0] if len(names) == 1 else f"{names[0]}-{names[-1].rsplit('.', 1)[-1]}"


def zero2_bucket_peak_bytes(bucket_numels, root_numel: int = 0, grad_bytes: int = 2) -> int:
    """Peak bytes of ZeRO-2's full-gradient buckets in one backward (the meter's grad_buckets):
    the root bucket (open for the whole backward) plus the largest sum of three consecutive
    block buckets - two reduce_scatters in flight and one filling (zero2.py keeps at most two
    in flight). bucket_numels: padded elements of each block bucket, in forward order;
    grad_bytes: bytes per gradient element (2 bf16, 4 fp32). Bigger buckets: a bigger peak."""
    b = list(bucket_numels)
    three = max((sum(b[i:i + 3]) for i in range(max(len(b) - 2, 1))), default=0)
    return (root_numel + three) * grad_bytes


def memory_table(psi: float, world_size: int, precision: str = "bf16",
                 optimizer_bytes: float | None = None, grad_dtype: str | None = None) -> list[dict]:
    """One row per stage: name, each state's per-rank bytes, total, total/Ψ (the '16N' column)
    and in_step (bytes alive inside the optimizer step, `peak_step_bytes`)."""
    rows = []
    for stage in STAGES:
        states = model_state_bytes(psi, world_size, stage, precision, optimizer_bytes, grad_dtype)
        total = sum(states.values())
        rows.append({"stage": stage, "name": STAGE_NAMES[stage], **states, "total": total,
                     "bytes_per_param": total / psi if psi else float("nan"),
                     "in_step": total + grad_copy_bytes(psi, world_size, stage, precision,
                                                        grad_dtype)})
    return rows


def format_memory_table(psi: float, world_size: int, precision: str = "bf16",
                        optimizer_bytes: float | None = None, unit: float = 1e9,
                        grad_dtype: str | None = None) -> str:
    """The memory table as text (GB = 1e9 bytes, as the ZeRO paper; psi=1, unit=1: per parameter)."""
    head = f"{'stage':<8}" + "".join(f"{s:>16}" for s in (*STATES, "total")) + f"{'bytes/param':>13}"
    dtype = f", {grad_dtype} grads" if grad_dtype else ""
    units = "GB" if unit == 1e9 else "bytes" if unit == 1 else f"units of {unit:g} bytes"
    title = (f"N = {world_size} ranks, {precision}{dtype}; per-rank model states in bytes per parameter"
             if psi == 1 and unit == 1 else            # the table per parameter: multiples of Ψ
             f"Ψ = {psi:.4g} parameters, N = {world_size} ranks, {precision}{dtype}; per-rank model "
             f"states in {units}")
    lines = [title, head]
    for row in memory_table(psi, world_size, precision, optimizer_bytes, grad_dtype):
        lines.append(f"{row['name']:<8}" + "".join(f"{row[s] / unit:>16.4g}" for s in (*STATES, "total"))
                     + f"{row['bytes_per_param']:>12.4g}Ψ")
    return "\n".join(lines)


def format_step_peaks(psi: float, world_size: int, precision: str = "bf16",
                      grad_dtype: str | None = None, unit: float = 1e9) -> str:
    """Per stage: resident model states and the bytes alive inside the optimizer step
    (`peak_step_bytes`), as text."""
    lines = [f"{'stage':<8}{'resident':>12}{'in step':>12}{'fp32 grad copies':>18}"]
    for stage in STAGES:
        resident = model_state_total(psi, world_size, stage, precision, grad_dtype=grad_dtype)
        copies = grad_copy_bytes(psi, world_size, stage, precision, grad_dtype)
        lines.append(f"{STAGE_NAMES[stage]:<8}{resident / unit:>12.4g}{(resident + copies) / unit:>12.4g}"
                     f"{copies / unit:>18.4g}")
    return "\n".join(lines)


# --- the low-precision state ladder (zerolab.optim; `zerolab memory` prints it) -------------
#: its rungs, (optimizer_states, master_rounding), from 16 down to 8 bytes per parameter; as
#: text: zerolab.course.ladder.format_state_ladder
LADDER = (("fp32", "nearest"), ("bf16-moments", "nearest"), ("bf16-master", "kahan"),
          ("bf16-master", "nearest"), ("bf16-master", "stochastic"))
#: Megatron-LM's distributed optimizer, bytes per parameter (its docs, dist-optimizer.md; the
#: middle row is bf16 parameters with fp32 gradients):
#: (params, grads): (replicated, sharded 1/d). 20: fp16/bf16 params and grads, an fp32 copy of
#: the gradient shard among the 16 sharded (zerolab's transient grad_fp32: `peak_step_bytes`'s
#: 20Ψ); 18: fp32 grads (zerolab's --grad-dtype fp32); 16: fp32 params that are their own master
#: (the idea of zerolab's "bf16-master" rung, in fp32).
MEGATRON_BYTES = {("fp16", "fp16"): (4, 16), ("bf16", "fp32"): (6, 12), ("fp32", "fp32"): (8, 8)}


def state_ladder(psi: float, world_size: int) -> list[dict]:
    """One row per rung of LADDER (bf16 weights and gradients): states, rounding, each state's
    bytes per parameter, bytes_per_param (their sum: 16, 12, 10, 8, 8) and per_rank
    {stage: model-state bytes per rank} (16Ψ / 4Ψ + 12Ψ/N / 2Ψ + 14Ψ/N / 16Ψ/N for "fp32";
    12Ψ / 4Ψ + 8Ψ/N / 2Ψ + 10Ψ/N / 12Ψ/N; 10Ψ / 4Ψ + 6Ψ/N / 2Ψ + 8Ψ/N / 10Ψ/N;
    8Ψ / 4Ψ + 4Ψ/N / 2Ψ + 6Ψ/N / 8Ψ/N)."""
    rows = []
    for states, rounding in LADDER:
        per = bytes_per_param("bf16", None, states, rounding)
        rows.append({"states": states, "rounding": rounding, **per,
                     "bytes_per_param": sum(per.values()),
                     "per_rank": {s: model_state_total(psi, world_size, s, states=states,
                                                       rounding=rounding) for s in STAGES}})
    return rows


# --- process groups of a 2-D device mesh (notebooks 08 and 09; exercise (f)) -----------------------
def mesh_groups(world_size: int, inner_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(rows, columns) of the (world_size / inner_size, inner_size) device mesh, ranks laid out
    row-major as torch's `init_device_mesh` does. Rows: inner_size consecutive ranks, one node's
    worth (the TP groups of notebook 09's (dp, tp) mesh; HSDP's shard groups in notebook 08's
    (replicate, shard) mesh). Columns: the ranks at the same place in every row (DP groups;
    HSDP's replicate groups): each column meets each row in exactly one rank.
    mesh_groups(8, 2) = ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]).
    Raises ValueError unless inner_size is an integer >= 1 that divides world_size."""
    n = check_world_size(world_size)
    if isinstance(inner_size, bool) or not isinstance(inner_size, int) or inner_size < 1 \
            or n % inner_size:
        raise ValueError(f"{n} ranks do not split into groups of {inner_size!r}")
    rows = [list(range(r, r + inner_size)) for r in range(0, n, inner_size)]
    return rows, [list(range(c, n, inner_size)) for c in range(inner_size)]
