"""A PyTorch DDP job (gloo on CPU, or NCCL on NVIDIA GPUs with `--device cuda`) that relaunch can
stop and restart anywhere without changing the model it ends with.

- The data of step s depends only on s and the rank, so a resumed run sees the same batches.
- Model, optimizer, RNG state and step are checkpointed every `--ckpt-every` steps into the job's
  shared directory (kept across reschedulings), and saved once more on SIGTERM (dying gasp).
- Every rank resumes from the newest step all ranks can load.
- Rank 0 writes the SHA-256 of the final parameters to `--out`.
- Every `spec.integrity_check_every` steps the replicas compare their parameters' fingerprints
  (relaunch.train.integrity): a chip that computes wrong is found and the job rolled back.
- `--device cuda`: the model and its batches on GPU `LOCAL_RANK % device count`, NCCL between
  the ranks; `--dropout P` draws from the GPU's random stream, which the checkpoint then holds.
- `--process-recovery`: the training SDK's ProcessGroupKeeper owns the process group, so that
  under `process-recover-enable: on` a failed rank is replaced (or a step retried) while the
  healthy ranks keep running; the maths of every step is the same.
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # before the heavy imports: the timeline's "launched" (benchmarks)

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from relaunch.train import CheckpointManager, env, report_progress  # noqa: E402
from relaunch.train.distributed import (  # noqa: E402
    load_common_checkpoint,
    parameter_hash,
    rng_state,
    set_rng_state,
    settle_ddp_buckets,
)
from relaunch.train.integrity import ReplicaCheck  # noqa: E402


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)
    return x, y


def shard(step: int, rank: int, world: int, total: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Elastic data: step s has one global batch of `total` samples, split evenly among however
    many replicas there are now (process-level recovery may change that)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(total, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)
    lo, hi = rank * total // world, (rank + 1) * total // world
    return x[lo:hi], y[lo:hi]


def device_of(args: argparse.Namespace) -> torch.device:
    """Where this rank computes: the CPU, or its GPU (LOCAL_RANK, as torchrun's scripts pick it)."""
    if args.device == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def finished(where: torch.device) -> None:
    """A step is done when the GPU is done with it: CUDA runs it after the host has moved on, so
    a step reported (or timed) before this could be one the GPU never finished."""
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def checkpoints(args: argparse.Namespace, rank: int) -> CheckpointManager:
    """The rank's checkpoints, made first: where the job keeps copies in peers' memory, the
    memory a restore receives its copy into is faulted in while the rank does the rest of its
    start (relaunch.train.peer)."""
    shared = Path(os.environ.get("RELAUNCH_SHARED_DIR", "."))
    return CheckpointManager(
        args.ckpt_dir or shared / "ckpt",
        rank=rank,
        every=args.ckpt_every or None,
        keep=3,
        async_save=args.async_save,
    )


def build(
    args: argparse.Namespace, ckpt: CheckpointManager
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], dict[str, object]]]:
    """The model, its optimizer and what a checkpoint holds."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.Tanh()]
    if args.dropout > 0:
        layers.append(nn.Dropout(args.dropout))
    model = nn.Sequential(*layers, nn.Linear(64, 1)).to(args.where)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    def state() -> dict[str, object]:
        if args.slow_save_at is not None and ckpt.completed_step == args.slow_save_at:
            time.sleep(args.slow_save_s)
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(),
        }

    return model, optimizer, state


@record  # writes the exception to TORCHELASTIC_ERROR_FILE, as under torchrun
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--ckpt-every", type=int, default=10, help="0: no periodic checkpoint")
    parser.add_argument("--ckpt-dir", default=None, help="default: $RELAUNCH_SHARED_DIR/ckpt")
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="write each checkpoint in the background: the loop waits only for the host copy",
    )
    parser.add_argument("--out", default=None, help="where rank 0 writes the final parameter hash")
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=60.0,
        help="seconds gloo waits in a collective before the rank fails (a plain script's link)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL on NVIDIA GPUs"
    )
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="draws from the device's random stream"
    )
    parser.add_argument(
        "--timeline", default=None, help="append 'event step time' lines (benchmarks)"
    )
    parser.add_argument(
        "--crash-at-step", type=int, default=None, help="benchmarks: exit 1 here, first start only"
    )
    parser.add_argument("--crash-rank", type=int, default=3)
    parser.add_argument(
        "--crash-with",
        choices=("exit", "exception"),
        default="exit",
        help="exit: os._exit(1); exception: raise (the error the record shows as root cause)",
    )
    parser.add_argument(
        "--crash-every",
        type=int,
        default=None,
        help="benchmarks: in attempt a < --crash-attempts, exit 1 at step (a + 1) x this",
    )
    parser.add_argument("--crash-attempts", type=int, default=0)
    parser.add_argument(
        "--hang-at-step", type=int, default=None, help="benchmarks: SIGSTOP here, first start only"
    )
    parser.add_argument(
        "--process-recovery", action="store_true", help="healthy ranks survive a rank's fault"
    )
    parser.add_argument(
        "--slow-save-at",
        type=int,
        default=None,
        help="tests: the checkpoint of this step takes --slow-save-s longer (a large model's save)",
    )
    parser.add_argument("--slow-save-s", type=float, default=0.0)
    args = parser.parse_args()
    args.where = device_of(args)
    if args.process_recovery:
        process_level(args)
        return

    torch.set_num_threads(1)
    job = env()
    first_start = (
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and job.proc_start_cnt == 1
    )

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash_step = args.crash_at_step if first_start else None
    if args.crash_every and attempt < args.crash_attempts:
        crash_step = (attempt + 1) * args.crash_every

    def mark(event: str, step: int, at: float | None = None) -> None:
        if args.timeline and (job.rank == 0 or event in ("crash", "hang")):
            with open(args.timeline, "a") as timeline:
                timeline.write(f"{event} {step} {at or time.time():.6f}\n")

    # Where a restart's time goes (rank 0): process start, imports, CUDA, rendezvous, model,
    # communicator, checkpoint (relaunch_bench.timeline.PHASES).
    mark("launched", 0, LAUNCHED)
    mark("imported", 0)
    if args.where.type == "cuda":
        torch.empty(1, device=args.where)  # CUDA's context (a warm spare's is there already)
    mark("cuda", 0)
    ckpt = checkpoints(args, job.rank)
    dist.init_process_group(
        "nccl" if args.where.type == "cuda" else "gloo",
        timeout=timedelta(seconds=args.collective_timeout),
    )
    mark("group", 0)
    model, optimizer, state = build(args, ckpt)
    mark("built", 0)
    ddp = DistributedDataParallel(model)  # its first broadcast makes the group's communicator
    mark("ddp", 0)

    start = 0
    resumed = load_common_checkpoint(ckpt, replicated=True)
    if resumed is not None:
        model.load_state_dict(resumed.state["model"])
        optimizer.load_state_dict(resumed.state["optimizer"])
        set_rng_state(resumed.state["rng"])
        start = resumed.step
    ckpt.completed_step = start
    settle_ddp_buckets(ddp, batch(0, job.rank)[0].to(args.where))
    ckpt.dying_gasp(state)
    check = ReplicaCheck(model, optimizer, checkpoint=ckpt)  # the replicas agree
    mark("loaded", start)
    print(
        f"start: rank {job.rank}/{job.world_size} MA_SCHEDULE_CNT={job.schedule_cnt} "
        f"MA_PROC_START_CNT={job.proc_start_cnt} resume_step={start}",
        flush=True,
    )

    if job.rank == 0:
        print(f"backend: {dist.get_backend()} on {args.where}", flush=True)
    mark("start", start)
    for step in range(start + 1, args.steps + 1):
        if step == crash_step and job.rank == args.crash_rank:
            mark("crash", step)
            if args.crash_with == "exception":
                raise FloatingPointError(f"loss is NaN at step {step} on rank {job.rank}")
            os._exit(1)
        if first_start and step == args.hang_at_step and job.rank == args.crash_rank:
            mark("hang", step)
            os.kill(os.getpid(), signal.SIGSTOP)
        with ckpt.step(step):
            x, y = (t.to(args.where) for t in batch(step, job.rank))
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            finished(args.where)
        check.after_step(step)  # before the step's checkpoint: a corrupted one is never saved
        report_progress(step)
        mark("step", step)
        ckpt.maybe_save(step, state)
        if step % 20 == 0 and job.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_seconds)

    ckpt.wait()
    digest = parameter_hash(model)
    if job.rank == 0:
        print(f"done: params sha256 {digest}", flush=True)
        if args.out:
            Path(args.out).write_text(digest + "\n")
    dist.barrier()
    dist.destroy_process_group()


def process_level(args: argparse.Namespace) -> None:
    """The same training, with the process group kept by relaunch's SDK."""
    from relaunch.train.group import ProcessGroupKeeper

    torch.set_num_threads(1)
    job = env()
    ckpt = checkpoints(args, job.rank)
    model, optimizer, state = build(args, ckpt)
    keeper = ProcessGroupKeeper(
        model, optimizer, backend="nccl" if args.where.type == "cuda" else "gloo"
    )
    joined = keeper.start()
    if not joined:
        resumed = load_common_checkpoint(ckpt, replicated=True)
        if resumed is not None:
            model.load_state_dict(resumed.state["model"])
            optimizer.load_state_dict(resumed.state["optimizer"])
            set_rng_state(resumed.state["rng"])
            keeper.completed = resumed.step
    keeper.settle(batch(0, job.rank)[0].to(args.where))
    ckpt.completed_step = keeper.completed
    ckpt.dying_gasp(state)
    print(
        f"start: rank {job.rank}/{keeper.world_size} pid={os.getpid()} "
        f"MA_SCHEDULE_CNT={job.schedule_cnt} MA_PROC_START_CNT={job.proc_start_cnt} "
        f"{'joined' if joined else 'resume'}_step={keeper.completed}",
        flush=True,
    )

    if job.rank == 0:
        print(f"backend: {dist.get_backend()} on {args.where}", flush=True)

    # benchmarks: the rank exits by itself before a step, as a peer's script does (a
    # replacement joined after it and never crashes)
    crash_step = args.crash_at_step if not joined and job.proc_start_cnt == 1 else None

    def train_step(step: int) -> torch.Tensor:
        if step == crash_step and job.rank == args.crash_rank:
            if args.timeline:
                with open(args.timeline, "a") as timeline:
                    timeline.write(f"crash {step} {time.time():.6f}\n")
            os._exit(1)
        x, y = (t.to(args.where) for t in shard(step, keeper.rank, keeper.world_size))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(keeper.module(x), y)
        loss.backward()
        return loss

    def after(step: int, loss: torch.Tensor) -> None:
        finished(args.where)
        if args.timeline and job.rank == 0:  # one line a step: a step done twice shows twice
            with open(args.timeline, "a") as timeline:
                timeline.write(f"step {step} {time.time():.6f}\n")
        report_progress(step)
        ckpt.maybe_save(step, state)
        if step % 20 == 0 and job.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_seconds)

    keeper.run(keeper.completed + 1, args.steps, train_step, after, checkpoint=ckpt)
    ckpt.wait()
    digest = parameter_hash(model)
    if job.rank == 0:
        print(f"done: params sha256 {digest} recoveries {keeper.recoveries}", flush=True)
        if args.out:
            Path(args.out).write_text(digest + "\n")
    dist.barrier()
    keeper.exit(0)


if __name__ == "__main__":
    main()
