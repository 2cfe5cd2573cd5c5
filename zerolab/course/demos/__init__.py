"""Small torchrun programs the notebooks launch to show one idea each (collectives, FSDP2, meshes;
byom: torch's wrapper names on a model of your own, for lab 7).

Each module has a `main()` and is run as `python -m torch.distributed.run --standalone
--nproc-per-node N -m zerolab.course.demos.<name> ...`; each rank writes its own JSON for the notebook
(rankfiles.write_rank_json: OUT/rank{r}.json, then one line from rank 0).
"""
