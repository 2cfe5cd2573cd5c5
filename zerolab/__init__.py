"""zerolab: hand-written DDP and ZeRO-1/2/3 that measure every byte they hold and move.

The package is laid out as the course is. The top level is the lesson: the four strategies and
the few modules they stand on, read in this order, each importing only those above it:

    theory      formulas: bytes per rank per stage, traffic per step, busbw factors
    model, data the GPT and the text
    guards      what the training loop may do to weights and gradients: rank 0's init, the
                loop's zero_grad and edits taken in, placeholders that refuse sharded values
    hooks       when gradients are ready and when a block's backward begins and ends
    order       collectives issued in a different order on the ranks: found, stopped in one line
    leaves      leaf modules (a mixture of experts' layer): blocks gathered as one unit
    comm        every collective, recorded in a per-rank ledger (and labelled in a profile)
    tiers       two tiers: a node's ranks and the ranks across nodes (their Comms, one ledger),
                the hierarchical all_reduce, and the bytes per tier of ZeRO-3, HSDP and hpZ
    sharding    flat buffers, padding, owned ranges, buckets / blocks, gradient hooks
    optim       torch's AdamW on flat shards (decay groups, parameters without a gradient);
                which torch optimizers may step a piece of a weight, and why (OPTIMIZERS)
    factored    torch's Adafactor on dim-0 row shards: its row/column sums and norms
                all-reduced, the cheap case of an optimizer that is not element-wise
    memory      measured bytes by category, peaks, allocator cross-check
    strategy    the frame the four stages share: build, backward, step, what a loop may read
    ddp, zero1, zero2, zero3   the stages, the notes' algorithm each: who holds what (hold),
                the gradient hook, the update - `diff zero2.py zero3.py` is the lesson
    zero3loop   ZeRO-3 inside a real loop: gathered(), checkpoints, skipped blocks (a mixin of
                ZeRO3, so that zero3.py holds the algorithm)

and the variants of the stages, each in a module beside them, a subclass, a mixin or a wrapped
Comm (none of them is imported by a stage's file):

    zero1rs     ZeRO-1 with a reduce_scatter of the gradients (llm.c's)
    placement   ZeRO-1/2's all_gather just before each block's next forward (SHARD_GRAD_OP)
    offload     ZeRO-Offload: ZeRO-1/2's optimizer states and AdamW on the host, gradients down
                and updated weights up over PCIe (real on CUDA, emulated on a CPU)
    prefetch    ZeRO-3's prefetch depth and the root kept from forward into backward
    quant       ZeRO++'s quantized collectives: qwZ's int8 weight all_gather, qgZ's int8/int4
                gradient all_to_all (block-wise scales), a wrapped Comm
    hybrid      ZeRO-3 by node: HSDP (FSDP's HYBRID_SHARD) and ZeRO++'s hpZ
    loopstep    DDP and ZeRO-3 for a loop that steps its own torch optimizer (torchlike's)
    compose     `make_strategy(stage, model, comm, **options)`: a stage with its variants

and, beside them, optimizers that read whole matrices (Muon, Adafactor, LAMB), which ZeRO's flat
ranges cannot step, in three layouts that make each matrix whole somewhere:

    muon_theory owners (greedy by size), bytes, Newton-Schulz FLOPs and held bytes per layout
    lamb        LAMB written from its paper (You et al. 2020, Algorithm 2), a torch optimizer
    replicas    every rank holds the same weights, checked (one all_reduce of a hash) where an
                optimizer assumes it (the layouts, torchlike's ZeRO optimizer and Adafactor)
    wholeopt    the layouts' frame: the AdamW fallback split, reduce / route / update / route_back
    muon_owner  whole parameters owned by ranks (torch's ZeroRedundancyOptimizer's partition)
    muon_a2a    dim-0 shards sent to each matrix's owner and back with all_to_all (torchtitan)
    muon_replicate  every gradient gathered, every rank steps every matrix

Everything else lives in four wings, sub-folders the lesson never imports, and one door:

    torchlike/  torch's interfaces over the same strategies, for a learner's own model and loop:
                DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard (FSDP2)
    timing/     the time side: cost model, link and device profiles, link emulator, traces,
                one rank of a large world (whatif)
    run/        running a training job: every option once (options), the launcher's side
                (job, launch), the ranks' side (rank, train, stage, result), run folders,
                preflight checks, sharded checkpoints
    course/     the course's tools: reading runs back, measured-vs-formula checks, plots, the
                labs and their runner, notebook helpers (nb), reference runs, doctor, demos,
                bench, exercises
    cli/        the `zerolab` command (`python -m zerolab`)

Each wing imports only the lesson and the wings listed before it (timing and torchlike, then
run, then course;
the cli imports them all); `import-linter` checks this on every test run (the contracts in
pyproject.toml).
`from zerolab import nb` is the notebooks' door to `zerolab.course.nb`, resolved on first use.
"""
from .compose import make_muon, make_strategy
from .ddp import DDP
from .leaves import set_leaf_modules
from .wholeopt import muon_param_groups
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3

__version__ = "0.1.0"
STRATEGIES = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}      # the lesson's classes, by stage

# names a learner imports from the package itself that live in a wing, resolved on first use so
# that `import zerolab` loads the lesson only
_DOORS = {"nb": "zerolab.course.nb"}


def __getattr__(name):
    if name in _DOORS:
        import importlib
        return importlib.import_module(_DOORS[name])
    raise AttributeError(f"module 'zerolab' has no attribute {name!r}")
