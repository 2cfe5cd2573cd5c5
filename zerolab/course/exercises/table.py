"""The exercises' table: each exercise's name, letter, title, the package module and functions
the learner writes, the strategy and model its check trains, and its hints.

It is its own module so that the checker, the hints and the track (which read it) and the
package's door (`zerolab.course.exercises`, which re-exports it) import it without a circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SKELETONS = Path(__file__).parent / "skeletons"


@dataclass(frozen=True)
class Exercise:
    """One exercise: the package module whose functions the learner replaces, and the check."""
    name: str
    letter: str
    title: str
    module: str                 # e.g. "zerolab.ddp"
    functions: tuple[str, ...]  # the learner writes these, with these names
    stage: int                  # the strategy trained in the check
    model: str                  # zerolab.course.testing.make_model name
    hints: tuple[str, ...]      # the usual mistakes, shown when the check fails
    grader: str = ""            # (f)-(j): the module whose grade() checks it (checker.run_check)

    @property
    def skeleton(self) -> Path:
        return SKELETONS / f"{self.name}.py"


EXERCISES = {e.name: e for e in (
    Exercise("shard_range", "a", "shard ranges with padding", "zerolab.sharding", ("shard_range",),
             3, "odd", ("every rank's range has the same length ceil(numel / world_size), "
                        "also the last rank's (it reaches into the padding)",
                        "ranges are contiguous and in rank order: rank r starts where r-1 stops")),
    Exercise("ddp", "b", "DDP: bucketed all_reduce in a gradient hook", "zerolab.ddp",
             ("all_reduce_bucket",), 0, "nano",
             ("all_reduce sums: divide by world_size (in handle.on_done, after the sum arrived)",
              "all_reduce the bucket unit.grad_flat itself (in place), not a copy",
              "return the handle, so that backward can wait for it")),
    Exercise("zero1", "c", "ZeRO-1: update your own range, then all_gather", "zerolab.zero1",
             ("own_gradient", "publish_update"), 1, "nano",
             ("own_gradient: unit.own(unit.grad_flat), converted to fp32 (.float() makes a copy)",
              "publish_update: copy unit.master into unit.own(unit.param_flat) BEFORE the "
              "all_gather, and gather into unit.param_flat from unit.own(unit.param_flat)")),
    Exercise("zero2", "d", "ZeRO-2: reduce_scatter each bucket when ready, free it",
             "zerolab.zero2", ("reduce_scatter_bucket",), 2, "nano",
             ("reduce_scatter into a new chunk (torch.empty_like(unit.grad_shard)), then ADD "
              "chunk / world_size to unit.grad_shard: micro-steps accumulate",
              "free in handle.on_done: unit.bucket = None and p.grad = None for p in unit.params "
              "(the .grad views keep the bucket alive)")),
    Exercise("zero3", "e", "ZeRO-3: gather before, free after", "zerolab.zero3",
             ("gather_params", "free_params"), 3, "nano",
             ("gather_params: alloc_storage(unit.param_flat) first, then all_gather "
              "unit.param_shard into unit.param_flat",
              "free_params: free_storage(unit.param_flat): the views stay, the bytes go")),
)}

# (f)-(h): predict the layout and the knobs, graded against zerolab and a measured run (.more);
# (i)-(j), the optional track: a whole strategy class, graded on gloo ranks (.track)
EXERCISES.update((e.name, e) for e in (
    Exercise("groups", "f", "TP/DP and HSDP process groups of a device mesh",
             "zerolab.course.exercises.more", ("tp_dp_groups", "hsdp_groups"), -1, "",
             ("TP groups are tp_size neighbouring ranks (they talk in every layer: one node); a "
              "DP group takes the rank at the same position of every TP group",
              "HSDP is the same grid: a shard group is one node (ranks_per_node consecutive "
              "ranks), a replicate group the ranks at the same position on every node",
              "raise ValueError when the group size does not divide world_size",
              "rows = [list(range(s, s + size)) for s in range(0, world_size, size)]; "
              "columns = [list(range(c, world_size, size)) for c in range(size)]"),
             grader="zerolab.course.exercises.more"),
    Exercise("buckets_prefetch", "g", "predict DDP's buckets and ZeRO-3's gathered peak, measured",
             "zerolab.course.exercises.more", ("ddp_buckets", "zero3_gathered_peak"), -1, "",
             ("a bucket takes the next block while its gradients stay within the cap; a block "
              "larger than the cap gets a bucket of its own; None: one bucket per block",
              "the cap counts MiB: bucket_cap_mb * 2**20 bytes, // grad_bytes elements (>= 1)",
              "ZeRO-3 holds the root unit for the whole pass, the block that runs and `prefetch` "
              "blocks gathered ahead of it (-1: all of them; never more than n_blocks)",
              "peak = (root_numel + min(1 + prefetch, n_blocks) * block_numel) * param_bytes, "
              "n_blocks blocks for prefetch = -1"),
             grader="zerolab.course.exercises.more"),
    Exercise("timing", "h", "α-β time of a ring collective, measured on the emulated link",
             "zerolab.course.exercises.more", ("ring_time",), -1, "",
             ("a ring collective on n ranks: α per ring step, plus the bytes each rank sends / β",
              "steps: 2(n-1) for all_reduce, n-1 for the others; bytes per rank: 2(n-1)/n·S for "
              "all_reduce, (n-1)/n·S for reduce_scatter and all_gather, S for broadcast",
              "n = 1 moves nothing: 0.0 seconds",
              "steps * link.latency + theory.RING_FACTOR[op](n) * size_bytes / link.bandwidth"),
             grader="zerolab.course.exercises.more"),
    Exercise("strategy_ddp", "i", "track: a whole DDP, bucketed all_reduces overlapping backward",
             "zerolab.ddp", ("BucketedDDP",), 0, "nano",
             ("in __init__, register p.register_post_accumulate_grad_hook on every trainable "
              "parameter and count, per bucket, the gradients still to come",
              "when a bucket's last gradient arrives: flatten its grads into one buffer, start "
              "comm.all_reduce(buf, what='grads', async_op=True) and keep the handle: no wait",
              "finish(): wait for every handle, divide by comm.world_size, copy each slice back "
              "into p.grad, reset the counters for the next backward",
              "buckets: walk reversed(trainable params), open a new bucket when p would take it "
              "past bucket_cap_mb * 2**20 bytes"),
             grader="zerolab.course.exercises.track"),
    Exercise("strategy_zero1", "j", "track: a whole sharded optimizer (ZeRO-1)",
             "zerolab.zero1", ("ShardedAdamW",), 1, "nano",
             ("per group: the parameters flattened into one vector padded to a multiple of N; "
              "rank r owns [r·S, (r+1)·S) with S = padded / N",
              "keep a leaf tensor `shard` (a copy of your range) and a torch.optim.AdamW([shard], "
              "lr, betas, eps, weight_decay=the group's): its state is then 1/N",
              "step(): shard.grad = your range of the flat gradient; AdamW step; all_gather the "
              "shards into a new padded buffer; copy each parameter's slice back (no_grad)",
              "keep no full-size buffer in self between steps, and gather one flat buffer per "
              "group, not parameter by parameter (each collective pays (n-1)·α)"),
             grader="zerolab.course.exercises.track"),
))

# (k): the owner of each whole matrix (notebook 08b), graded without ranks (.owners)
OWNERS = "zerolab.course.exercises.owners"
EXERCISES["owner_assignment"] = Exercise(
    "owner_assignment", "k", "owners of whole matrices, greedy by size (ZeroRedundancyOptimizer)",
    OWNERS, ("assign_owners",), -1, "",
    ("largest first: sort the parameters by numel (the product of the whole shape, 1 for a 0-d "
     "one), descending; a stable sort keeps equal sizes in list order",
     "each parameter goes to the rank owning the fewest ELEMENTS so far (add its numel to that "
     "rank's load); on a tie the lowest rank: loads.index(min(loads))",
     "return owners in the order of `shapes`: owners[i] is parameter i's rank, whatever order "
     "you placed them in",
     "loads = [0] * world_size; for i in sorted(range(len(shapes)), key=lambda i: -numel[i]): "
     "r = loads.index(min(loads)); owners[i] = r; loads[r] += numel[i]"),
    grader=OWNERS)
RANK_FREE = ("zerolab.course.exercises.more", OWNERS)     # graded in the judge, no ranks
