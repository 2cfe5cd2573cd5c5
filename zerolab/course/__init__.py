"""The course's tools around the lesson: what the notebooks, the labs and the checker use.

    results     reading runs back: a run folder's rank JSONs, one step's records, saved params
    checks      measured against the formula: rows, assertions and text tables
    wrappers    lab 7: torch's wrapper names on your own model, measured against the formulas
    plots       the figures of bytes, and the course's colours; timeplots: the figures of time
    labs        each lab's parameters, and `zerolab labs` (papermill, report.md)
    nb          notebook helpers: show the package's code, launch ranks (`from zerolab import nb`)
    reference   committed CPU results of every lab (reference_runs/), for a launch that failed
    doctor      `zerolab doctor`: is this machine ready for the course?
    demos/      small torchrun programs the notebooks and lab 7 launch (collectives, FSDP2,
                tp x dp, your own model, ...)
    bench       zerolab's stages against torch's DDP / ZeroRedundancyOptimizer / FSDP2 in time;
                metercost: what the memory meter costs
    exercises/  the coding exercises, `zerolab check`, the numeric questions
    testing     what the tests and the checker share: toy models, the torch reference, ranks
    papers      `zerolab papers`: each published number the course can check, next to zerolab's
                prediction and this laptop's measurement, with a computed verdict; papermeasure
                takes the measurements (one step on a fake process group, two timings),
                papertable writes the table as text, markdown (site/papers.md) or JSON
It imports the lesson and the wings zerolab.run, zerolab.timing and zerolab.torchlike.
"""
