"""What the tests and the exercise checker share: toy models, batches, the single-process torch
reference, and a runner that starts N gloo ranks with a timeout.

Idea: a learner's ZeRO is graded by the SAME checks as zerolab's own (tests/test_equivalence.py,
`zerolab check`): the same models (`make_model`), the same batches (`global_batch`), the same
reference written from torch alone (`reference`: torch.optim.AdamW + clip_grad_norm_ on the whole
global batch, no zerolab code), the same tolerance. `run_ranks` starts `world_size` processes
(forkserver), initialises gloo on a free TCP port, calls `worker(rank, world_size, *args)` and
returns the ranks' results by rank; a rank that raises or a run past `timeout` seconds raises
`RanksFailed` with every rank's traceback (or its stack when killed).

    from zerolab.course.testing import run_ranks      # worker: a module-level function
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from ..loop import order

LR, WD, BETAS, EPS = 1e-4, 0.1, (0.9, 0.95), 1e-8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --- ranks --------------------------------------------------------------------------------------
class RanksFailed(RuntimeError):
    """A group of ranks that failed or timed out. `.why`: one line; `.ranks`: {rank: report}."""

    def __init__(self, why: str, ranks: dict[int, str]):
        super().__init__(why + "\n" + "".join(f"--- rank {r} ---\n{t}\n" for r, t in ranks.items()))
        self.why, self.ranks = why, ranks


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it when binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(worker, rank, world_size, port, folder, args):
    """Body of one rank: init gloo, run the worker, save its result or its traceback."""
    import torch.distributed as dist
    folder = Path(folder)
    stack_file = open(folder / f"rank{rank}.stack", "w")  # noqa: SIM115 - open while the rank lives
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        torch.set_num_threads(1)            # several ranks share 2 cores
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        try:
            result = worker(rank, world_size, *args)
        finally:
            if not order.broken():          # else a collective never completes: not joined
                dist.destroy_process_group()
        torch.save(result, folder / f"rank{rank}.pt")
        if order.broken():                  # a collective never completes: not joined
            os._exit(0)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        (folder / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim", "zerolab"]


def _context(preload=()):
    """forkserver: like spawn (a fresh, single-threaded parent; the worker pickled by name), but
    the server imports torch once (torch.optim's first step also imports torch._dynamo: ~3 s of
    CPU per process) and every rank is a fork of it, so a rank starts in milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def run_ranks(worker, world_size: int, *args, timeout: float = 120.0, preload=()) -> list:
    """Run `worker(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.
    Raises RanksFailed (a rank raised, or `timeout` seconds passed: every rank is killed)."""
    ctx = _context(preload)
    with tempfile.TemporaryDirectory(prefix="zerolab-ranks-") as folder:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(worker, r, world_size, port, folder, args),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline, failed_at, why = time.monotonic() + timeout, None, None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now                 # give the other ranks a moment to report
            if now > deadline:
                why = f"timed out after {timeout:.0f} s"
                break
            if failed_at is not None and now > failed_at + 3:
                why = "a rank failed"
                break
            time.sleep(0.05)
        if why is not None and why.startswith("timed out"):
            for p in procs:                     # ask each stuck rank where it is
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1)
        for p in procs:                         # nothing outlives the call
            if p.is_alive():
                p.kill()
            p.join(5)
        codes = [p.exitcode for p in procs]
        if why is None and any(c != 0 for c in codes):
            why = "a rank failed"
        if why is not None:
            report = {}
            for r in range(world_size):
                err, stack = Path(folder) / f"rank{r}.err", Path(folder) / f"rank{r}.stack"
                text = err.read_text() if err.exists() else ""
                if not text and stack.exists() and stack.read_text():
                    text = "stack when killed:\n" + stack.read_text()
                if not text:
                    text = "(finished)" if codes[r] == 0 else "(no traceback: killed while waiting)"
                report[r] = f"(exit code {codes[r]})\n{text}"
            raise RanksFailed(f"{worker.__name__} on {world_size} ranks: {why}", report)
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=True)
                if (Path(folder) / f"rank{r}.pt").exists() else None   # it left by os._exit(0)
                for r in range(world_size)]


# --- toy models (module level, so that the ranks can build them too) ----------------------------
class ToyBlock(nn.Module):
    """h + tanh(own(h)) (+ shared(h), when a Linear shared with other blocks is given)."""

    def __init__(self, dim, shared=None):
        super().__init__()
        self.own = nn.Linear(dim, dim)
        self.shared = shared

    def forward(self, h):
        out = h + torch.tanh(self.own(h))
        return out + 0.5 * self.shared(h) if self.shared is not None else out


class TiedToy(nn.Module):
    """Tied embedding / head, and one Linear used by blocks 0 and 2 (so it is in no single unit)."""

    def __init__(self, vocab=64, dim=16):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        shared = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([ToyBlock(dim, shared), ToyBlock(dim), ToyBlock(dim, shared)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def zero_units(self):
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), y.reshape(-1))


class Bias3(nn.Module):
    """A unit whose only parameter has 3 elements: fewer than 4 ranks, not divisible by 4."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([0.1, -0.2, 0.3]))

    def forward(self, h):
        return h + self.bias


class OddToy(nn.Module):
    """Sizes that no world size of 2-4 divides evenly: vocab 1001, dim 5, a 3-element bias in its
    own unit, a 1-element scalar in the root unit."""

    def __init__(self, vocab=1001, dim=5):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)               # 5005 elements
        self.down = nn.Linear(dim, 3)                      # 15 + 3
        self.bias3 = Bias3()                               # 3
        self.up = nn.Linear(3, vocab)                      # 3003 + 1001
        self.temperature = nn.Parameter(torch.ones(()))    # 1 element, root unit

    def zero_units(self):
        return [("down", self.down), ("bias3", self.bias3), ("up", self.up)]

    def forward(self, x, y):
        h = self.bias3(torch.tanh(self.down(self.emb(x))))
        logits = self.up(h) * self.temperature
        return F.cross_entropy(logits.float().flatten(0, 1), y.reshape(-1))


class CondBlock(nn.Module):
    """h + tanh(a(h)), plus b(h) on the rows whose `trigger` is set (rows starting with token 0):
    b only ever sees those rows and is skipped in Python when there is none, so it then gets no
    gradient. `unused` (if present) is never called."""

    def __init__(self, dim, with_unused=False):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, 3) if with_unused else None

    def forward(self, h, trigger):
        out = h + torch.tanh(self.a(h))
        if trigger.any():               # data-dependent control flow
            out = out.clone()
            out[trigger] = out[trigger] + self.b(h[trigger])
        return out


class CondToy(nn.Module):
    """Parameters that get no gradient: blocks[i].b (used only when a row starts with token 0),
    blocks[1].unused (never used, in a unit), `spare` (never used, in the root unit), and all of
    block 1 on a micro-batch with no row whose first token is 1 mod 3 (the whole unit skipped).
    Every branch selects rows, so one process on the whole batch computes the same function."""

    def __init__(self, vocab=64, dim=16):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([CondBlock(dim), CondBlock(dim, with_unused=True)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.spare = nn.Parameter(torch.ones(5))

    def zero_units(self):
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x, y):
        trigger = x[:, 0] == 0
        h = self.blocks[0](self.emb(x), trigger)
        take = x[:, 0] % 3 == 1             # block 1 runs on these rows only: a micro-batch
        if take.any():                      # without one skips the whole unit
            h = h.clone()
            h[take] = self.blocks[1](h[take], trigger[take])
        return F.cross_entropy(self.head(self.norm(h)).float().flatten(0, 1), y.reshape(-1))


def make_model(name: str, seed: int = 0) -> nn.Module:
    """The same freshly initialised fp32 model in every process that asks for (name, seed).

    nano: the GPT "nano" preset (tied embedding / head). nano4: nano with 4 blocks.
    nano_frozen: nano with wpe and block 0's c_fc.weight frozen (requires_grad=False).
    tied: TiedToy. odd: OddToy. cond: CondToy. Raises ValueError for another name.
    """
    from ..model import GPT, get_config
    torch.manual_seed(seed)
    if name == "nano":
        return GPT(get_config("nano"))
    if name == "nano4":
        return GPT(get_config("nano", n_layer=4))
    if name == "nano_frozen":
        model = GPT(get_config("nano"))
        model.wpe.weight.requires_grad_(False)
        model.blocks[0].c_fc.weight.requires_grad_(False)
        return model
    if name == "tied":
        return TiedToy()
    if name == "odd":
        return OddToy()
    if name == "cond":
        return CondToy()
    raise ValueError(f"model {name!r} is not one of nano, nano4, nano_frozen, tied, odd, cond")


def vocab_and_context(model) -> tuple[int, int]:
    cfg = getattr(model, "cfg", None)
    return (cfg.vocab_size, cfg.block_size) if cfg is not None else (model.vocab, 8)


def global_batch(model, step: int, rows: int, seed: int = 0, trigger=None):
    """(x, y) int64 [rows, T] for `step`, from a generator seeded by (seed, step) alone.
    trigger: row indices that start with token 0 (CondToy's branch); then no other row does."""
    vocab, T = vocab_and_context(model)
    g = torch.Generator().manual_seed(seed * 7919 + step)
    data = torch.randint(0, vocab, (rows, T + 1), generator=g)
    if trigger is not None:
        data[:, 0] = data[:, 0].clamp(min=1)
        data[list(trigger), 0] = 0
    return data[:, :-1], data[:, 1:]


def trigger(job: dict, step: int):
    """Rows of the global batch that take CondToy's branch at `step` (None: not a CondToy job)."""
    return job["trigger"][step % len(job["trigger"])] if "trigger" in job else None


def freeze(model, job: dict, step: int):
    """job["freeze"] = (step, name): set that parameter's requires_grad False from that step on."""
    if "freeze" in job and step == job["freeze"][0]:
        model.get_parameter(job["freeze"][1]).requires_grad_(False)


# --- the single-process reference ---------------------------------------------------------------
def reference(job: dict, n: int, steps: int, history: bool = False) -> dict:
    """Plain torch: AdamW on the global batch of `n` ranks; per-step loss, clip_grad_norm_ value,
    final params {name: fp32 tensor} (and, with history=True, the params after every step).

    job: {"model", "precision" ("fp32"/"bf16"), "grad_accum", "rows_per_micro", "max_norm"[, "lr",
    "trigger", "freeze"]}; AdamW in the GPT-2 / nanoGPT groups (weight decay WD on 2-D weights only).
    fp32: the model itself is optimised. bf16: the usual mixed-precision recipe, written out:
    bf16 weights for forward/backward, fp32 master copies updated by AdamW and copied back.
    No zerolab code is involved (only the model and the batches)."""
    A, per = job["grad_accum"], job["rows_per_micro"]
    model = make_model(job["model"]).to(DTYPES[job["precision"]])
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params] \
        if job["precision"] == "bf16" else params
    # the GPT-2 / nanoGPT groups: decay 2-D weights, not biases or LayerNorm weights
    groups = [{"params": [m for m, p in zip(masters, params) if p.dim() >= 2], "weight_decay": WD},
              {"params": [m for m, p in zip(masters, params) if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=job.get("lr", LR), betas=BETAS, eps=EPS)
    losses, norms, hist = [], [], []
    for step in range(steps):
        freeze(model, job, step)
        x, y = global_batch(model, step, n * A * per, trigger=trigger(job, step))
        for p in params:
            p.grad = None
        loss = model(x, y)
        loss.backward()
        if masters is not params:
            for m, p in zip(masters, params):
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(masters, job["max_norm"] if job["max_norm"] > 0
                                              else float("inf"))
        opt.step()
        if masters is not params:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        losses.append(loss.item())
        norms.append(norm.item())
        if history:
            hist.append({k: v.detach().float().clone() for k, v in model.named_parameters()})
    out = {"losses": losses, "norms": norms,
           "params": {k: v.detach().float() for k, v in model.named_parameters()}}
    if history:
        out["history"] = hist
    return out


def train_job(strategy, model, job: dict, rank: int, n: int, steps: int) -> tuple[list, list]:
    """The distributed side of `reference`: `steps` optimizer steps of `strategy` on this rank's
    rows of the same global batches (grad_accum micro-steps of rows_per_micro rows each, the
    last one synchronising). Returns (this rank's loss per step, the step's gradient norm)."""
    A, per = job["grad_accum"], job["rows_per_micro"]
    losses, norms = [], []
    for step in range(steps):
        strategy.comm.step = step
        freeze(model, job, step)
        x, y = global_batch(model, step, n * A * per, trigger=trigger(job, step))
        local = 0.0
        for micro in range(A):
            rows = slice((rank * A + micro) * per, (rank * A + micro + 1) * per)
            loss = strategy.forward(x[rows], y[rows])
            strategy.backward(loss / A, sync=micro == A - 1)
            local += loss.item() / A
        losses.append(local)
        norms.append(float(strategy.step()))
    return losses, norms


def max_param_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over every element of every parameter (same names on both sides)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def first_difference(got: dict, expected: dict, atol: float) -> tuple | None:
    """The first parameter (in `expected`'s order) with an element more than `atol` from
    `expected`: (name, index tuple, expected value, got value, max |diff|), or None."""
    for name, ref in expected.items():
        diff = (got[name] - ref).abs()
        if diff.numel() and diff.max().item() > atol:
            flat = int(diff.reshape(-1).argmax())
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ref.shape)) \
                if ref.dim() else ()
            return (name, index, ref.reshape(-1)[flat].item(), got[name].reshape(-1)[flat].item(),
                    diff.max().item())
    return None
