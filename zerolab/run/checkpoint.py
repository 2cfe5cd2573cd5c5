"""Sharded checkpoints: every rank saves what it owns; resume at any world size and stage;
consolidate offline into a plain `GPT` state dict.

Idea (the notes count "how the checkpoint is saved" in the real memory picture): under ZeRO no
rank holds the whole training state, so no rank should have to gather it in order to save it.
Each rank writes its own range [Ψ_u/N] of every unit's fp32 master weights, exp_avg and
exp_avg_sq and of the parameters it holds: 4 + 4 + 4 + 2 = 14 bytes per element in bf16 (16 in
fp32; gradients are not saved, the next backward rebuilds them), so a checkpoint costs about
14Ψ/N bytes per rank on disk and no gathered copy in memory. DDP holds everything but writes
its 1/N too. Rank 0 adds meta.json: format version, step, the run's arguments and losses, the
model config and the unit layout (names, numel, padded numel, world size, the parameters of each
unit). Loading goes through the *logical* (unpadded, per-parameter) tensors, never raw shards:
padding depends on N, so a shard of N = 4 does not fit N = 3. A rank of the new run rebuilds
each unit's padded flat buffer from the parameters' logical values (one unit at a time, like a
ZeRO-3 gather) and takes its own range. So a run saved at N = 4 stage 2 resumes at N = 2 stage 3.

    zerolab train --stage 2 --nproc 4 --preset nano --steps 8 --save-every 4 --out runs/a
    zerolab train --stage 3 --nproc 2 --steps 12 --resume runs/a/stage2/checkpoints --out runs/b
    zerolab checkpoint consolidate runs/a/stage2/checkpoints runs/a/model.pt

Layout (zerolab/run/ckptio.py). A save is atomic: the rank files go to a hidden `.tmp_step_*`
folder; only after every rank has written and fsync'ed its file does rank 0 write meta.json
(with each file's size and sha256, sealed with its own), rename the folder into place and then
replace `latest` (the folder's name and meta.json's sha256). A crash or kill during a save
leaves the previous checkpoint and `latest` as they were; a full disk too, in one line. Reading
back checks every hash before anything is used. (Several nodes need a shared file system.)

    OUT/stage{S}/checkpoints/latest                   text: step_000008, meta.json's sha256
    OUT/stage{S}/checkpoints/step_000008/meta.json    rank 0
    OUT/stage{S}/checkpoints/step_000008/rank{r}.pt   torch.save({"units": {unit: {"params",
                                                      "master", "exp_avg", "exp_avg_sq"}},
                                                      "steps", "rng"[, "extra": rank 0]})

What is saved (format version 3), so that a resume continues exactly and consolidation maps
every piece onto torch's own layout:
- each trainable parameter's params, fp32 master, exp_avg and exp_avg_sq (the units, sharded);
- each trainable parameter's own AdamW step count, rank{r}.pt "steps" = {name: count} for the
  parameters whose range overlaps rank r's (the only ranks that advance it). torch.optim.AdamW
  keeps one count per parameter, and a parameter that gets no gradient in a step (a branch not
  taken, find_unused_parameters) keeps its count: one count for all would change its bias
  correction after a resume;
- the replicated state no unit holds, rank 0's "extra" {state_dict key: tensor}: frozen
  parameters (meta.json "frozen" lists them: requires_grad False when the strategy was built,
  so in no optimizer) and buffers;
- meta.json: format version, step, stage, world size, the run's args, losses, model config,
  the unit layout (the parameters each unit holds, i.e. the optimizer's, in flat order), the
  frozen parameters, the rank files' sizes and sha256 (version 3), its own sha256 ("sealed").
Version 1 checkpoints (no "steps", no "frozen") load with one count, the checkpoint's step, for
every parameter, as they were written. A resume may freeze or unfreeze parameters: one frozen
now takes its saved value (its optimizer state is dropped, as torch drops it from an optimizer
built over the trainable parameters); one trainable now that was frozen then starts from its
saved value with fresh AdamW state (zero moments, count 0), as a parameter added to a torch
optimizer does.

Why per-rank files and not torch.distributed.checkpoint (DCP) for the shards: DCP describes each
saved piece as a box (offsets, lengths) of a named logical tensor and reshards by intersecting
boxes. Our shard is a range of a padded flat buffer that runs across parameter seams (a rank may
own the last rows of c_fc.weight and the start of c_fc.bias) and whose padding depends on N.
Saved as the flat buffer, DCP could not reshard it (its global shape changes with N); saved per
parameter, each piece is a range of the *flattened* parameter, which DTensor's even Shard(0)
cannot describe (only the deprecated ShardedTensor can). Plain files keep the lesson visible
(`torch.load` one and see exactly what a rank owns), and resharding is a few lines below. DCP
sits at the boundary instead: `consolidate --dcp DIR` writes the full model as a DCP checkpoint,
which an FSDP2 (`fully_shard`) model loads at any world size.

Errors: `open_checkpoint` and `check_compatible` raise ValueError with one line for a missing
checkpoint or rank file, a truncated or unreadable file, a file (rank file, meta.json, latest)
that differs from the sha256 recorded when it was written, a format version from the future, or
another model config. Sources: DeepSpeed's zero_to_fp32.py (offline consolidation from the
optimizer shards), the torch.distributed.checkpoint docs, torch.optim.AdamW's state layout.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..model import GPTConfig
from . import ckptio
from .ckptio import FORMAT_VERSION, find, kept, latest_name  # noqa: F401 - the module's API

KEYS = ("params", "master", "exp_avg", "exp_avg_sq")
MODEL_ARGS = ("preset", "block_size")
RUNTIME_CONFIG = ("activation_checkpointing",)   # GPTConfig fields that change no parameter
# options a resumed run takes from the checkpoint unless given on its command line
RESUMED_ARGS = ("stages", "steps", *MODEL_ARGS, "batch_size", "grad_accum", "precision", "lr",
                "weight_decay", "max_grad_norm", "seed", "data", "zero1_grad_op",
                "optimizer_states", "master_rounding", "quantize_weights", "quantize_grads",
                "quant_block")
# not resumed: --bucket-mb (the unit layout). It changes no result, and the state is reloaded
# through logical per-parameter tensors, so a run resumes with any bucket size (default: one
# bucket per block), as with any world size.


def param_names(model) -> dict[int, str]:
    """{id(parameter): name}; a tied parameter gets its first name (wte.weight, not lm_head)."""
    return {id(p): name for name, p in model.named_parameters()}


def unit_layout(units, model) -> list[dict]:
    """meta.json's description of the flat units: name, numel, padded_numel, shard_numel and
    [parameter name, shape] in flat order."""
    names = param_names(model)
    return [{"name": u.name, "numel": u.numel, "padded_numel": u.padded_numel,
             "shard_numel": u.shard_numel,
             "params": [[names[id(p)], list(shape)] for p, shape in zip(u.params, u.shapes)]}
            for u in units]


def frozen_names(model, units) -> list[str]:
    """Parameters no unit holds (frozen when the strategy was built: in no optimizer), by name."""
    held = {id(p) for u in units for p in u.params}
    return [name for name, p in model.named_parameters() if id(p) not in held]


def param_steps(strategy, model) -> dict[str, int]:
    """{parameter name: its AdamW step count} for the parameters of this rank's ranges: the
    optimizer keeps state[u.master]["step"] = [P] fp32, one count per parameter of the unit
    (a 0-d count for all after a version 1 resume; no state before step 1: 0). A rank advances
    only the counts of parameters that overlap its range (all of them under DDP), so only those
    are written; every parameter of nonzero size overlaps some rank's."""
    names, out = param_names(model), {}
    for u in strategy.units:
        step = strategy.optimizer.state.get(u.master, {}).get("step")
        counts = ([0] * len(u.params) if step is None else
                  [int(step.item())] * len(u.params) if step.dim() == 0 else
                  [int(c) for c in step.tolist()])
        lo, hi = u.start, u.start + u.shard_numel
        for p, off, shape, count in zip(u.params, u.offsets, u.shapes, counts):
            if off < hi and off + shape.numel() > lo:
                out[names[id(p)]] = count
    return out


def _extra_state(model, units) -> dict[str, torch.Tensor]:
    """state_dict entries no unit holds (frozen parameters, buffers): replicated, rank 0 saves."""
    held = {id(p) for u in units for p in u.params}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict(keep_vars=True).items()
            if id(v) not in held}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# --- save: collective, every rank writes its own file ------------------------------------------
def save(strategy, model, root, step: int, meta: dict, *, crash_rank: int | None = None) -> Path:
    """Write the state after `step` optimizer steps to root/step_{step:06d}/ and point
    root/latest at it (`ckptio.write`: atomic, every file hashed; collective, every rank calls
    it; three all_gathers of a few bytes, no state moves).

    Rank r writes rank{r}.pt: its range [Ψ_u/N] of params (run dtype), master, exp_avg,
    exp_avg_sq (fp32) for every unit, the AdamW step count of each parameter that overlaps its
    range ("steps", `param_steps`) and its RNG state; rank 0 also the replicated state no unit
    holds (frozen parameters, buffers) and meta.json = `meta` (the run's args, model_config,
    losses, ...) + format_version, step, stage, world_size, units, frozen (parameter names),
    files {name: bytes}, sha256 {name: hex}, sealed. A rank that cannot write (a full disk)
    makes every rank raise the same one-line ValueError; the previous checkpoint stays latest.
    crash_rank (tests only): that rank truncates its file and kills itself mid-save.
    Returns the checkpoint folder.
    """
    rank, n = dist.get_rank(), dist.get_world_size()

    def state():
        shards = {u: {k: t.detach().cpu().clone() for k, t in d.items()}   # a view would save
                  for u, d in strategy.shard_state().items()}               # all storage behind
        out = {"format_version": FORMAT_VERSION, "rank": rank, "world_size": n, "step": step,
               "units": shards, "steps": param_steps(strategy, model), "rng": _rng_state()}
        if rank == 0:
            out["extra"] = _extra_state(model, strategy.units)
        return out

    def full_meta(files, hashes):
        return {**meta, "format_version": FORMAT_VERSION, "step": step, "stage": strategy.stage,
                "world_size": n, "units": unit_layout(strategy.units, model),
                "frozen": frozen_names(model, strategy.units), "files": files, "sha256": hashes}
    return ckptio.write(root, step, state, full_meta, crash_rank=crash_rank)


# --- open: read-only, checked, rank files memory-mapped ----------------------------------------
class Checkpoint:
    """A checkpoint folder opened by `open_checkpoint`: meta (dict), folder, step, world_size,
    stage, and the logical (unpadded) tensors of every parameter through `tensor(name, key)`."""

    def __init__(self, folder: Path, meta: dict, ranks: list[dict]):
        self.folder, self.meta, self.ranks = folder, meta, ranks
        self.step, self.world_size, self.stage = meta["step"], meta["world_size"], meta["stage"]
        self.index = {}                     # param name -> (unit name, offset, shape)
        for u in meta["units"]:
            offset = 0
            for pname, shape in u["params"]:
                self.index[pname] = (u["name"], offset, shape)
                offset += _numel(shape)
        self._cached = (None, None)
        self._steps = None

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        return self.ranks[0].get("extra", {})

    @property
    def optimizer_step(self) -> int:
        """AdamW's count for a parameter whose own count was not saved (version 1)."""
        return self.meta.get("optimizer_step", self.step)

    @property
    def frozen(self) -> list[str]:
        """The parameters that were in no optimizer (version 1: the saved ones no unit held)."""
        if "frozen" in self.meta:
            return list(self.meta["frozen"])
        return [k for k in self.extra if k not in self.index]

    def param_step(self, name: str) -> int:
        """The AdamW step count of trainable parameter `name`: its own (version 2, the ranks
        that held part of it wrote it), else the one count `optimizer_step` of version 1."""
        if self._steps is None:
            self._steps = {}
            for r in self.ranks:
                for k, v in r.get("steps", {}).items():
                    self._steps.setdefault(k, int(v))
        return self._steps.get(name, self.optimizer_step)

    def unit_flat(self, unit: str, key: str) -> torch.Tensor:
        """The saved world's padded flat buffer [padded_numel] of `key` for `unit` (the rank
        shards end to end). The last one is kept: a new rank reads one unit at a time."""
        if self._cached[0] != (unit, key):
            self._cached = ((unit, key), torch.cat([r["units"][unit][key] for r in self.ranks]))
        return self._cached[1]

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """The logical value of parameter `name` (its own shape; `key` one of KEYS): params in
        the saved run's dtype, the rest fp32. KeyError for a parameter the checkpoint lacks."""
        unit, offset, shape = self.index[name]
        return self.unit_flat(unit, key)[offset:offset + _numel(shape)].view(shape)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def open_checkpoint(path) -> Checkpoint:
    """Find, check and open the checkpoint at `path` (`ckptio.find`: a step_* folder, or the
    one `latest` names). Every rank file is opened memory-mapped (torch.load(mmap=True,
    weights_only=True)) after its size and sha256 are checked (`ckptio.load_rank_file`).
    Raises ValueError (one line) for a missing or unreadable meta.json or rank file, a file
    whose size differs from the one recorded (truncated), a newer format version; its subclass
    IntegrityError for a file (latest, meta.json, rank{r}.pt) that differs from the sha256
    recorded when it was written."""
    folder = ckptio.find(path)
    meta = ckptio.read_meta(folder)
    return Checkpoint(folder, meta, [ckptio.load_rank_file(folder, meta, r)
                                     for r in range(meta["world_size"])])


def check_compatible(ckpt: Checkpoint, cfg: GPTConfig):
    """ValueError (one line) when the run's model config `cfg` is not the checkpoint's."""
    saved = ckpt.meta["model_config"]
    diff = {k: (saved.get(k), v) for k, v in cfg.__dict__.items()
            if saved.get(k) != v and k not in RUNTIME_CONFIG}
    if diff:
        what = ", ".join(f"{k} {a} (this run: {b})" for k, (a, b) in diff.items())
        preset = ckpt.meta["args"].get("preset")
        raise ValueError(f"checkpoint {str(ckpt.folder)!r} was saved from another model (preset "
                         f"{preset!r}: {what}); resume with --preset {preset} or start a new run")


# --- resume: options, then the state into a freshly built strategy -----------------------------
def apply_resume_args(args, given: set[str], ckpt: Checkpoint) -> list[str]:
    """Take every option of RESUMED_ARGS that the command line did not give from the checkpoint;
    return notes ("--lr 0.002 (the checkpoint's: 0.001)") for given ones that differ."""
    notes = []
    for name in RESUMED_ARGS:
        saved = ckpt.meta["args"].get(name)
        if name not in given:
            setattr(args, name, saved)
        elif str(getattr(args, name)) != str(saved) and name not in MODEL_ARGS:
            notes.append(f"--{name.replace('_', '-')} {getattr(args, name)} (the checkpoint's: "
                         f"{saved})")
    return notes


def load(strategy, model, ckpt: Checkpoint, precision_dtype: torch.dtype):
    """Put the checkpoint's state into `strategy` (built for this run's world size and stage):
    each unit's flat buffers are rebuilt from logical tensors and padded for this N; each
    parameter gets its own AdamW step count (`Checkpoint.param_step`; version 1: ckpt.step for
    all). Saved parameters are used when their dtype is the run's, else the fp32 master weights
    are cast (exactly what the step does). Everything no unit of this run holds (frozen
    parameters, buffers) takes its saved value: the replicated copy, or the master weights of a
    parameter trainable when saved and frozen now. A parameter trainable now but frozen when
    saved starts from its saved value with fresh AdamW state. Restores this rank's RNG state."""
    names = param_names(model)
    own = model.state_dict(keep_vars=True)      # live tensors (ZeRO-3: no copy needed)
    missing = [names[id(p)] for u in strategy.units for p in u.params
               if names[id(p)] not in ckpt.index and names[id(p)] not in ckpt.extra]
    if missing:
        raise ValueError(f"checkpoint {str(ckpt.folder)!r} has no state for {missing[0]!r}")
    saved_dtype = ckpt.ranks[0]["units"][ckpt.meta["units"][0]["name"]]["params"].dtype

    def logical(name, key):
        if name in ckpt.index:
            return ckpt.tensor(name, key)
        value = ckpt.extra[name]                # frozen when saved: its value, fresh moments
        return torch.zeros(value.shape) if key in ("exp_avg", "exp_avg_sq") else value

    def read(u, key):
        if key == "params" and saved_dtype != precision_dtype:
            key = "master"
        dtype = precision_dtype if key == "params" else torch.float32
        return u.flatten([logical(names[id(p)], key) for p in u.params], dtype=dtype)

    strategy.load_state(read, ckpt.optimizer_step)
    for u in strategy.units:                    # each parameter's own count (torch keeps one
        state = strategy.optimizer.state.get(u.master)              # per parameter)
        counts = [ckpt.param_step(names[id(p)]) if names[id(p)] in ckpt.index else 0
                  for p in u.params]
        if state is not None and not any(counts):
            strategy.optimizer.state.pop(u.master)  # no parameter stepped yet: no state
        elif state is not None:
            state["step"] = torch.tensor(counts, dtype=torch.float32)
        elif any(counts):
            raise ValueError(f"checkpoint {str(ckpt.folder)!r}: step counts {counts} for unit "
                             f"{u.name!r} but no optimizer state")
    held = {id(p) for u in strategy.units for p in u.params}
    with torch.no_grad():
        for key, v in own.items():
            if id(v) in held:
                continue
            if key in ckpt.extra:
                v.copy_(ckpt.extra[key])
            elif names.get(id(v)) in ckpt.index:     # trainable when saved, frozen now
                v.copy_(ckpt.tensor(names[id(v)], "master"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = ckpt.ranks[rank if rank < len(ckpt.ranks) else 0]["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(rng["cuda"])


# --- full state dicts: gathered online (--save-params) or consolidated offline -----------------
def full_state_dict(model, value) -> dict[str, torch.Tensor]:
    """Every key of model.state_dict(), tied keys sharing one tensor: value(key, name) gives the
    tensor of a parameter (name: its first name) or of any other entry (name None)."""
    names, out, first = param_names(model), {}, {}
    for key, v in model.state_dict(keep_vars=True).items():
        if id(v) in first:
            out[key] = out[first[id(v)]]        # lm_head.weight is wte.weight
            continue
        first[id(v)] = key
        out[key] = value(key, names.get(id(v)))
    return out


def gather_flat(strategy, comm, key: str = "master") -> dict[str, torch.Tensor]:
    """Collective: {unit: [padded_numel]} of state `key` (one of KEYS) on every rank, one
    all_gather of each unit's owned range (ledger phase "eval"). All four keys at once are what
    a rank needs to write a consolidated checkpoint itself: 14Ψ bytes (bf16), vs 14Ψ/N sharded."""
    shards, out = strategy.shard_state(), {}
    with comm.phase("eval"):
        for u in strategy.units:
            own = shards[u.name][key].contiguous()                          # [Ψ_u/N]
            out[u.name] = torch.empty(u.padded_numel, dtype=own.dtype, device=own.device)
            comm.all_gather(out[u.name], own, what="params", unit=u.name)   # [Ψ_u]
    return out


def gather_state_dict(strategy, model, comm) -> dict[str, torch.Tensor]:
    """Collective: every rank gets the full fp32 state dict (every key of model.state_dict(),
    tied ones included) built from the fp32 master weights (`gather_flat`): 4Ψ bytes per rank."""
    names, flats, logical = param_names(model), gather_flat(strategy, comm, "master"), {}
    for u in strategy.units:
        logical.update({names[id(p)]: v for p, v in zip(u.params, u.views(flats[u.name]))})
    return full_state_dict(model, lambda key, name: (logical[name].cpu() if name in logical
                                                       else model.state_dict(keep_vars=True)[key]
                                                       .detach().float().cpu()))
