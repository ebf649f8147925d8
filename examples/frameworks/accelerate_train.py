"""A Hugging Face Accelerate training loop as Accelerate's docs write one, with nothing of
relaunch in it: run it with `accelerate launch`, `torchrun` or `relaunch run` alike. It saves
with `save_state` every few steps and, started again, loads its newest checkpoint that loads
(`save_state` is not atomic: one cut short by a kill is skipped, and the next saves are
numbered past it).

    relaunch run --nnodes 2 --nproc-per-node 1 examples/frameworks/accelerate_train.py --steps 300
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn


class Counter:
    """The step, saved and loaded with the rest of the state (`register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def checkpoints(root: Path) -> list[Path]:
    """Accelerate's automatically named checkpoints, newest first."""
    found = [p for p in (root / "checkpoints").glob("checkpoint_*") if p.is_dir()]
    return sorted(found, key=lambda p: int(re.sub(r"\D", "", p.name)), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--root", default="accelerate-run")
    parser.add_argument(
        "--min-step-seconds",
        type=float,
        default=0.0,
        help="each step takes at least this long: a stand-in for a real model's step, so that "
        "seconds of training are steps of training on any machine",
    )
    args = parser.parse_args()

    root = Path(args.root)
    config = ProjectConfiguration(
        project_dir=str(root), automatic_checkpoint_naming=True, total_limit=3
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    set_seed(0)
    model = nn.Sequential(
        nn.Linear(32, args.width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(args.width, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    found = checkpoints(root)
    if found:
        # numbered past every directory there, those that do not load included (even when
        # none does: the first save cut short by a kill): save_state refuses to write into a
        # directory that exists
        config.iteration = int(re.sub(r"\D", "", found[0].name)) + 1
    for checkpoint in found:
        try:
            accelerator.load_state(str(checkpoint))
        except Exception as error:  # cut short by a kill: the one before it
            accelerator.print(f"skipping {checkpoint.name}: {error!r}")
            continue
        break
    accelerator.print(
        f"start: world {accelerator.num_processes} distributed_type="
        f"{accelerator.distributed_type.value} "
        f"torchelastic={torch.distributed.is_torchelastic_launched()} step={counter.step}"
    )
    data = torch.Generator().manual_seed(accelerator.process_index)
    while counter.step < args.steps:
        began = time.monotonic()
        x = torch.randn(64, 32, generator=data)
        y = torch.randn(64, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        counter.step += 1
        if counter.step % args.save_every == 0:
            accelerator.save_state()
        if counter.step % 10 == 0:
            print(f"step {counter.step}", flush=True)
        time.sleep(max(0.0, args.min_step_seconds - (time.monotonic() - began)))
    accelerator.wait_for_everyone()
    accelerator.print(f"done: step={counter.step}")


if __name__ == "__main__":
    main()
