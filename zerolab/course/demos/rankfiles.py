"""What every demo ends with: each rank's result in OUT/rank{r}.json, then one line from rank 0."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def write_rank_json(out, rank: int, result: dict) -> Path:
    """Collective: `result` (JSON-able) to out/rank{rank}.json, the folder made if missing; every
    rank waits for the others (dist.barrier), then rank 0 prints where. Returns the folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    if rank == 0:
        print(f"wrote {out.resolve()}/rank*.json", flush=True)
    return out
