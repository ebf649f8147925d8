"""examples/ddp/train_ddp.py's job (model, data, optimizer, step time, a checkpoint every
`--ckpt-every` steps) as a plain torch.distributed script for the launchers that restart every
rank: NVIDIA's `ft_launcher` (nvidia-resiliency-ext, with `--nvrx`: each step is a heartbeat to
its rank monitor, as its docs ask, so that a hang is caught) and DLRover's `dlrover-run`. No
relaunch import: it runs in the peer's own virtual environment (`make peers`).

It writes train_ddp.py's timeline lines (`event step time`, rank 0 and the struck rank), so that
relaunch_bench.timeline reads every launcher with one ruler.
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # before the heavy imports

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peer_job import FaultSeries, batch, model_and_optimizer  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--ckpt-dir", default="ckpt")
    parser.add_argument("--timeline", default=None)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--hang-at-step", type=int, default=None)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument(
        "--faults", default=None, help="a fault series, STEP:KIND,... (crash or hang), each once"
    )
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    parser.add_argument("--nvrx", action="store_true", help="heartbeats to NVRx's rank monitor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def mark(event: str, step: int, at: float | None = None) -> None:
        if args.timeline and (rank == 0 or event in ("crash", "hang")):
            with open(args.timeline, "a") as timeline:
                timeline.write(f"{event} {step} {at or time.time():.6f}\n")

    mark("launched", 0, LAUNCHED)
    monitor = None
    if args.nvrx:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        monitor = RankMonitorClient()
        monitor.init_workload_monitoring()
    mark("imported", 0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout))
    mark("group", 0)
    model, optimizer = model_and_optimizer()
    ddp = DistributedDataParallel(model)
    mark("ddp", 0)
    ckpt = Path(args.ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    start = 0
    latest = ckpt / "latest.pt"
    if latest.exists():
        state = torch.load(latest, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    mark("loaded", start)
    mark("start", start)
    series = FaultSeries(args.faults, args.timeline)
    for step in range(start + 1, args.steps + 1):
        strike = series.due(step) if rank == args.fault_rank else None
        if first_start and rank == args.fault_rank and step == args.crash_at_step:
            strike = "crash"
        if first_start and rank == args.fault_rank and step == args.hang_at_step:
            strike = "hang"
        if strike == "crash":
            mark("crash", step)
            os._exit(1)
        if strike == "hang":
            mark("hang", step)
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        if monitor is not None:
            monitor.send_heartbeat()
        mark("step", step)
        if step % args.ckpt_every == 0 and rank == 0:
            tmp = ckpt / "latest.tmp"
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "step": step}, tmp)
            tmp.replace(latest)
        time.sleep(args.step_seconds)
    dist.barrier()
    if monitor is not None:
        monitor.shutdown_workload_monitoring()
    dist.destroy_process_group()
    print(f"done: rank {rank} step {args.steps}", flush=True)


if __name__ == "__main__":
    main()
