"""Two models that are not the course's GPT, for `zerolab fit --model` and its check.

Each builder returns an nn.Module with forward(x, y) -> the scalar loss and
example_inputs(rows) -> (x, y) of `rows` rows on the current default device (the meta device
when `zerolab fit` builds it), which is all `zerolab fit --model` asks of a model.

    zerolab fit --model zerolab.course.fitmodels:convnet --stage 3 --world-size 4
    zerolab fit --model zerolab.course.fitmodels:tied_frozen --stages 0,1,2,3

- `convnet`: a small image classifier, 3 x 32 x 32 inputs (CIFAR-10's shape), 10 classes;
  three conv blocks (convolution, batch norm, ReLU), then a linear head. Its activations are
  feature maps, not tokens; batch norm adds buffers that no optimizer touches.
- `tied_frozen`: a byte-level language model whose output head shares the embedding's weight
  (tied: one parameter, two uses) and whose first layer is frozen (requires_grad=False: no
  gradient, no optimizer state, held whole on every rank at every stage).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvNet(nn.Module):
    """x [B, 3, 32, 32] float, y [B] int64 class -> mean cross-entropy (fp32 scalar)."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        chans = (3, width, 2 * width, 4 * width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, stride=2, padding=1), nn.BatchNorm2d(b), nn.ReLU())
            for a, b in zip(chans, chans[1:]))
        self.head = nn.Linear(chans[-1] * 4 * 4, classes)

    def zero_units(self):
        """Each conv block is a unit (ZeRO-2 buckets, ZeRO-3 gathers it); the head is the root."""
        return [(f"block.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x, y):
        x = x.to(self.head.weight.dtype)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x.flatten(1)).float(), y)

    def example_inputs(self, rows: int):
        return torch.zeros(rows, 3, 32, 32), torch.zeros(rows, dtype=torch.long)


class TiedFrozen(nn.Module):
    """x [B, T] int64 bytes, y [B, T] -> mean cross-entropy; the head is the embedding's weight,
    the first of the MLP layers is frozen."""

    def __init__(self, vocab: int = 256, width: int = 96, layers: int = 3, seq: int = 48):
        super().__init__()
        self.seq = seq
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width),
                                                  nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight                  # tied
        for p in self.layers[0].parameters():                 # frozen
            p.requires_grad_(False)

    def zero_units(self):
        return [(f"layer.{i}", m) for i, m in enumerate(self.layers) if i > 0]

    def forward(self, x, y):
        h = self.embed(x)
        for m in self.layers:
            h = h + m(h)
        logits = self.head(h)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def example_inputs(self, rows: int):
        return (torch.zeros(rows, self.seq, dtype=torch.long),
                torch.zeros(rows, self.seq, dtype=torch.long))


def convnet() -> nn.Module:
    """The ConvNet, seeded (zerolab fit builds it on the meta device)."""
    torch.manual_seed(0)
    return ConvNet()


def tied_frozen() -> nn.Module:
    """The TiedFrozen language model, seeded."""
    torch.manual_seed(0)
    return TiedFrozen()
