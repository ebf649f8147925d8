"""A training loop written from docs/training-sdk.md alone that averages its gradients itself,
through the keeper's `all_reduce` (no DDP): with operator retry on, a collective that fails on
its transport is issued again (R-29). Rank 0 writes the final parameters' SHA-256 to OUT.

Usage: sdk_allreduce.py OUT [--steps N]"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
from torch import nn

from relaunch.train import env, report_progress
from relaunch.train.group import ProcessGroupKeeper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(1)
    job = env()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    keeper = ProcessGroupKeeper(model, optimizer)
    keeper.start()

    def train_step(step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step * 100 + keeper.rank)
        x = torch.randn(16, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        for parameter in model.parameters():  # the script's own collectives, one a tensor
            assert parameter.grad is not None
            keeper.all_reduce(parameter.grad)
            parameter.grad /= keeper.world_size
        return loss

    def after(step: int, loss: torch.Tensor) -> None:
        report_progress(step)
        time.sleep(0.02)

    keeper.run(1, args.steps, train_step, after)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    if job.rank == 0:
        args.out.write_text(digest.hexdigest() + "\n")
        print(f"done: {digest.hexdigest()} recoveries {keeper.recoveries}", flush=True)
    keeper.exit(0)


if __name__ == "__main__":
    main()
