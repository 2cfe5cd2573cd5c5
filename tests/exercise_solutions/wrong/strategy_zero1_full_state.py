# Wrong on purpose (tests/test_exercises_more.py): every rank keeps AdamW's state for ALL the
# parameters (a full copy stepped on every rank: DDP's optimizer), then all_gathers its range.
import torch


class ShardedAdamW:
    def __init__(self, param_groups, comm, lr: float, betas: tuple, eps: float):
        self.comm, self.groups = comm, []
        n = comm.world_size
        for g in param_groups:
            params = list(g["params"])
            numel = sum(p.numel() for p in params)
            size = -(-numel // n)
            flat = torch.zeros(size * n)
            flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
            flat.requires_grad_()
            adam = torch.optim.AdamW([flat], lr=lr, betas=betas, eps=eps,
                                     weight_decay=g["weight_decay"])
            self.groups.append((params, numel, size, flat, adam))

    @torch.no_grad()
    def step(self):
        n, r = self.comm.world_size, self.comm.rank
        for params, numel, size, flat, adam in self.groups:
            grad = torch.zeros(size * n)
            grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
            flat.grad = grad
            adam.step()
            flat.grad = None
            full = torch.empty(size * n)
            self.comm.all_gather(full, flat[r * size:(r + 1) * size].detach().clone(),
                                 what="params")
            offset = 0
            for p in params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
