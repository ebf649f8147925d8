"""examples/ddp/train_ddp.py's model, data, optimizer and step time, written as torchft's docs
write a fault-tolerant DDP job (torchft 0.2.0): one replica group per process, a lighthouse
that forms a quorum each step, torchft's DDP and optimizer wrappers, ProcessGroupGloo. A
replica group runs under its own `torchrun --max-restarts N` (torchft restarts nothing itself);
a restarted replica takes the model from a healthy one when it joins the quorum, and while it
is gone the others go on without it (min_replicas 1). No relaunch import: this runs in the
peer's own virtual environment (`make peers`).

For the benchmark (relaunch_bench.peers) it writes the same timeline lines as train_ddp.py
(`event step time`): `launched`, `imported`, `group` (the manager made), `step` (every replica's
steps, with its id), and `crash` / `hang` where a fault plan of the command line strikes.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 \\
      torchrun --nnodes 1 --nproc-per-node 1 --max-restarts 3 torchft_ddp.py --steps 60
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # before the heavy imports

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
from peer_job import batch, model_and_optimizer  # noqa: E402
from torch import nn  # noqa: E402
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--timeline", default=None)
    parser.add_argument("--crash-at-step", type=int, default=None, help="exit 1 here, once")
    parser.add_argument("--hang-at-step", type=int, default=None, help="SIGSTOP here, once")
    parser.add_argument("--fault-replica", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="the manager's timeout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def mark(event: str, step: int, at: float | None = None) -> None:
        if args.timeline:
            with open(args.timeline, "a") as timeline:
                timeline.write(f"{event} {step} {at or time.time():.6f} {replica}\n")

    mark("launched", 0, LAUNCHED)
    mark("imported", 0)
    model, inner = model_and_optimizer()

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, dict[str, object]]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout_s)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{replica}",
        timeout=timedelta(seconds=args.timeout_s),
        # the address its peers reach its manager at (a heal's state comes from it): the host's
        # name, unless the host has none of its own (a network namespace of the bench)
        hostname=os.environ.get("BENCH_HOSTNAME", socket.gethostname()),
    )
    mark("group", 0)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    fault_here = first_start and replica == args.fault_replica
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1  # the step this pass tries to commit
        # `>=`: a replica that joins the quorum late heals to the others' step and may never
        # try the fault's step itself
        if fault_here and args.crash_at_step is not None and step >= args.crash_at_step:
            mark("crash", step)
            os._exit(1)
        if fault_here and args.hang_at_step is not None and step >= args.hang_at_step:
            mark("hang", step)
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch(step, replica)
        optimizer.zero_grad()  # starts the step's quorum
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        before = manager.current_step()
        optimizer.step()  # commits only if every replica in the quorum finished the step
        if manager.current_step() > before:
            mark("step", manager.current_step())
        time.sleep(args.step_seconds)
    print(f"done: replica {replica} step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
