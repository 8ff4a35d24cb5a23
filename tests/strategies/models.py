"""A tiny transformer-shaped model and data shared by the strategy tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    """A residual MLP block: the unit FSDP2 shards."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyNet(nn.Module):
    """Input projection, a ModuleList of blocks, a regression head."""

    def __init__(self, dim: int = 16, num_blocks: int = 3, in_dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_blocks)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_data(num_steps: int, global_batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[steps, batch, 8]`` and learnable targets ``[steps, batch, 1]``, equal on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_steps, global_batch, 8, generator=g)
    teacher = torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ teacher)  # learnable: the loss falls over the steps
    return x, y
