"""An FSDP2 job (torch's `fully_shard`, gloo on CPU) whose sharded state relaunch checkpoints
with torch.distributed.checkpoint: every rank holds and saves only its shard of the parameters
and of Adam's moments. Stopped and restarted anywhere, it ends with the model of its fault-free
run, bit for bit:

- the data of step s depends only on s (one global batch, split among the ranks), and dropout's
  stream is seeded from (step, rank), so a resumed step draws what the first run drew;
- model and optimizer state dicts (DTensors), and the step, are saved every `--ckpt-every` steps
  by the SDK's ShardedCheckpointManager (atomic, verified, fallback, async with `--async-save`)
  and once more on SIGTERM (dying gasp); every rank resumes from the newest verified step;
- rank 0 prints and writes (`--out`) the SHA-256 of the full parameters at the end.

A checkpoint saved by N ranks loads on M (DCP reshards): `--steps` equal to the saved step runs
no step and prints the loaded parameters' hash.

`--process-recovery`: relaunch's SDK keeps the process group (ShardedGroupKeeper). A rank that
fails is replaced while the others keep their processes; every rank then builds the model anew
on the re-formed group and loads the newest checkpoint (the replaced rank's shard from a peer's
memory with `peer_memory_mb`), and the run still ends with the fault-free parameters.

    relaunch run --nnodes 2 --nproc-per-node 1 examples/fsdp/train_fsdp2.py --steps 40
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from relaunch.train import report_progress
from relaunch.train.sharded import ShardedCheckpointManager

TOTAL = 64  # samples per global batch


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(TOTAL, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)
    lo, hi = rank * TOTAL // world, (rank + 1) * TOTAL // world
    return x[lo:hi], y[lo:hi]


def full_hash(model: nn.Module) -> str:
    """SHA-256 of every full parameter (gathered from the shards), on every rank."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(name.encode())
        digest.update(full[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded on the current process group, and Adam over its shards."""
    torch.manual_seed(0)  # the same initial model on every rank, before sharding
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 1),
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def checkpoints(args: argparse.Namespace) -> ShardedCheckpointManager:
    shared = os.environ.get("RELAUNCH_SHARED_DIR", ".")  # kept across reschedulings
    directory = args.ckpt_dir or os.path.join(shared, "fsdp-checkpoints")
    return ShardedCheckpointManager(directory, every=args.ckpt_every, async_save=args.async_save)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--ckpt-dir", default=None, help="default: the job's shared directory")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--process-recovery", action="store_true", help="healthy ranks survive a rank's fault"
    )
    args = parser.parse_args()
    if args.process_recovery:
        process_level(args)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = checkpoints(args)  # before the model: a restore's memory is made ready meanwhile
    model, optimizer = build()

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state, "step": ckpt.completed_step or 0}

    start = 0
    into = state()
    resumed = ckpt.load(into=into)
    if resumed is not None:
        set_state_dict(model, optimizer, model_state_dict=into["model"],
                       optim_state_dict=into["optim"])  # fmt: skip
        start = int(into["step"])
    ckpt.completed_step = start
    ckpt.dying_gasp(state)
    print(f"start: rank {rank}/{world} resume_step={start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        with ckpt.step(step):
            torch.manual_seed(step * 1000 + rank)  # dropout's stream, per step and rank
            x, y = batch(step, rank, world)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        report_progress(step)
        ckpt.maybe_save(step, state)
        if step % 10 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_seconds)

    ckpt.wait()
    digest = full_hash(model)
    if rank == 0:
        print(f"done: params sha256 {digest} step {max(start, args.steps)}", flush=True)
        if args.out:
            Path(args.out).write_text(digest + "\n")
    dist.barrier()
    dist.destroy_process_group()


def process_level(args: argparse.Namespace) -> None:
    """The same training, with the process group kept by relaunch's SDK."""
    from relaunch.train.sharded_group import ShardedGroupKeeper

    keeper = ShardedGroupKeeper(build)
    keeper.start()
    ckpt = checkpoints(args)

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(keeper.model, keeper.optimizer)
        return {"model": model_state, "optim": optim_state, "step": ckpt.completed_step or 0}

    def resume() -> int:
        """Load the newest verified step into the keeper's model and optimizer: its number."""
        into = state()
        if ckpt.load(into=into) is None:
            return 0
        set_state_dict(keeper.model, keeper.optimizer, model_state_dict=into["model"],
                       optim_state_dict=into["optim"])  # fmt: skip
        return int(into["step"])

    keeper.completed = ckpt.completed_step = resume()
    ckpt.dying_gasp(state)
    print(
        f"start: rank {keeper.rank}/{keeper.world_size} pid={os.getpid()} "
        f"resume_step={keeper.completed}",
        flush=True,
    )

    def train_step(step: int) -> torch.Tensor:
        torch.manual_seed(step * 1000 + keeper.rank)  # dropout's stream, per step and rank
        x, y = batch(step, keeper.rank, keeper.world_size)
        keeper.optimizer.zero_grad()
        loss = nn.functional.mse_loss(keeper.module(x), y)
        loss.backward()
        return loss

    def after(step: int, loss: torch.Tensor) -> None:
        report_progress(step)
        ckpt.maybe_save(step, state)
        if step % 10 == 0 and keeper.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_seconds)

    keeper.run(keeper.completed + 1, args.steps, train_step, after, checkpoint=ckpt, resume=resume)
    ckpt.wait()
    digest = full_hash(keeper.model)
    if keeper.rank == 0:
        print(f"done: params sha256 {digest} recoveries {keeper.recoveries}", flush=True)
        if args.out:
            Path(args.out).write_text(digest + "\n")
    dist.barrier()
    keeper.exit(0)


if __name__ == "__main__":
    main()
    # FSDP's modules and the checkpoint manager hold process groups in reference cycles: collect
    # them while the interpreter is whole. Left to its finalisation, a gloo group was destroyed
    # with its threads still joinable ("terminate called without an active exception", SIGABRT
    # after the work was done: 5 exits in about 50 on two busy cores, none in 30 with this).
    gc.collect()
