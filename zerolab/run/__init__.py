"""Running a training job: from command-line options to every rank's JSON file.

The launcher's side (the `zerolab` command, a notebook's `nb.launch`):
    options     every option of a training run, defined once and checked once
    knobs       what the options that tune a stage mean to its strategy (buckets, prefetch,
                quantized and hybrid ZeRO-3, the state ladder, the emulated tiers)
    job         check everything, own the run folder, start the ranks
    launch      backend and device for this node, the torchrun command, a process tree with a
                timeout that leaves nothing behind
    preflight   checks of this machine: the data file, the rendezvous endpoint, memory for a step
    slurm       torchrun's rendezvous from a Slurm job's environment (`zerolab slurm ...`)
    folders     run folders: one manifest per run, a lock, atomic writes
    integrity   a sha256 per file written, checked before it is read back
    resources   running out of disk, memory, open files, processes, ports: one line each
The ranks' side (what torchrun starts):
    rank        how a rank program starts (process group) and ends (dies with its agent)
    train       `python -m zerolab.run.train`: every stage of the launch, one after another
    stage       one stage on one rank, phase by phase: build, train, finish
    result      the rank's JSON result, and the bytes table rank 0 prints
    checkpoint  sharded save / resume at any world size and stage
    ckptio      a checkpoint folder on disk: written by every rank, committed atomically
    consolidate offline: a checkpoint back into one plain GPT state dict
It imports the lesson and zerolab.timing (the link emulator, the traces), never zerolab.course.
"""
