"""The rank runner of conftest.py fails loudly: a rank's exception and a hang both end the test
with every rank's traceback, and no rank outlives the call."""
from __future__ import annotations

import time

import pytest

from conftest import run_ranks


def raising_worker(rank, n):
    import torch.distributed as dist
    if rank == 1:
        raise RuntimeError(f"boom on rank {rank}")
    dist.barrier()                  # rank 0 waits for rank 1 forever


def sleeping_worker(rank, n):
    time.sleep(60 if rank == 0 else 0)
    return rank


def summing_worker(rank, n):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(60)
def test_results_come_back_by_rank():
    assert run_ranks(summing_worker, 3) == [3.0, 3.0, 3.0]


@pytest.mark.timeout(60)
def test_a_raising_rank_fails_the_test_with_its_traceback():
    with pytest.raises(pytest.fail.Exception) as err:
        run_ranks(raising_worker, 2)
    text = str(err.value)
    assert "RuntimeError: boom on rank 1" in text and "--- rank 0" in text


@pytest.mark.timeout(60)
def test_a_hanging_rank_is_killed_after_the_timeout_with_its_stack():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        run_ranks(sleeping_worker, 2, timeout=3)
    assert time.monotonic() - start < 15
    text = str(err.value)
    assert "timed out after 3 s" in text and "sleeping_worker" in text
