"""ZeRO-3 inside a real training loop: what the loop may do besides forward, backward and step.

Idea: zero3.py is the notes' algorithm - gather a block before it runs, free it after,
reduce-scatter its gradient, update this rank's range. A PyTorch loop does more between those
calls: it reads or edits the weights (`strategy.gathered()`, DeepSpeed's GatheredParameters;
torch's `state_dict` inside it), writes and loads checkpoints, skips blocks or calls one again
(data-dependent control flow). Below ZeRO-3 each of these finds the full weights in place (the
frame, zerolab/strategy.py, does them); ZeRO-3 holds only shards, so each needs the weights
gathered on every rank, or the same collectives issued on every rank. These are ZeRO-3's
answers, a mixin of `ZeRO3` (`class ZeRO3(ZeRO3Loop, Strategy)`) kept out of the lesson's file:

    gathered()          the frame's (strategy.py) calls unshard / reshard / keep_edits: every
                        unit gathered and pinned, the loop's edits written into every shard
    full_parameters()   an fp32 copy of every weight, gathered
    checkpoints         shard_state / load_params: this rank's range of the weights
    skipped blocks      `_catch_up`: a block this rank's forward skipped is gathered and freed
                        anyway; a block called again or out of order is confirmed with every
                        rank first (zerolab/loop/order.py), so no collective pairs wrongly
"""
from __future__ import annotations

import warnings

import torch

from .loop.guards import check_edits, take_replaced
from .optim import adam_state
from .loop.order import confirm
from .sharding import keep_own_range


class ZeRO3Loop:
    """gathered(), checkpoints and skipped blocks for ZeRO-3 (zerolab/zero3.py): the methods the
    frame (zerolab/strategy.py) calls, over ZeRO3's units, `_gather`, `_free` and `pinned`."""

    def weights_readable(self) -> bool:     # state_dict(): only inside gathered()
        return self.pinned

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 copy} of every parameter, gathered (ledger phase "eval")."""
        with self.gathered():
            return super().full_parameters()

    def unshard(self):                      # gathered(): every unit, pinned until reshard()
        if self.pinned:
            raise RuntimeError("strategy.gathered() blocks do not nest")
        confirm(self.comm, "gathered()")    # on every rank, or refused: zerolab/loop/order.py
        with self.comm.phase("eval"):
            for u in self.units:
                self._gather(u)
        self.pinned = True

    def reshard(self):
        self.pinned = False
        for u in self.units:
            self._free(u)

    def keep_edits(self, modifier_rank, before):
        for u in self.units:                # `p.data = t` inside the block: t's values count
            take_replaced(u, u.param_flat)
        if modifier_rank is not None:       # rank r's weights into every rank's shards
            self.write_back(modifier_rank)
        elif check_edits(self.comm, self.units, before):   # the same edit on every rank
            keep_own_range(self, sharded=True)

    def _adopt_edits(self):                 # placeholders: edits go through gathered()
        pass

    # --- checkpoint: this rank's range out, logical (unpadded) state in -----------------------
    def shard_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {u.name: {"params": u.param_shard, **adam_state(self.optimizer, u.master)}
                for u in self.units}

    def load_params(self, u, full: torch.Tensor):
        u.param_shard.copy_(u.own(full))                        # [Ψ_u/N] own range

    # --- data-dependent control flow: the same all_gathers on every rank ----------------------
    def _catch_up(self, upto: int):
        """Before block `upto`'s forward (len(blocks): the end of forward): the blocks this rank's
        forward skipped since the last one are gathered and freed anyway; a block called again
        or out of order first confirms that every rank does the same (else one line, every
        rank)."""
        u = self.blocks[upto] if upto < len(self.blocks) else None
        late = self.__dict__.setdefault("late", LateBlocks())
        if (u is not None and upto < self.next_block
                and not (u.gathered or self.pinned or u.name in self.prefetched)):
            confirm(self.comm, f"all_gather params {u.name} (called again or out of order)",
                    u.name)
            late.called(u.name)
        for skipped in self.blocks[self.next_block:upto]:
            self._gather(skipped)
            self._free(skipped)
            late.skipped(skipped.name)
        self.next_block = max(self.next_block, upto)
        if u is None:
            late.end_of_forward(self.comm.records)


class LateBlocks:
    """ZeRO-3's blocks called out of their registration order, per forward: a block skipped at
    its turn is gathered (or prefetched) and freed anyway, so every rank issues the same
    all_gathers, and gathered again when it is called - gathers an on-demand gather (FSDP2's)
    would not issue. Said once per strategy, at the end of the first forward that has any: the
    blocks, and the extra all_gathers counted in the ledger (this forward's, beyond one per
    unit), with what makes them free."""

    def __init__(self):
        self.skipped_now, self.late, self.said = set(), [], False

    def skipped(self, name: str):
        self.skipped_now.add(name)

    def called(self, name: str):
        if name in self.skipped_now:
            self.late.append(name)

    def end_of_forward(self, records):
        if self.late and not self.said:
            self.said = True
            gathers = []
            for r in reversed(records):         # this forward: the ledger's forward tail
                if r.phase != "forward":
                    break
                if r.op == "all_gather" and r.what == "params":
                    gathers.append(r.unit)
            warnings.warn(late_line(self.late, len(gathers) - len(set(gathers))),
                          RuntimeWarning, stacklevel=4)
        self.skipped_now, self.late = set(), []


def late_line(names, extra: int) -> str:
    """One line: the blocks called after a block registered later, and the extra gathers."""
    return (f"ZeRO-3: blocks {', '.join(names)} ran after a block registered after them (the "
            f"registration order is the gather order): {extra} extra all_gather(s) in this "
            "forward, as each is gathered at its turn and again when called; register the "
            "blocks in the order forward calls them (a ModuleDict: insert its keys in that "
            "order), or make them one unit (zerolab.set_leaf_modules)")
