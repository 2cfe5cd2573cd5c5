# Exercise (g): predict two knobs, then the check measures them.
# Check: zerolab check buckets_prefetch --impl my_buckets_prefetch.py
# 1. bucket size. zerolab's DDP(bucket_mb=cap) merges consecutive blocks (forward order; torch's
#    DDP buckets in reverse registration order, its first bucket 1 MiB) into one gradient
#    bucket, one all_reduce each, while the bucket's gradients fit in the cap; torch DDP's
#    bucket_cap_mb counts MiB (2**20 bytes). A block larger than the cap gets a bucket of its own;
#    cap None: one bucket per block. (The root unit - embeddings, final LayerNorm - is never
#    merged; it is not in block_numels.)
# 2. prefetch depth. ZeRO-3 gathers a block's full weights just before it runs and frees them
#    right after; prefetch=p also issues the all_gathers of the next p blocks early (-1: of all of
#    them), to overlap them with compute. The root unit stays gathered for the whole pass.
#    The check measures the peak bytes of gathered weights with zerolab's memory meter.


def ddp_buckets(block_numels: list, bucket_cap_mb, grad_bytes: int) -> list:
    """The buckets DDP forms: lists of block indices (into block_numels, elements per block in
    forward order), in forward order. bucket_cap_mb: float (MiB) or None. grad_bytes: bytes per
    gradient element (4 fp32, 2 bf16). E.g. ([100, 100, 300], 800 / 2**20, 4) -> [[0, 1], [2]]."""
    raise NotImplementedError("write ddp_buckets: group the blocks")


def zero3_gathered_peak(root_numel: int, block_numel: int, n_blocks: int, prefetch: int,
                        param_bytes: int) -> int:
    """Peak bytes of gathered (full) weights in one ZeRO-3 forward + backward: root_numel and
    block_numel are padded elements of the root unit and of each of the n_blocks equal blocks;
    prefetch: depth >= 0, or -1 for all; param_bytes: bytes per weight (4 fp32, 2 bf16)."""
    raise NotImplementedError("write zero3_gathered_peak: what is gathered at the worst moment?")
