"""The exercise checker's wrappers, one per exercise that starts collectives (ddp, zero1, zero2,
zero3): inside every rank they run the learner's functions with a spy `comm` (spy.py), compare
each collective's result with the right one (worked out outside the ledger) and with the usual
wrong ones (N x the average, a lost micro-step, the old weights, a bucket still alive), and note
a named mistake (diagnose.Notes) or stop before a crash (diagnose.Mistake). `instrument` is what
checker.py calls.
"""
from __future__ import annotations

import torch

from .diagnose import Mistake, Notes, _close, _largest, _same
from .spy import _file, _holds_memory, _name, _returned, _Spy


def _side_sum(t):
    """The sum over the ranks of `t` (a copy), outside the ledger: the right answer to compare."""
    import torch.distributed as dist
    out = t.detach().clone()
    dist.all_reduce(out)
    return out


def _side_gather(chunk, n):
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as comm
    chunk = chunk.detach().contiguous()
    out = torch.empty(chunk.numel() * n, dtype=chunk.dtype)
    gather(out, chunk)
    return out


def _ddp(functions, notes):
    fn, fname = functions["all_reduce_bucket"], "all_reduce_bucket"

    def all_reduce_bucket(comm, unit, world_size):
        n = world_size
        local = unit.grad_flat.detach().clone()
        avg = _side_sum(local) / n
        spy = _Spy(comm, unit, fname, _file(fn), notes)
        returned = fn(spy, unit, world_size)
        spy.flush()

        def after():
            got = unit.grad_flat
            if spy.flagged or _close(got, avg):
                return
            ours = [c for c in spy.calls if c.op == "all_reduce"]
            mine = [c for c in ours if c.names["tensor"] == "unit.grad_flat"]
            where = spy.where((mine or ours or spy.calls)[0].line) if spy.calls else fname
            if any(c.kw.get("op") == "max" for c in ours):
                text = (f"all_reduce(op='max') ({where}) keeps each element's largest gradient, "
                        f"not the sum: use the default op='sum', then divide by world_size in "
                        f"handle.on_done")
            elif ours and not mine:
                text = (f"all_reduces {ours[0].names['tensor']} ({where}), not unit.grad_flat: "
                        f"the sum lands there and unit.grad_flat keeps this rank's own gradient. "
                        f"all_reduce unit.grad_flat itself (in place: every p.grad is a view of "
                        f"it), and divide it in handle.on_done")
            elif not ours:
                text = (f"started no all_reduce ({where}): comm.all_reduce(unit.grad_flat, ...) "
                        f"sums the bucket over the ranks")
            elif _close(got, avg * n):
                text = (f"after its all_reduce ({where}) unit.grad_flat holds the SUM of the {n} "
                        f"ranks' gradients ({n} x the average): divide it by world_size in "
                        f"handle.on_done (e.g. handle.on_done = lambda: "
                        f"unit.grad_flat.div_(world_size))")
            elif _close(got, avg / n):
                text = (f"unit.grad_flat holds the average divided by world_size again "
                        f"({where}): divide once, in handle.on_done")
            elif _close(got, local):
                text = (f"after the wait, unit.grad_flat still holds this rank's own gradient "
                        f"({where}): all_reduce unit.grad_flat in place, then divide it in "
                        f"handle.on_done")
            else:
                text = (f"after its all_reduce ({where}) unit.grad_flat is not the average of "
                        f"the ranks' gradients ({_largest(got, avg)}): sum in place, then "
                        f"divide by world_size once, in handle.on_done")
            notes.add(fname, f"your {fname}: {text}")
        return _returned(returned, spy, notes, after)
    return {"all_reduce_bucket": all_reduce_bucket}


def _zero1(functions, notes):
    own_fn, pub_fn = functions["own_gradient"], functions["publish_update"]

    def own_gradient(unit):
        got = own_fn(unit)
        want = unit.own(unit.grad_flat).detach().float()
        k = unit.shard_numel
        if not torch.is_tensor(got) or tuple(got.shape) != (k,):
            shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise Mistake("own_gradient", f"your own_gradient returned {shape}; AdamW updates "
                          f"the master shard unit.master [{k}] with it: return this rank's "
                          f"range, unit.own(unit.grad_flat).float()")
        if not _close(got, want):
            for r in range(unit.world_size):
                if r != unit.rank and _close(got, unit.grad_flat[r * k:(r + 1) * k]):
                    notes.add("own_gradient", f"your own_gradient returned rank {r}'s range of "
                              f"unit.grad_flat on rank {unit.rank}: each rank updates its OWN "
                              f"range, unit.own(unit.grad_flat)")
                    return got
            notes.add("own_gradient", f"your own_gradient returned values that are not this "
                      f"rank's range of unit.grad_flat ({_largest(got, want)}): return "
                      f"unit.own(unit.grad_flat).float()")
        return got

    def publish_update(comm, unit):
        n = comm.world_size
        want = _side_gather(unit.master.to(unit.param_flat.dtype), n)
        before = unit.param_flat.detach().clone()
        spy = _Spy(comm, unit, "publish_update", _file(pub_fn), notes)
        returned = pub_fn(spy, unit)
        spy.flush()
        gathers = [c for c in spy.calls if c.op == "all_gather"]
        for c in gathers:
            if c.names["input"] == "unit.master":
                notes.add("publish_update", f"your publish_update all_gathers straight from "
                          f"unit.master ({spy.where(c.line)}): that works only while the weights "
                          f"are fp32 (as in this check); with bf16 weights the collective needs "
                          f"one dtype in and out. Copy unit.master into unit.own(unit.param_flat) "
                          f"(the copy converts), then all_gather from unit.own(unit.param_flat)")

        def after():
            got = unit.param_flat
            if spy.flagged or _close(got, want):
                return
            lo, hi = unit.start, unit.start + unit.shard_numel
            others = torch.cat([got[:lo], got[hi:]])
            old = torch.cat([before[:lo], before[hi:]])
            where = spy.where((gathers or spy.calls)[0].line) if spy.calls else "publish_update"
            if not gathers:
                text = (f"started no all_gather ({where}): comm.all_gather(unit.param_flat, "
                        f"unit.own(unit.param_flat), ...) brings every rank's updated range")
            elif gathers[0].names["input"] not in ("unit.own(unit.param_flat)", "unit.master"):
                text = (f"all_gathers from {gathers[0].names['input']} ({where}): gather from "
                        f"unit.own(unit.param_flat), into which you first copy unit.master")
            elif _close(got, before):
                text = (f"the weights did not change: the all_gather ({where}) shared "
                        f"unit.param_flat as it was. Copy unit.master into "
                        f"unit.own(unit.param_flat) BEFORE the all_gather (the copy also "
                        f"converts fp32 to the weights' dtype)")
            elif _close(got[lo:hi], want[lo:hi]) and _close(others, old):
                text = (f"only this rank's range of unit.param_flat changed; the other ranks' "
                        f"ranges are their OLD weights: the copy came after the all_gather "
                        f"({where}) had sent them. Copy unit.master into "
                        f"unit.own(unit.param_flat) BEFORE starting the all_gather")
            else:
                text = (f"after the all_gather ({where}) unit.param_flat is not every rank's "
                        f"updated master ({_largest(got, want)}): copy unit.master into "
                        f"unit.own(unit.param_flat), then all_gather it into unit.param_flat")
            notes.add("publish_update", f"your publish_update: {text}")
        return _returned(returned, spy, notes, after)
    return {"own_gradient": own_gradient, "publish_update": publish_update}


def _zero2(functions, notes):
    fn, fname = functions["reduce_scatter_bucket"], "reduce_scatter_bucket"
    from ...loop.guards import ShardedGrad

    def reduce_scatter_bucket(comm, unit, world_size):
        n = world_size
        prev = unit.grad_shard.detach().clone()
        chunk = unit.own(_side_sum(unit.bucket)) / n        # the averaged chunk of this rank
        spy = _Spy(comm, unit, fname, _file(fn), notes)
        returned = fn(spy, unit, world_size)
        spy.flush()

        def after():
            got = unit.grad_shard
            rs = [c for c in spy.calls if c.op == "reduce_scatter"]
            where = spy.where((rs or spy.calls)[0].line) if spy.calls else fname
            text = None
            if spy.flagged:
                pass
            elif torch.isnan(got.detach().float()).any():
                text = (f"used the reduce_scatter's output ({where}) before it had arrived: "
                        f"add it to unit.grad_shard (and free the bucket) in handle.on_done, "
                        f"which runs once the sum is in")
            elif _close(got, prev + chunk):
                pass
            elif prev.abs().max().item() > 0 and _close(got, chunk):
                text = (f"overwrote unit.grad_shard with this micro-step's chunk ({where}): the "
                        f"earlier micro-steps' gradient is lost. Micro-steps accumulate: "
                        f"unit.grad_shard.add_(chunk / world_size)")
            elif _close(got, prev + chunk * n) or _close(got, chunk * n):
                text = (f"unit.grad_shard received the SUM of the {n} ranks' chunks ({n} x the "
                        f"average) ({where}): divide the chunk by world_size before adding it")
            elif _close(got, prev):
                text = (f"unit.grad_shard did not change ({where}): in handle.on_done add the "
                        f"reduce_scatter's output / world_size to unit.grad_shard")
            else:
                text = (f"unit.grad_shard is not the previous micro-steps' shard plus this "
                        f"rank's averaged chunk ({_largest(got, prev + chunk)}): in "
                        f"handle.on_done, unit.grad_shard.add_(chunk / world_size)")
            if text:
                notes.add(fname, f"your {fname}: {text}")
            views = [p for p in unit.params if p.grad is not None and type(p.grad) is not ShardedGrad]
            if unit.bucket is not None:
                notes.add(fname, f"your {fname} keeps unit.bucket (the full gradient) after its "
                          f"reduce_scatter finished: free it in handle.on_done, unit.bucket = "
                          f"None and p.grad = None for every p in unit.params")
            elif views:
                notes.add(fname, f"your {fname} set unit.bucket = None, but the p.grad of "
                          f"unit.params are views of the bucket and keep it alive until the end "
                          f"of backward (every block's full gradient at once: ZeRO-2's saving "
                          f"lost): also set p.grad = None for every p in unit.params, in "
                          f"handle.on_done")
        return _returned(returned, spy, notes, after)
    return {"reduce_scatter_bucket": reduce_scatter_bucket}


def _zero3(functions, notes):
    gather_fn, free_fn = functions["gather_params"], functions["free_params"]

    def gather_params(comm, unit):
        shard = unit.param_shard
        if not torch.is_tensor(shard) or not _holds_memory(shard):
            raise Mistake("free_params", "unit.param_shard, this rank's only copy of its "
                          "weights, is gone: free_params must free unit.param_flat's memory "
                          "(free_storage(unit.param_flat)), never the shard")
        want = _side_gather(shard, comm.world_size)
        spy = _Spy(comm, unit, "gather_params", _file(gather_fn), notes)
        returned = gather_fn(spy, unit)
        spy.flush()
        for h in [c.lazy for c in spy.calls]:           # (an async one: gathered by now)
            h.wait()
        got = unit.param_flat
        gathers = [c for c in spy.calls if c.op == "all_gather"]
        where = spy.where(gathers[0].line) if gathers else "gather_params"
        if not torch.is_tensor(got) or not _holds_memory(got):
            raise Mistake("gather_params", f"your gather_params left unit.param_flat without "
                          f"memory ({where}): alloc_storage(unit.param_flat), then all_gather "
                          f"unit.param_shard into it")
        if gathers and gathers[0].names["input"] != "unit.param_shard":
            name = gathers[0].names["input"]
            why = (" - its values were freed with the rest of unit.param_flat"
                   if "param_flat" in name else "")
            notes.add("gather_params", f"your gather_params all_gathers from {name} ({where})"
                      f"{why}: gather this rank's resident shard, unit.param_shard")
        elif not gathers:
            notes.add("gather_params", "your gather_params started no all_gather: "
                      "comm.all_gather(unit.param_flat, unit.param_shard, ...) brings every "
                      "rank's shard")
        elif not _close(got, want):
            notes.add("gather_params", f"after your gather_params ({where}) unit.param_flat is "
                      f"not every rank's shard in rank order ({_largest(got, want)})")
        return returned

    def free_params(unit):
        flat, shard = unit.param_flat, unit.param_shard
        kept = shard.detach().clone() if torch.is_tensor(shard) and _holds_memory(shard) else None
        returned = free_fn(unit)
        if unit.param_flat is not flat:
            raise Mistake("free_params", f"your free_params replaced unit.param_flat with "
                          f"{_name(unit.param_flat, unit) if unit.param_flat is not None else 'None'}"
                          f": the parameters are views of that tensor and gather_params refills "
                          f"it. Keep it; free only its memory, free_storage(unit.param_flat)")
        if (unit.param_shard is not shard or not _holds_memory(shard)
                or (kept is not None and not _same(shard.detach(), kept))):
            how = "freed" if unit.param_shard is not shard or not _holds_memory(shard) else "changed"
            raise Mistake("free_params", f"your free_params {how} unit.param_shard, this rank's "
                          f"only copy of its weights: free unit.param_flat's memory instead, "
                          f"free_storage(unit.param_flat)")
        if flat.untyped_storage().nbytes():
            notes.add("free_params", f"your free_params left the {flat.untyped_storage().nbytes():,}"
                      f" bytes of unit.param_flat allocated: free_storage(unit.param_flat) - "
                      f"the views stay, the bytes go")
        return returned
    return {"gather_params": gather_params, "free_params": free_params}


WRAPPERS = {"ddp": _ddp, "zero1": _zero1, "zero2": _zero2, "zero3": _zero3}


def instrument(name: str, functions: dict, notes: Notes) -> dict:
    """The learner's functions of exercise `name`, watched (see the module docstring); an
    exercise without a wrapper keeps them as they are."""
    make = WRAPPERS.get(name)
    return make(functions, notes) if make else functions
