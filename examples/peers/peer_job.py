"""What every peer's script trains: examples/ddp/train_ddp.py's data, model and optimizer, with no
relaunch import (a peer's virtual environment has torch and the peer only)."""

from __future__ import annotations

import torch
from torch import nn


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Step s of rank (or replica) r depends on s and r only."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)
    return x, y


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
