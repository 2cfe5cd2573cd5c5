# Exercise (e): ZeRO-3's gather-before / free-after hooks.
# Check: zerolab check zero3 --impl my_zero3.py
# A rank keeps only `unit.param_shard` [Ψ_u/N] of every block. The block's parameters are
# views of `unit.param_flat` [Ψ_u], whose storage exists only while gathered. zerolab's hooks call
#   gather_params(comm, unit)   before the block's forward, and again before its backward
#   free_params(unit)           after the block's forward, and after its backward
# Helpers (zerolab.sharding): alloc_storage(t) gives t back its memory (contents undefined);
# free_storage(t) releases it, keeping t and its views. `comm` is zerolab.comm.Comm:
#   comm.all_gather(output_full, input_chunk, what="params", unit=unit.name)   # blocking
from zerolab.sharding import alloc_storage, free_storage  # noqa: F401 - for your code


def gather_params(comm, unit):
    """Make unit.param_flat hold the full parameters: every rank's unit.param_shard, in order."""
    raise NotImplementedError("write gather_params: allocate unit.param_flat, then all_gather")


def free_params(unit):
    """Release the memory of the full parameters (keep only unit.param_shard)."""
    raise NotImplementedError("write free_params: free unit.param_flat's storage")
