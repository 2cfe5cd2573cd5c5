"""zerolab: hand-written DDP and ZeRO-1/2/3 that measure every byte they hold and move.

The package is laid out as the course is. The top level is the lesson: the four strategies and
the few modules they stand on, read in this order, each importing only those above it:

    theory      formulas: bytes per rank per stage, traffic per step, busbw factors
    model, data the GPT and the text
    comm        every collective, recorded in a per-rank ledger (and labelled in a profile)
    sharding    flat buffers, padding, owned ranges, buckets / blocks, gradient hooks
    optim       torch's AdamW on flat shards (decay groups, parameters without a gradient);
                which torch optimizers may step a piece of a weight, and why (OPTIMIZERS)
    memory      measured bytes by category, peaks, allocator cross-check
    strategy    the frame the four stages share: build, backward, step, what a loop may read
    ddp, zero1, zero2, zero3   the stages, the notes' algorithm each: who holds what (hold),
                the gradient hook, the update - `diff zero2.py zero3.py` is the lesson
    zero3loop   ZeRO-3 inside a real loop: gathered(), checkpoints, skipped blocks (a mixin of
                ZeRO3, so that zero3.py holds the algorithm)

Three folders hold the rest of the lesson, each with its map in its __init__:

    loop/         what a real training loop needs, below the stages (they import it; it imports
                  nothing else of zerolab): guards, hooks, order, leaves, replicas
    variants/     the stages' variants, above them (a subclass, a mixin or a wrapped Comm each;
                  no stage imports one): zero1rs, placement, prefetch, offload, quant, tiers,
                  hybrid, loopstep, and compose (`make_strategy`: a stage with its variants)
    wholematrix/  optimizers that read whole matrices (Muon, Adafactor, LAMB), which ZeRO's flat
                  ranges cannot step, in three layouts that make each matrix whole somewhere:
                  muon_theory, wholeopt, muon_owner, muon_a2a, muon_replicate, lamb, factored

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
run, then course; the cli imports them all); `import-linter` checks this on every test run (the
contracts in pyproject.toml).
`from zerolab import nb` is the notebooks' door to `zerolab.course.nb`, resolved on first use.
"""
from .variants.compose import make_muon, make_strategy
from .ddp import DDP
from .loop.leaves import set_leaf_modules
from .wholematrix.wholeopt import muon_param_groups
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
