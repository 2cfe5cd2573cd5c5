"""ZeRO-Offload: the optimizer lives on the host - fp32 master, exp_avg, exp_avg_sq and AdamW.

Idea (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
arXiv:2101.06840; DeepSpeed's `"zero_optimization": {"offload_optimizer": {"device": "cpu",
"pin_memory": true}}`): of ZeRO-2's 2Ψ + 14Ψ/N bytes per rank, the 12Ψ/N of optimizer state are
touched once a step, by an element-wise update that needs no accelerator. So they move to the
host's (much larger) memory, and the host's cores run AdamW; the device keeps what forward and
backward need. Per rank, with bf16 weights and gradients (`device_bytes`, `host_bytes`):

    device   weights 2Ψ (replicated), gradient shard 2Ψ/N (ZeRO-1: the full 2Ψ)
    host     fp32 master 4Ψ/N, exp_avg 4Ψ/N, exp_avg_sq 4Ψ/N   (what left the device)
             fp32 gradient 4Ψ/N (AdamW reads fp32; DeepSpeed keeps it pinned too)
             bf16 staging 2Ψ/N (pinned: the landing buffer of the copies both ways)

zerolab's device keeps more than the paper's. The paper and DeepSpeed keep only the fp16/bf16
weights on the GPU, about 2Ψ (each reduced gradient partition is copied to the host during
backward); zerolab keeps its reduced gradient shard on the device until the step sends it down:

    paper / DeepSpeed    device 2Ψ          zerolab (ZeRO-2)    device 2Ψ + 2Ψ/N

One step, after backward has reduce-scattered the gradients (`Offload.update`, `wait_up`):

    1. down   each unit's bf16 gradient shard -> host staging          2Ψ/N bytes over PCIe
    2. host   bf16 -> fp32, global norm + clipping (one scalar all_reduce on the device),
              AdamW on the Ψ/N owned elements, fp32 -> bf16 into the staging buffer
    3. up     staging -> this rank's range of the device weights       2Ψ/N bytes over PCIe
    4. the strategy all_gathers the updated ranges, as without offload

The arithmetic is the strategies' own (the same casts, `optim.clip_grad_norm_`, FlatAdamW), so
an offloaded run's losses equal the non-offloaded run's bit for bit where host and device compute
alike (here: the CPU). The paper sends fp16 gradients down (2 bytes); DeepSpeed's
stage_1_and_2.py casts each partition to fp32 on the GPU first (`src_tensor.float()`, 4 bytes).

Where the copies run. On CUDA they are real: pinned host buffers, `copy_(non_blocking=True)` on
the current stream, a CUDA event waited on before the host reads (down) or the all_gather needs
the weights (up); `link`, if given, only supplies the model's figure printed next to them. On a
CPU laptop the "device" is the CPU itself, so a copy is a memcpy and the PCIe link is emulated:
each transfer takes its place on its direction's link clock (PCIe is full duplex) and `wait()`
sleeps until α + bytes/β has passed since it began there (`link`: any object with `bandwidth`
in bytes/s and `latency` in s, e.g. zerolab.timing.hardware's "pcie4"; None: no emulated time),
as zerolab.timing.linkemu does for collectives. The host side is real either way: on a 2-core
laptop the host AdamW competes with the "device" for the same cores, the CPU-starved regime.

Every transfer of the step goes into a per-rank ledger (`records`: step, direction, unit,
bytes, seconds, the link model's seconds; the step before is dropped) and every step into
`steps`: seconds spent in down, host (the casts, the norm and AdamW; of which adam), sync (the
norm's scalar all_reduce: waiting for the slowest rank), up; the rest of a step is the
device's forward, backward and collectives.
Weights the loop edits between steps (guards' contract) are noticed by a checksum of this rank's
range, computed on the device, and only then brought down ("edits" in the ledger).
"""
from __future__ import annotations

import contextlib
import time

import torch

from .. import theory
from ..loop.guards import take_changed, take_replaced
from ..optim import clip_grad_norm_, optimizer_states

HOST = torch.device("cpu")
#: the categories of host memory (zerolab.memory counts "host_*" apart from the device's)
HOST_STATES = ("host_master_weights", "host_exp_avg", "host_exp_avg_sq", "host_grads",
               "host_staging")
OPTIMIZER = ("master_weights", "exp_avg", "exp_avg_sq")       # none of them left on the device
CHUNK = 1 << 20                         # elements per piece of a checksum: bounded temporaries


# --- the formulas ---------------------------------------------------------------------------
def device_bytes(psi: float, world_size: int, stage: int, precision: str = "bf16",
                 grad_dtype: str | None = None) -> dict[str, float]:
    """Per-rank device bytes of each of `theory.STATES` with the optimizer offloaded: the
    weights (2Ψ, bf16) and the gradients (ZeRO-1 2Ψ, ZeRO-2 2Ψ/N); 0 for master and moments.
    No fp32 gradient copy either: AdamW's is on the host."""
    _check_stage(stage)
    per = theory.bytes_per_param(precision, grad_dtype)
    n = theory.check_world_size(world_size)
    return {s: 0.0 if s in OPTIMIZER else psi * per[s] / (n if theory.is_sharded(s, stage) else 1)
            for s in theory.STATES}


def host_bytes(psi: float, world_size: int, precision: str = "bf16",
               grad_dtype: str | None = None, states: str = "fp32") -> dict[str, float]:
    """Per-rank host bytes (`HOST_STATES`): the optimizer's states of the Ψ/N owned elements
    (fp32 master 4, moments 4 + 4, or 2 + 2 with states "bf16-moments"), the fp32 gradient AdamW
    reads (4) and the staging buffer of the copies (2 when weights or gradients are bf16)."""
    per = theory.bytes_per_param(precision, grad_dtype, states)
    shard = psi / theory.check_world_size(world_size)
    staging = sum({b for b in (per["params"], per["grads"]) if b != 4})
    return {"host_master_weights": 4 * shard, "host_exp_avg": per["exp_avg"] * shard,
            "host_exp_avg_sq": per["exp_avg_sq"] * shard, "host_grads": 4 * shard,
            "host_staging": staging * shard}


def transfer_bytes(psi: float, world_size: int, precision: str = "bf16",
                   grad_dtype: str | None = None) -> dict[str, float]:
    """Per-rank bytes over the host link per step: {"down": the gradient shard (2Ψ/N),
    "up": the updated weights of the owned range (2Ψ/N)} - ZeRO-1 and ZeRO-2 alike."""
    per = theory.bytes_per_param(precision, grad_dtype)
    shard = psi / theory.check_world_size(world_size)
    return {"down": per["grads"] * shard, "up": per["params"] * shard}


def link_seconds(nbytes: float, link, transfers: int = 1) -> float:
    """The α-β time of `transfers` copies of `nbytes` bytes in all on `link` (`bandwidth` bytes/s,
    `latency` s): transfers·α + bytes/β; 0 without a link."""
    return 0.0 if link is None else transfers * link.latency + nbytes / link.bandwidth


def step_model(psi: float, world_size: int, units: int, link, host_s: float, device_s: float,
               precision: str = "bf16", grad_dtype: str | None = None) -> dict[str, float]:
    """A step of this schedule, where nothing overlaps (down after backward, up after AdamW):
    {"down_s", "host_s", "up_s", "device_s", "step_s"} - the transfers by `link_seconds` (one
    copy per unit each way, `transfer_bytes`), the host's update `host_s` and the device's
    forward, backward and collectives `device_s` as given (measured: zerolab.course.offloadcheck)."""
    moved = transfer_bytes(psi, world_size, precision, grad_dtype)
    out = {"down_s": link_seconds(moved["down"], link, units), "host_s": host_s,
           "up_s": link_seconds(moved["up"], link, units), "device_s": device_s}
    return {**out, "step_s": sum(out.values())}


def format_table(psi: float, world_size: int, precision: str = "bf16",
                 grad_dtype: str | None = None, unit: float = 1e9) -> str:
    """`zerolab memory`'s ZeRO-Offload rows: GB per rank on the device and on the host, GB over
    PCIe per step each way, and the device's GB of the same stage without offload."""
    lines = [f"  {'':<20}{'device':>10}{'host':>10}{'PCIe down':>11}{'up':>9}   without offload"]
    moved = transfer_bytes(psi, world_size, precision, grad_dtype)
    host = sum(host_bytes(psi, world_size, precision, grad_dtype).values())
    for stage in (1, 2):
        device = sum(device_bytes(psi, world_size, stage, precision, grad_dtype).values())
        plain = theory.model_state_total(psi, world_size, stage, precision, grad_dtype=grad_dtype)
        lines.append(f"  {theory.STAGE_NAMES[stage] + ' offload':<20}{device / unit:>10.4g}"
                     f"{host / unit:>10.4g}{moved['down'] / unit:>11.4g}{moved['up'] / unit:>9.4g}"
                     f"   {plain / unit:.4g}")
    return "\n".join(lines)


def _check_stage(stage):
    if stage not in (1, 2):
        raise ValueError(f"offload moves ZeRO-1/2's optimizer to the host, not stage {stage}'s: "
                         "use stage 1 or 2")


def checksum(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 of `t`'s bits (contiguous, 1-D): their sum, and their sum weighted by position
    (as guards.fingerprint), in pieces of CHUNK elements, on `t`'s device."""
    bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, bits.numel(), CHUNK):
        b = bits[lo:lo + CHUNK].to(torch.int64)
        w = torch.arange(lo, lo + b.numel(), device=t.device) % 8191 + 1
        out[0] += b.sum()
        out[1] += (b * w).sum()
    return out


# --- one copy in flight ---------------------------------------------------------------------
class Transfer:
    """A copy `src` -> `dst` (same dtype: what crosses the link is what lands) between device and
    host memory, started at construction; `wait()` returns when it is done (module docstring)."""

    def __init__(self, offload: "Offload", direction: str, unit: str, dst, src):
        assert dst.dtype == src.dtype and dst.numel() == src.numel(), (dst.dtype, src.dtype)
        self.t0 = time.perf_counter()
        dst.copy_(src, non_blocking=offload.pinned)
        self.event = None
        if offload.pinned:                  # the copy engine works on; the host goes on too
            self.event = torch.cuda.Event()
            self.event.record()
        nbytes = src.numel() * src.element_size()
        model = link_seconds(nbytes, offload.link)
        self.deadline = 0.0
        if offload.emulated and offload.link is not None:   # its place on the emulated link
            begin = max(self.t0, offload.free_at.get(direction, 0.0))
            self.deadline = offload.free_at[direction] = begin + model
        step = getattr(offload.comm, "step", None)
        self.record = {"step": step, "dir": direction, "unit": unit, "bytes": nbytes,
                       "model_s": model, "s": None}
        offload.records.append(self.record)

    def wait(self):
        if self.event is not None:
            self.event.synchronize()
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)           # waiting, not computing: the core is free
        if self.record["s"] is None:
            self.record["s"] = time.perf_counter() - self.t0


class _OnDevice:
    """The comm `optim.clip_grad_norm_` gets when the gradients are on the host: its scalar
    all_reduce runs on a device copy (NCCL reduces device tensors) and comes back; its seconds
    (mostly waiting for the slowest rank) are the step's "sync_s", not the host's work."""

    def __init__(self, offload, comm):
        self.offload, self.comm = offload, comm

    def all_reduce(self, t, **kw):
        with self.offload._timed("sync_s"):
            d = t.to(self.offload.device)
            self.comm.all_reduce(d, **kw)
            if d is not t:
                t.copy_(d)


# --- the host side of one strategy ----------------------------------------------------------
class Offload:
    """`Offloaded`'s policy: where ZeRO-1/2's optimizer states live and how they move.

    link: the host link's `bandwidth` (bytes/s) and `latency` (s) - emulated when the device is
    the CPU, the model's figure on CUDA; None: no emulated time. pin_memory: pinned host
    buffers (default: on CUDA). One Offload serves one strategy (`attach`)."""

    def __init__(self, link=None, pin_memory: bool | None = None):
        self.link, self.pin_memory = link, pin_memory
        self.units, self.device = None, None
        self.records: list[dict] = []       # this step's transfers (module docstring)
        self.steps: list[dict] = []         # per step: seconds in down, host, adam, up
        self.free_at: dict[str, float] = {}
        self.grad, self.staging, self.sums, self.up = {}, {}, {}, {}
        self.comm = None                    # the strategy's: its `step` labels the ledger

    # --- building: called from the strategy's __init__ -----------------------------------
    def host_master(self, u) -> torch.Tensor:
        """The fp32 master of `u`'s owned range [Ψ_u/N], made in host memory (not on the device
        first): the strategy's `u.master`."""
        own = u.own(u.param_flat)
        self.device = own.device
        self.pinned = bool(self.pin_memory if self.pin_memory is not None
                           else own.device.type == "cuda")
        self.emulated = own.device.type == "cpu"
        master = self._empty(own.numel(), torch.float32)
        master.copy_(own)
        return master

    def check(self, optimizer_states: str = "fp32"):
        """ValueError (one line) before a strategy is built: this Offload serves one already, or
        optimizer_states "bf16-master" (its master is the device's bf16 weights: nothing to
        offload)."""
        if self.units is not None:
            raise ValueError("this Offload serves a strategy already: give each its own")
        if optimizer_states == "bf16-master":
            raise ValueError("offload with optimizer_states 'bf16-master': its master is the "
                             "bf16 weights on the device, nothing to offload (use fp32 or "
                             "bf16-moments)")

    def attach(self, units, comm, optimizer_states: str = "fp32"):
        """The host buffers of `units` (their `master` from `host_master`, their gradient buffer
        `grad_shard` or `grad_flat` built): the fp32 gradient AdamW reads and the staging buffer;
        the checksums of the owned ranges; `comm`, whose `step` labels the ledger. ValueError
        as `check`."""
        self.check(optimizer_states)
        self.units, self.comm = units, comm
        for u in units:
            grads = u.grad_shard if u.grad_shard is not None else u.grad_flat
            dtypes = {u.param_flat.dtype, grads.dtype} - {torch.float32}
            assert len(dtypes) <= 1, dtypes
            self.grad[u.name] = self._empty(u.shard_numel, torch.float32)   # [Ψ_u/N] fp32
            self.staging[u.name] = (self._empty(u.shard_numel, dtypes.pop()) if dtypes
                                    else None)                              # [Ψ_u/N] bf16
            self.sums[u.name] = checksum(u.own(u.param_flat))

    def _empty(self, numel: int, dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pinned)

    def _land(self, u, dtype) -> torch.Tensor:
        """The host buffer a copy of `u`'s range in `dtype` lands in: staging, or the fp32 one."""
        s = self.staging[u.name]
        return s if s is not None and s.dtype == dtype else self.grad[u.name]

    # --- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self, key):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.steps[-1][key] += time.perf_counter() - t0

    def update(self, units, grads, optimizer, used, max_grad_norm: float, comm) -> torch.Tensor:
        """Steps 1-3 of the module docstring: `grads` [Ψ_u/N] (each unit's averaged gradient of
        its owned range, on the device) down, clip + AdamW on the host, the new weights' copies
        up started (`wait_up(u)` before they are read). Returns the global gradient norm."""
        self.records = [r for r in self.records if r["step"] == comm.step]  # this step's only
        self.steps.append({"step": comm.step, "down_s": 0.0, "host_s": 0.0, "adam_s": 0.0,
                           "sync_s": 0.0, "up_s": 0.0})
        with self._timed("down_s"):                         # 1. gradients down
            for t in [Transfer(self, "down", u.name, self._land(u, g.dtype), g)
                      for u, g in zip(units, grads)]:
                t.wait()
        with self._timed("host_s"):                         # 2. the update, on the host
            for u, g in zip(units, grads):
                landed = self._land(u, g.dtype)
                if landed is not self.grad[u.name]:
                    self.grad[u.name].copy_(landed)         # bf16 -> fp32, on the host
                u.master.grad = self.grad[u.name]
            norm = clip_grad_norm_([u.master for u in units], max_grad_norm,
                                   _OnDevice(self, comm))
            with self._timed("adam_s"):
                optimizer.step(used)
            sources = []
            for u in units:
                if u.param_flat.dtype == torch.float32:     # fp32 weights: the master goes up
                    sources.append(u.master)
                else:
                    sources.append(self.staging[u.name].copy_(u.master))   # fp32 -> bf16, host
        self.steps[-1]["host_s"] -= self.steps[-1]["sync_s"]   # the norm's wait: not work
        with self._timed("up_s"):                           # 3. the new weights up
            for u, src in zip(units, sources):
                self.up[u.name] = Transfer(self, "up", u.name, u.own(u.param_flat), src)
        return norm

    def wait_up(self, u):
        """Wait until `u`'s updated range has reached the device weights (then all_gather it)."""
        with self._timed("up_s"):
            self.up.pop(u.name).wait()
        self.sums[u.name] = checksum(u.own(u.param_flat))

    # --- weights changed outside the step --------------------------------------------------
    def adopt_edits(self, units):
        """guards.adopt_edits for host masters: `p.data = t` taken in; if this rank's range no
        longer has the checksum it had when its update arrived, it is brought down ("edits")
        and every element that differs from the master overwrites it."""
        for u in units:
            take_replaced(u, u.param_flat)
            own = u.own(u.param_flat)
            now = checksum(own)
            if torch.equal(now, self.sums[u.name]):
                continue
            landed = self._land(u, own.dtype)
            Transfer(self, "edits", u.name, landed, own).wait()
            take_changed(u.master, landed)
            self.sums[u.name] = now

    def write_back(self, strategy, modifier_rank: int):
        """sharding.write_back for host masters: rank `modifier_rank`'s full weights broadcast,
        this rank's range taken into its master (`adopt_edits`)."""
        with strategy.comm.phase("eval"):
            for u in strategy.units:
                take_replaced(u, u.param_flat)
                strategy.comm.broadcast(u.param_flat, modifier_rank, what="params", unit=u.name)
        self.adopt_edits(strategy.units)

    def loaded(self, units):
        """After a checkpoint wrote weights and masters: the checksums of the ranges as loaded."""
        for u in units:
            self.sums[u.name] = checksum(u.own(u.param_flat))

    def to_device(self, states: dict) -> dict:
        """{key: tensor} on the device (a checkpoint's all_gather: NCCL needs device tensors);
        the very tensors when the device is the host."""
        return {k: v.to(self.device) for k, v in states.items()}

    # --- what it holds and moved ---------------------------------------------------------
    def host_tensors(self, optimizer) -> dict[str, list[torch.Tensor]]:
        """The strategy's `state_tensors()` part for its optimizer: the device's optimizer
        categories empty, the host's (`HOST_STATES`) filled."""
        masters = [u.master for u in self.units]
        opt = optimizer_states(optimizer, masters)
        return {**{k: [] for k in (*OPTIMIZER, "grad_fp32")},
                **{"host_" + k: v for k, v in opt.items()},
                "host_grads": list(self.grad.values()),
                "host_staging": [s for s in self.staging.values() if s is not None]}

    def step_bytes(self, step: int) -> dict[str, int]:
        """{direction: bytes} the ledger holds for `step`."""
        out = {"down": 0, "up": 0, "edits": 0}
        for r in self.records:
            if r["step"] == step:
                out[r["dir"]] += r["bytes"]
        return out

    def summary(self, stage: int, precision: str, grad_dtype, states: str, step: int) -> dict:
        """The rank JSON's "offload" (zerolab.run.result): the link, the formulas of the device
        and host bytes at the padded Ψ (the meter measures them), the bytes moved in `step` and
        their formula, the seconds of every step (`steps`) and the ledger of `step`."""
        n, psi = self.units[0].world_size, sum(u.padded_numel for u in self.units)
        link = None if self.link is None else {
            "name": getattr(self.link, "name", "custom"), "bandwidth": self.link.bandwidth,
            "latency": self.link.latency}
        return {"link": link, "emulated": self.emulated, "pinned": self.pinned,
                "host_bytes_formula": host_bytes(psi, n, precision, grad_dtype, states),
                "device_bytes_formula": device_bytes(psi, n, stage, precision, grad_dtype),
                "bytes_per_step": self.step_bytes(step),
                "bytes_per_step_formula": transfer_bytes(psi, n, precision, grad_dtype),
                "link_model_s": {d: link_seconds(b, self.link, len(self.units))
                                 for d, b in transfer_bytes(psi, n, precision, grad_dtype).items()},
                "steps": list(self.steps),
                "records": [r for r in self.records if r["step"] == step]}


# --- the variant: ZeRO-1 / ZeRO-2 with this policy ------------------------------------------------
class Offloaded:
    """ZeRO-1 / ZeRO-2 with the optimizer on the host (a mixin: `class X(Offloaded, ZeRO2)`).

    offload: an `Offload` (True: one without an emulated link); the other options are the
    stage's. What changes: the master is made on the host (`new_master`), the update is steps
    1-3 of the module docstring (`update`), the updated range arrives from the host instead of
    being cast on the device (`write_own`), and the host's tensors are measured and saved.
    ValueError (one line): an Offload that serves a strategy already, or bf16-master states."""

    def __init__(self, model, comm, *, offload=True, **options):
        self.offload = Offload() if offload is True else offload
        states = options.get("optimizer_states", "fp32")
        self.offload.check(states)
        super().__init__(model, comm, **options)
        self.offload.attach(self.units, comm, states)

    def new_master(self, u) -> torch.Tensor:
        return self.offload.host_master(u)                      # [Ψ_u/N] fp32, on the host

    def update(self, used) -> torch.Tensor:
        # own range down, clip + AdamW on the host, new weights up (`Offload.update`)
        grads = [u.grad_shard if u.grad_shard is not None else u.own(u.grad_flat)
                 for u in self.units]                           # [Ψ_u/N] bf16 each
        norm = self.offload.update(self.units, grads, self.optimizer, used, self.max_grad_norm,
                                   self.comm)
        self._sample("optimizer step")
        self.publish_all()
        return norm

    def publish(self, u):                   # (ZeRO-2's own publish is the same)
        self.write_own(u)
        return self.gather_update(u)

    def write_own(self, u):                 # the own range: arrived from the host
        self.offload.wait_up(u)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {**super().state_tensors(), **self.offload.host_tensors(self.optimizer)}

    def shard_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: {"params": d.pop("params"), **self.offload.to_device(d)}
                for name, d in super().shard_state().items()}

    def load_state(self, read, step: int):
        super().load_state(read, step)
        self.offload.loaded(self.units)

    def write_back(self, modifier_rank: int):   # the masters are on the host
        self.offload.write_back(self, modifier_rank)

    def _adopt_edits(self):                 # the masters are on the host
        self.offload.adopt_edits(self.units)
