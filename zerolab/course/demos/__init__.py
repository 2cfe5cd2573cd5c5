"""Small torchrun programs the notebooks launch to show one idea each (collectives, FSDP2, meshes).

Each module has a `main()` and is run as `python -m torch.distributed.run --standalone
--nproc-per-node N -m zerolab.course.demos.<name> ...`; each rank writes its own JSON for the notebook.
"""
