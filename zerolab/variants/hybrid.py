"""Hybrid sharding: ZeRO-3 on nodes whose inside links are 10-50x faster than the links between.

Idea: flat ZeRO-3 (zero3.py) runs every all_gather and reduce_scatter on rings through all N
ranks; on a cluster each of those rings crosses nodes (NCCL runs one ring per NIC: 1/k of a rank's
ring bytes go over its NIC, the rest inside the node) and pays N-1 latency steps. Two ways keep
ZeRO-3's per-block traffic inside a node of k ranks (m = N/k nodes; `zerolab.variants.tiers`):

- HSDP (FSDP's HYBRID_SHARD; FSDP2's `fully_shard(mesh=(replicate, shard))`): ZeRO-3 inside each
  node - every state sharded over the node's k ranks only, 16Ψ/k bytes a rank - and plain data
  parallelism across nodes: each block's gradient is reduce_scattered inside the node, then its
  1/k shard is all-reduced across the m nodes (one rank per node; the k shards cross in
  parallel). A NIC carries 2(m-1)/m·2Ψ/k bytes a step (flat ZeRO-3: 3(N-1)/N·2Ψ/k, 1.7 times
  more at N = 64, k = 8); every gather stays inside, on rings of k ranks.
- hpZ (ZeRO++'s hierarchical partitioning; FSDP2's `reshard_after_forward=k`): the states stay
  sharded over all N ranks (16Ψ/N), and the forward's all_gather still crosses nodes; but after a
  block's forward each rank keeps a secondary shard, its 1/k of the full weights among its node's
  k ranks (2Ψ/k bytes in all from forward into backward), and the block's backward all_gather runs
  inside the node from those. One of ZeRO-3's three crossings a step moves inside. With ZeRO++'s
  quantized collectives (zerolab.variants.quant: qwZ's int8 forward gather, qgZ's int4 gradients in two
  hops, one all_to_all a tier) it is ZeRO++ as the paper builds it: `tiers.zeropp_traffic_bytes`.

Skeleton: both are ZeRO3 with its hooks overridden - `diff` shows nothing else changes: who is
in the shard group (HSDP's __init__), what one more collective does to a reduced shard (HSDP's
_reduced), where a gather reads from (hpZ's _start_gather, _free). Per-rank bytes by tier:
`tiers.hybrid_traffic_bytes`, `tiers.hybrid_state_bytes`; tests/test_hybrid.py holds the ledger
to them and both strategies to single-process torch AdamW.

    python -m zerolab train --stage 3 --nproc 4 --hybrid hsdp --ranks-per-node 2 \\
        --intra 1@20 --inter 0.1@200

Not supported (refused in one line): HSDP with find_unused_parameters or quantized collectives,
sharded checkpoints of HSDP (its shards are a node's, not the world's);
torchlike.fully_shard's reshard_after_forward=int.
"""
from __future__ import annotations

import contextlib

import torch

from ..loop.guards import (check_edits, check_untouched, fingerprint, sync_module_states,
                     take_replaced)
from ..sharding import alloc_storage, storage_bytes
from .tiers import node_comms
from ..zero3 import ZeRO3

HYBRIDS = ("hsdp", "hpz")


class HSDP(ZeRO3):
    """ZeRO-3 over each node's `ranks_per_node` ranks, replicated across nodes (HYBRID_SHARD).

    comm: the world's Comm (its ledger records every collective, tagged "intra" / "inter").
    Every other keyword is ZeRO3's. ValueError (one line) unless ranks_per_node divides the
    world size, or with find_unused_parameters=True."""

    name = "HSDP"

    def __init__(self, model, comm, *, ranks_per_node: int, **kwargs):
        if kwargs.get("find_unused_parameters"):
            raise ValueError("HSDP does not take find_unused_parameters=True: a parameter unused "
                             "on one node only would leave the node replicas different")
        self.world, self.hybrid = comm, ("hsdp", ranks_per_node)
        self.intra, self.inter = node_comms(ranks_per_node, comm)
        sync_module_states(model, comm)             # one set of weights for every node
        super().__init__(model, self.intra, **kwargs)

    def _reduced(self, u, out):
        # out: the node's sum of this rank's shard; across nodes in flight, averaged over N
        handle = self.inter.all_reduce(out, what="grads", unit=u.name, async_op=True)
        handle.on_done = lambda: u.grad_shard.add_(out.div_(self.world.world_size))
        self.inflight.append(handle)

    @contextlib.contextmanager
    def gathered(self, modifier_rank=None):
        """ZeRO3.gathered, with modifier_rank a rank of the world: its weights reach every node.
        Without it, edits must be the same on every rank of every node (RuntimeError otherwise:
        ZeRO-3's check covers a node only, and nodes that kept different edits would diverge)."""
        with super().gathered() as out:
            yield out
            if modifier_rank is None:
                check_edits(self.world, self.units, fingerprint(self.units))
            else:
                with self.world.phase("eval"):
                    for u in self.units:
                        take_replaced(u, u.param_flat)
                        self.world.broadcast(u.param_flat, modifier_rank, what="params",
                                             unit=u.name)

    def shard_state(self):
        raise ValueError("HSDP's shards are a node's, not the world's: sharded checkpoints of "
                         "--hybrid hsdp are not supported (save with --save-params)")

    load_state = shard_state


class HpZ(ZeRO3):
    """ZeRO-3 whose backward all_gathers run inside a node, from secondary shards of the weights
    kept after each block's forward (ZeRO++'s hpZ; FSDP2's reshard_after_forward=k).

    comm: the world's Comm; ranks_per_node: k, the ranks of a secondary group. Every other
    keyword is ZeRO3's. ValueError (one line) unless k divides the world size."""

    name = "hpZ"

    def __init__(self, model, comm, *, ranks_per_node: int, **kwargs):
        self.hybrid = ("hpz", ranks_per_node)
        self.intra, self.inter = node_comms(ranks_per_node, comm)
        if hasattr(comm, "by_node"):    # quantized (ZeRO++ qwZ / qgZ): qgZ in two hops, by tier
            comm.by_node(self.intra, self.inter)
        super().__init__(model, comm, **kwargs)
        self.k = ranks_per_node
        for u in self.units:
            u.secondary = None

    def _free(self, u):
        # after a forward that backward will follow: keep this rank's 1/k among its node
        if (u.gathered and not self.pinned and torch.is_grad_enabled()
                and self.comm.current_phase == "forward"):
            chunk = u.param_flat.numel() // self.k                    # [Ψ_u/k] bf16
            u.secondary = u.param_flat.narrow(0, self.intra.rank * chunk, chunk).clone()
        super()._free(u)

    def _start_gather(self, u, async_op=False):
        if self.comm.current_phase != "backward" or u.secondary is None:
            return super()._start_gather(u, async_op)
        check_untouched(u)
        alloc_storage(u.param_flat)                 # inside the node, from the secondary shards
        handle = self.intra.all_gather(u.param_flat, u.secondary, what="params", unit=u.name,
                                       async_op=True)
        handle.on_done = lambda: setattr(u, "secondary", None)     # consumed
        if not async_op:
            handle.wait()
        return handle

    def end_backward(self):
        super().end_backward()
        self._drop_secondaries()

    def step(self) -> torch.Tensor:
        self._drop_secondaries()                    # the weights change: they would be stale
        return super().step()

    def _drop_secondaries(self):
        for u in self.units:
            u.secondary = None

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = super().state_tensors()
        out["gathered_params"] = out["gathered_params"] + [u.secondary for u in self.units]
        return out

    def secondary_bytes(self) -> int:
        """Bytes of the secondary shards held now (2Ψ/k after a forward, 0 after backward)."""
        return storage_bytes([u.secondary for u in self.units])


def make_hybrid(kind: str, model, comm, *, ranks_per_node: int, **kwargs) -> ZeRO3:
    """HSDP ("hsdp") or HpZ ("hpz") around `model`; ValueError (one line) for another kind."""
    if kind not in HYBRIDS:
        raise ValueError(f"hybrid {kind!r} is not one of {', '.join(HYBRIDS)}")
    return (HSDP if kind == "hsdp" else HpZ)(model, comm, ranks_per_node=ranks_per_node, **kwargs)
