"""MindSpore data parallelism with relaunch's training SDK (relaunch.train.mindspore): steps
reported to relaunch, checkpoints saved and loaded through the SDK's CheckpointManager (atomic,
verified), in `Model.train` (--api model) or in a hand-written loop (--api loop). Runs under
msrun too, where the reports go nowhere.

    relaunch run --worker_num=2 --local_worker_num=1 mindspore_sdk.py --api model --steps 200

Rank 0 prints a digest of the final parameters: the same in every run of the same flags.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Callback, Model

from relaunch.train import CheckpointManager, report_progress
from relaunch.train.mindspore import Checkpoints, Progress, restore, state_of, train_step

STEPS_PER_EPOCH = 10
BATCH = 16


def rows(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """This worker's shard of one epoch: the same numbers in every run."""
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((STEPS_PER_EPOCH * BATCH, 8)).astype(np.float32)
    y = (x @ np.arange(1, 9, dtype=np.float32).reshape(8, 1) / 8).astype(np.float32)
    return x, y


class Paced(Callback):  # type: ignore[misc]
    """Each step lasts at least `seconds` and is printed, as the loop's are."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.began = seconds, time.monotonic()

    def on_train_step_end(self, run_context) -> None:  # type: ignore[no-untyped-def]
        loss = float(run_context.original_args().net_outputs.asnumpy())
        print(f"step {train_step(run_context)} loss={loss:.6f}", flush=True)
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self.began)))
        self.began = time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("model", "loop"), default="model")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", default="sdk-ckpt")
    parser.add_argument("--min-step-seconds", type=float, default=0.0)
    args = parser.parse_args()
    assert args.steps % STEPS_PER_EPOCH == 0 and args.save_every % STEPS_PER_EPOCH == 0

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
    manager = CheckpointManager(args.checkpoint_dir, rank=rank, every=args.save_every)
    saves = Checkpoints(manager, optimizer)  # the optimizer holds the network's parameters too
    if args.api == "model":  # Model.train resumes at an epoch's start
        start = saves.restore(world_size=size)
    else:  # any step
        start = restore(manager, optimizer, world_size=size)
    print(f"start: rank={rank} size={size} step={start} api={args.api}", flush=True)
    x, y = rows(rank)

    if args.api == "model":
        data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(BATCH)
        model = Model(network, loss_fn=loss_fn, optimizer=optimizer)
        model.train(
            args.steps // STEPS_PER_EPOCH,
            data,
            callbacks=[Progress(), saves, Paced(args.min_step_seconds)],
            dataset_sink_mode=False,
            initial_epoch=start // STEPS_PER_EPOCH,
        )
    else:
        reducer = nn.DistributedGradReducer(optimizer.parameters)
        grad_fn = ms.value_and_grad(lambda a, b: loss_fn(network(a), b), None, optimizer.parameters)
        for step in range(start + 1, args.steps + 1):
            began = time.monotonic()
            at = ((step - 1) % STEPS_PER_EPOCH) * BATCH
            with manager.step(step):
                loss, grads = grad_fn(ms.Tensor(x[at : at + BATCH]), ms.Tensor(y[at : at + BATCH]))
                optimizer(reducer(grads))
            report_progress(step)
            print(f"step {step} loss={float(loss.asnumpy()):.6f}", flush=True)
            manager.maybe_save(step, lambda: state_of(optimizer))
            time.sleep(max(0.0, args.min_step_seconds - (time.monotonic() - began)))
    manager.wait()

    if rank == 0:
        digest = hashlib.sha256()
        for parameter in network.trainable_params():
            digest.update(parameter.asnumpy().tobytes())
        print(f"done: step={args.steps} digest={digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
