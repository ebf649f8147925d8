"""A PyTorch Lightning DDP script as Lightning's docs write one, with nothing of relaunch in it:
run it with `torchrun` or with `relaunch run` alike. It resumes from its own last checkpoint
(`ckpt_path="last"`), so a restart carries on where the last checkpoint left it.

    relaunch run --nnodes 2 --nproc-per-node 1 examples/frameworks/lightning_ddp.py \\
        --num-nodes 2 --devices 1 --max-steps 300
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Progress(Callback):
    """A line at the start (how it was launched, where it resumed) and every 10 steps."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        environment = type(trainer.strategy.cluster_environment).__name__
        print(
            f"start: rank {trainer.global_rank}/{trainer.world_size} "
            f"global_step={trainer.global_step} environment={environment} "
            f"torchelastic={torch.distributed.is_torchelastic_launched()}",
            flush=True,
        )

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step % 10 == 0:
            print(f"step {trainer.global_step}", flush=True)


class Pace(Callback):
    """Each step takes at least `seconds`: a stand-in for a real model's step, so that seconds
    of training are steps of training on any machine."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.began = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self.began = time.monotonic()

    def on_train_batch_end(self, *args: object) -> None:
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self.began)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--every-n-steps", type=int, default=20)
    parser.add_argument("--root", default="lightning-run")
    parser.add_argument("--min-step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    L.seed_everything(0)
    data = TensorDataset(torch.randn(8192, 32), torch.randn(8192, 1))
    checkpoints = ModelCheckpoint(
        dirpath=f"{args.root}/checkpoints", every_n_train_steps=args.every_n_steps, save_last=True
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp",
        max_steps=args.max_steps,
        default_root_dir=args.root,
        callbacks=[checkpoints, Progress(), Pace(args.min_step_seconds)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = Regression(args.width)
    trainer.fit(model, DataLoader(data, batch_size=64, shuffle=True), ckpt_path="last")
    print(f"done: rank {trainer.global_rank} global_step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
