# Wrong on purpose (tests/test_exercises_more.py): updates its own range, never all_gathers.
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
            full[r * size:(r + 1) * size] = shard.detach()
            offset = 0
            for p in params:
                lo, hi = max(offset, r * size), min(offset + p.numel(), (r + 1) * size)
                if lo < hi:
                    p.view(-1)[lo - offset:hi - offset] = full[lo:hi]
                offset += p.numel()
