"""zerolab: hand-written DDP and ZeRO-1/2/3 that measure every byte they hold and move.

Layers (each imports only from those above it):
    theory     formulas: bytes per rank per stage, traffic per step, busbw factors
    costmodel  time: α-β collectives, FLOPs, a step replayed per stage (linkemu: emulated link)
    comm       every collective, recorded in a per-rank ledger
    sharding   flat buffers, padding, owned ranges, buckets / blocks
    ddp, zero1, zero2, zero3   the strategies (forward / backward / step)
    memory     measured bytes by category, allocator cross-check
    model, data  the GPT and the text
    train      torchrun entry point: config -> run -> stage{S}/rank{r}.json
    checkpoint sharded save, resume at any world size / stage, offline consolidate
    launch, cli  zerolab memory | time | whatif | train | compare | bench | labs | checkpoint
"""
from .ddp import DDP
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3

__version__ = "0.1.0"
STRATEGIES = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
