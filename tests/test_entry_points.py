"""Entry points a new user tries first, each doing what torch's does or saying why not in one line:
torch.save(model) of zerolab's DistributedDataParallel (torch's DDP tests pickle whole modules)
and, made up here, of a fully_shard model: refused, pointing to the state dict, which saved and
loaded into a model wrapped again gives the same weights; `model.load_state_dict(
model.full_state_dict())` on a fully_shard model; make_muon / muon_param_groups from `zerolab`."""
from __future__ import annotations

import io

import torch
import torch.nn as nn

from conftest import run_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 36)
        self.blocks = nn.ModuleList(nn.Linear(36, 36) for _ in range(2))
        self.norm = nn.LayerNorm(36)
        self.out = nn.Linear(36, 5)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(self.norm(h)).square().mean()


def wrap(kind, model):
    from zerolab.torchlike import DistributedDataParallel, fully_shard
    if kind == "ddp":
        return DistributedDataParallel(model)
    for b in model.blocks:
        fully_shard(b)
    return fully_shard(model)


def pickle_worker(rank, n, kind):
    torch.manual_seed(0)
    model = wrap(kind, Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 20, generator=torch.Generator().manual_seed(rank))).backward()
    opt.step()
    out = {}
    try:
        torch.save(model, io.BytesIO())
    except TypeError as e:
        out["error"] = str(e)
    weights = model.module.state_dict() if kind == "ddp" else model.full_state_dict()
    buf = io.BytesIO()
    torch.save(weights, buf)                    # the advice, followed
    buf.seek(0)
    torch.manual_seed(1)
    again = Net()
    again.load_state_dict(torch.load(buf, weights_only=True))
    again = wrap(kind, again)
    after = again.module.state_dict() if kind == "ddp" else again.full_state_dict()
    out["diff"] = max(float((after[k] - v).abs().max()) for k, v in weights.items())
    return out


def test_pickling_a_wrapped_model_is_refused_in_one_line_and_the_state_dict_round_trips():
    for kind, instead in (("ddp", "model.module.state_dict()"),
                          ("fsdp", "model.full_state_dict()")):
        for r in run_ranks(pickle_worker, 2, kind, timeout=90):
            assert "\n" not in r["error"] and instead in r["error"], r
            assert r["diff"] == 0, (kind, r)


def test_make_muon_and_muon_param_groups_are_importable_from_zerolab():
    import zerolab
    from zerolab.variants.compose import make_muon
    from zerolab.wholematrix.wholeopt import muon_param_groups
    assert zerolab.make_muon is make_muon and zerolab.muon_param_groups is muon_param_groups


def dcp_save_worker(rank, n, folder):
    """Train 2 steps on N ranks (AdamW), then save the full model and optimizer state with
    torch.distributed.checkpoint; the weights after a 3rd step are the reference the loading
    world must reach."""
    import torch.distributed.checkpoint as dcp

    from zerolab.torchlike.checkpoint import full_optim_state_dict
    torch.manual_seed(0)
    model = wrap("fsdp", Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(model, step, rank, n).backward()
        opt.step()
        opt.zero_grad()
    full = model.full_state_dict()
    model.load_state_dict(full)                 # the natural first try: it loads
    dcp.save({"model": full, "optim": full_optim_state_dict(model, opt)}, checkpoint_id=folder)
    loss_of(model, 2, rank, n).backward()
    opt.step()
    return {k: v.detach() for k, v in model.full_state_dict().items()}


def loss_of(model, step, rank, n):
    """Rank `rank`'s share of step `step`'s global batch of 12 rows (the same rows at any n)."""
    x = torch.randn(12, 20, generator=torch.Generator().manual_seed(step))
    rows = x.chunk(n)[rank] if rank < len(x.chunk(n)) else x[:0]
    return model(rows) * len(rows) / 12 * n


def dcp_load_worker(rank, m, folder):
    import torch.distributed.checkpoint as dcp

    from zerolab.torchlike.checkpoint import empty_optim_state_dict, load_full_optim_state_dict
    torch.manual_seed(rank + 5)                 # not the saved weights
    model = wrap("fsdp", Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = {"model": {k: torch.empty_like(v) for k, v in Net().state_dict().items()},
              "optim": empty_optim_state_dict(model, folder)}
    dcp.load(target, checkpoint_id=folder)
    model.load_state_dict(target["model"])      # full tensors: this rank's rows
    load_full_optim_state_dict(model, opt, target["optim"])
    loss_of(model, 2, rank, m).backward()
    opt.step()
    return {k: v.detach() for k, v in model.full_state_dict().items()}


def test_a_full_checkpoint_saved_with_dcp_at_2_ranks_loads_at_3_and_trains_on_alike(tmp_path):
    """Model and AdamW state saved at 2 ranks, loaded at 3: the step after the load gives the
    weights the 2-rank run reached (its own 3rd step)."""
    saved = run_ranks(dcp_save_worker, 2, str(tmp_path / "ck"), timeout=90)[0]
    loaded = run_ranks(dcp_load_worker, 3, str(tmp_path / "ck"), timeout=90)
    for r in loaded:
        assert max(float((r[k] - v).abs().max()) for k, v in saved.items()) <= 1e-6
