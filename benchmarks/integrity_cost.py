"""What the replicas' fingerprint check (relaunch.train.integrity, R-45) costs a DDP step, beside
the same loop without it, in one run: three gloo ranks on this machine train the DDP example's
model, `--steps` steps a round, rounds with and without the check alternating (`--rounds` each),
and the median of each is printed with their ratio.

Run: .venv/bin/python benchmarks/integrity_cost.py [--every 10] [--steps 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

RANKS = 3


def rank_main(every: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from relaunch.train.integrity import ReplicaCheck

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ddp = DistributedDataParallel(model)
    check = ReplicaCheck(model, optimizer, every=every)

    def step(s: int) -> None:
        generator = torch.Generator().manual_seed(s * 1000 + rank)
        x = torch.randn(32, 16, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
        optimizer.step()

    for s in range(1, 201):  # warm: allocator, gloo's buffers
        step(s)
    dist.barrier()
    began = time.perf_counter()
    for s in range(1, steps + 1):
        step(s)
        check.after_step(s)
    dist.barrier()
    if rank == 0:
        print(f"{(time.perf_counter() - began) / steps * 1000:.5f}", flush=True)
    dist.destroy_process_group()


def one_round(every: int, steps: int) -> float:
    """Milliseconds a step, rank 0's, with a check every `every` steps (0: none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("RELAUNCH_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(RANKS)}
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(every), str(steps)],
            env={**base, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(RANKS)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in ranks]
    if any(p.returncode for p in ranks):
        raise SystemExit(f"a rank failed: {outputs}")
    return float(outputs[0].strip())


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    plain, checked = [], []
    for n in range(args.rounds):
        plain.append(one_round(0, args.steps))
        checked.append(one_round(args.every, args.steps))
        print(f"round {n + 1}: {plain[-1]:.4f} ms without, {checked[-1]:.4f} ms with", flush=True)
    a, b = statistics.median(plain), statistics.median(checked)
    print(
        f"{RANKS} gloo ranks, a check every {args.every} steps: {b:.4f} ms a step against "
        f"{a:.4f} ms without ({(b / a - 1) * 100:+.2f} %; rounds without "
        f"{min(plain):.4f}-{max(plain):.4f}, with {min(checked):.4f}-{max(checked):.4f})"
    )


if __name__ == "__main__":
    main()
