"""What every peer's script trains: examples/ddp/train_ddp.py's data, model and optimizer, with no
relaunch import (a peer's virtual environment has torch and the peer only)."""

from __future__ import annotations

import os

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


class FaultSeries:
    """A series of faults from the command line, `STEP:KIND,...` (KIND crash or hang), for one
    rank: each strikes once, the first time that rank reaches its step or passes it (a replica
    that heals past a step strikes at the first step it tries), in whichever process runs the
    rank then. A file per fault beside the timeline says it struck, across restarts."""

    def __init__(self, spec: str | None, marks: str | None) -> None:
        self.faults: list[tuple[int, str]] = []
        for item in (spec or "").split(","):
            if item.strip():
                step, kind = item.split(":")
                if kind not in ("crash", "hang"):
                    raise ValueError(f"fault kind {kind!r}: crash or hang")
                self.faults.append((int(step), kind))
        self.marks = marks

    def due(self, step: int) -> str | None:
        """The fault that strikes at `step`, marked struck (None: none)."""
        for at, kind in self.faults:
            mark = f"{self.marks}.struck-{at}"
            if step >= at and not os.path.exists(mark):
                with open(mark, "w") as struck:
                    struck.write(kind)
                return kind
        return None
