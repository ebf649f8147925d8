"""A MindSpore data-parallel training script, written from MindSpore's documentation alone
(distributed data parallel on CPU, `msrun`), with nothing of relaunch in it.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \
        mindspore_dp.py --steps 100

Each worker trains the same small network on its own shard of a synthetic dataset; gradients
are averaged across the workers (`nn.DistributedGradReducer`). Every `--save-every` steps each
worker saves its network and optimizer state with `mindspore.save_checkpoint` (into
ckpt/rank-R); started again, every worker resumes from the newest step all of them saved. Rank 0 prints a digest of the final
parameters: two runs with the same flags end with the same digest.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init


def batch(step: int, rank: int, size: int) -> tuple[ms.Tensor, ms.Tensor]:
    """The rank's shard of step `step`'s batch: the same numbers in every run."""
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = (x @ np.arange(1, 9, dtype=np.float32).reshape(8, 1) / 8).astype(np.float32)
    return ms.Tensor(x), ms.Tensor(y)


def newest_checkpoint(root: Path, rank: int, size: int) -> tuple[int, dict] | None:
    """The newest step every rank saved (a worker that died between two saves left its peers
    one ahead), whose checkpoint of this rank loads (a torn one is skipped), and its state."""

    def steps(r: int) -> set[int]:
        return {int(p.stem[5:]) for p in (root / f"rank-{r}").glob("step-*.ckpt")}

    common = set.intersection(*(steps(r) for r in range(size)))
    for step in sorted(common, reverse=True):
        path = root / f"rank-{rank}" / f"step-{step}.ckpt"
        try:
            return step, ms.load_checkpoint(str(path))
        except (ValueError, RuntimeError, OSError) as error:
            print(f"skipping {path.name}: {error}", flush=True)
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", default="ckpt")
    parser.add_argument("--min-step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(0)
    init()
    rank, size = get_rank(), get_group_size()
    ms.set_auto_parallel_context(
        parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=size
    )

    network = nn.SequentialCell(nn.Dense(8, 16), nn.ReLU(), nn.Dense(16, 1))
    optimizer = nn.Momentum(network.trainable_params(), learning_rate=0.01, momentum=0.9)
    loss_fn = nn.MSELoss()
    reducer = nn.DistributedGradReducer(optimizer.parameters)

    def forward(x: ms.Tensor, y: ms.Tensor) -> ms.Tensor:
        return loss_fn(network(x), y)

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    root = Path(args.checkpoint_dir)
    folder = root / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    found = newest_checkpoint(root, rank, size)
    if found is not None:
        start, params = found
        ms.load_param_into_net(optimizer, params)
    print(f"start: rank={rank} size={size} step={start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        began = time.monotonic()
        loss, grads = grad_fn(*batch(step, rank, size))
        optimizer(reducer(grads))
        print(f"step {step} loss={float(loss.asnumpy()):.6f}", flush=True)
        if step % args.save_every == 0:
            partial = folder / f"writing-{step}.ckpt"  # save_checkpoint wants the suffix
            ms.save_checkpoint(optimizer, str(partial))
            os.replace(partial, folder / f"step-{step}.ckpt")
        time.sleep(max(0.0, args.min_step_seconds - (time.monotonic() - began)))

    if rank == 0:
        digest = hashlib.sha256()
        for parameter in network.trainable_params():
            digest.update(parameter.asnumpy().tobytes())
        print(f"done: step={args.steps} digest={digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
