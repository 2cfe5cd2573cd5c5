# A reference solution of track (j) (tests/test_exercises_more.py): per group one flat vector
# padded to a multiple of N, this rank's range stepped by torch's AdamW, one all_gather a group.
import torch


class ShardedAdamW:
    def __init__(self, param_groups, comm, lr: float, betas: tuple, eps: float):
        self.comm, self.groups = comm, []
        n, r = comm.world_size, comm.rank
        for g in param_groups:
            params = list(g["params"])
            numel = sum(p.numel() for p in params)
            size = -(-numel // n)
            flat = torch.zeros(size * n)
            flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
            shard = flat[r * size:(r + 1) * size].clone().requires_grad_()
            adam = torch.optim.AdamW([shard], lr=lr, betas=betas, eps=eps,
                                     weight_decay=g["weight_decay"])
            self.groups.append((params, numel, size, shard, adam))

    @torch.no_grad()
    def step(self):
        n, r = self.comm.world_size, self.comm.rank
        for params, numel, size, shard, adam in self.groups:
            grad = torch.zeros(size * n)
            grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
            shard.grad = grad[r * size:(r + 1) * size].clone()
            adam.step()
            shard.grad = None
            full = torch.empty(size * n)
            self.comm.all_gather(full, shard.detach(), what="params")
            offset = 0
            for p in params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
