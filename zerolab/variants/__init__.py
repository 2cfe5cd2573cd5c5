"""The stages' variants: each a subclass, a mixin or a wrapped Comm of a stage at the top, never
a branch inside the stage's file (no module of the lesson imports this folder).

    zero1rs     ZeRO-1 with a reduce_scatter of the gradients instead of the notes' all_reduce
    placement   where ZeRO-1/2 all_gather the updated weights: just before each block's next
                forward (FSDP's SHARD_GRAD_OP)
    prefetch    when ZeRO-3 gathers: how many blocks ahead, and whether the root waits
    offload     ZeRO-Offload: ZeRO-1/2's optimizer states and AdamW on the host, gradients down
                and updated weights up over PCIe (real on CUDA, emulated on a CPU)
    quant       ZeRO++'s quantized collectives (qwZ, qgZ), a wrapped Comm
    tiers       two tiers: a node's ranks and the ranks across nodes, their Comms, the
                hierarchical all_reduce, and the bytes per tier of ZeRO-3, HSDP and hpZ
    hybrid      ZeRO-3 by node: HSDP (FSDP's HYBRID_SHARD) and ZeRO++'s hpZ, on tiers
    loopstep    DDP and ZeRO-3 for a loop that steps its own torch optimizer (zerolab.torchlike)
    compose     `make_strategy(stage, model, comm, **options)`: a stage with the variants its
                options ask for; `make_muon(params, layout)`: a layout of ../wholematrix
"""
