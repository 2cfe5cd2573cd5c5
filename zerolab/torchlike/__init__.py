"""torch's own interfaces over zerolab's strategies: bring your own model, loop and optimizer.

A learner who has read the notebooks writes training code the way PyTorch users do - a module
wrapped once, `loss.backward()`, any torch optimizer over the parameters, `zero_grad()`,
`step()`. These wrappers give that code zerolab's hand-written stages underneath (the same
`zerolab.ddp`, `zerolab.zero1`, `zerolab.zero3` mechanics, not a second copy), with every
collective in the ledger `wrapper.comm.records` and every byte countable (`held_bytes`):

    torch                                              zerolab.torchlike            stage
    torch.nn.parallel.DistributedDataParallel          DistributedDataParallel      DDP (0)
    torch.distributed.optim.ZeroRedundancyOptimizer    ZeroRedundancyOptimizer      ZeRO-1
    torch.distributed.fsdp.fully_shard (FSDP2)         fully_shard                  ZeRO-3
    FSDP2 reshard_after_forward=False                  fully_shard(..., False)      ZeRO-2's
                                                                                    weights
    torch.distributed.fsdp.MixedPrecisionPolicy         MixedPrecisionPolicy
    torch.optim.Adafactor (on FSDP2's shards)          Adafactor                    (exact)

DeepSpeed's names for the same: `zero_optimization.stage` 1 / 2 / 3, `reduce_bucket_size`
(bucket_cap_mb), `stage3_prefetch_bucket_size` (prefetch), `GatheredParameters`
(`strategy.gathered`). notebooks/08_fsdp.ipynb maps them one by one.

FSDP2's `fully_shard([m1, m2])`, `set_modules_to_forward_prefetch`,
`set_modules_to_backward_prefetch`, `register_fsdp_forward_method` and `model.to(dtype)` after
sharding; ZeroRedundancyOptimizer's `consolidate_state_dict(to)`. One ledger per model, every
collective in it with the phase it ran in (tests/test_torchlike_ledger.py counts them where
torch issues them).

Where they differ from torch, on purpose (each in its class's docstring): ZeroRedundancyOptimizer
splits the flat elements of each parameter group N ways (ZeRO's layout) where torch gives whole
parameters to ranks, so it runs only optimizers whose update is element-wise and refuses the
others in one line (`zerolab.optim.check_elementwise`), and its state_dict() without a
consolidation is this rank's own (torch's raises); fully_shard keeps frozen parameters
replicated (FSDP2 shards them too), and frees the root's weights after a forward without grad
(FSDP2 keeps them to the next backward). The loop's optimizer over fully_shard's shards must be
element-wise (`zerolab.optim.OPTIMIZERS`): another (Adafactor, Muon, LBFGS, a class zerolab
cannot vouch for) is refused in one line at its first step on every rank (`optimizers.py`: the
shards are plain tensors, so torch's class would compute over each rank's rows alone);
`Adafactor` here is torch's Adafactor on the dim-0 shards, exact, with two small all_reduces a
step (`zerolab.wholematrix.factored`).
"""
from .ddp import DistributedDataParallel
from .fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from .held import held_bytes
from .optimizers import Adafactor
from .zero_optimizer import ZeroRedundancyOptimizer

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "fully_shard",
           "MixedPrecisionPolicy", "FSDPModule", "register_fsdp_forward_method", "held_bytes",
           "Adafactor"]
