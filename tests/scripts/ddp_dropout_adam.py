"""A DDP training script written from docs/training-sdk.md alone, not from relaunch's example:
an MLP with dropout, trained with Adam, drawing from torch's, NumPy's and Python's random
streams in every step. Run under relaunch through a crash, a healing chip fault, a lost node and
a hang, it must end with the parameters of its fault-free run, bit for bit.

Usage: ddp_dropout_adam.py --steps N --ckpt-every K --out HASHFILE [--save sync|async|overlap]
(K = 0: dying gasps only; async: `async_save=True`, overlap: and `overlap_copy=True`)
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relaunch.train import CheckpointManager, report_progress
from relaunch.train.distributed import (
    load_common_checkpoint,
    parameter_hash,
    rng_state,
    set_rng_state,
    settle_ddp_buckets,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--save", choices=("sync", "async", "overlap"), default="sync")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(32, 1),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ddp = DistributedDataParallel(model)

    shared = os.environ.get("RELAUNCH_SHARED_DIR", ".")
    ckpt = CheckpointManager(
        shared + "/ckpt",
        every=args.ckpt_every or None,
        keep=3,
        async_save=args.save != "sync",
        overlap_copy=args.save == "overlap",
    )

    def state() -> dict[str, object]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(),
        }

    start = 0
    resumed = load_common_checkpoint(ckpt, replicated=True)
    if resumed is not None:
        model.load_state_dict(resumed.state["model"])
        optimizer.load_state_dict(resumed.state["optimizer"])
        set_rng_state(resumed.state["rng"])
        start = resumed.step
    ckpt.completed_step = start
    settle_ddp_buckets(ddp, torch.zeros(4, 8))
    ckpt.dying_gasp(state)
    print(f"start: rank {rank} resume_step={start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        with ckpt.step(step):
            data = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(16, 8, generator=data)
            x = x + 0.05 * float(np.random.standard_normal()) + 0.05 * random.random()
            y = torch.sin(x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
        report_progress(step)
        ckpt.maybe_save(step, state)
        time.sleep(args.step_seconds)

    ckpt.wait()
    digest = parameter_hash(model)
    if rank == 0:
        Path(args.out).write_text(digest + "\n")
        print(f"done: params sha256 {digest}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
