"""What the training SDK costs a training loop, measured side by side in one run.

- report_progress: time per call, against an empty Python call (the floor of any call).
- checkpoint save of a 256 MB state: how long the training loop is stalled by a synchronous save
  and by an asynchronous one (which only waits for the copy to host memory).

Run: .venv/bin/python benchmarks/sdk_costs.py [--mb 256] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch

from relaunch.train import CheckpointManager, report_progress


def per_call(fn: object, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)  # type: ignore[operator]
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()

    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"relaunch-bench-{os.getpid()}"
    receiver.bind("\0" + name)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    receiver.setblocking(False)
    os.environ["RELAUNCH_PROGRESS_SOCKET"] = "@" + name

    def empty(step: int) -> None:
        return None

    def drain() -> None:
        try:
            while True:
                receiver.recv(64)
        except BlockingIOError:
            pass

    floor = per_call(empty, args.calls)
    cost = 0.0
    rounds = 20
    for _ in range(rounds):
        cost += per_call(report_progress, args.calls // rounds)
        drain()
    cost /= rounds
    print(
        f"report_progress: {cost * 1e6:.2f} us per call (empty call {floor * 1e6:.3f} us; ratio {cost / floor:.0f}x)"
    )

    state = {"weights": torch.randn(args.mb * 1024 * 1024 // 4)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sync = CheckpointManager(Path(tmp) / "sync", rank=0, keep=1)
        start = time.perf_counter()
        sync.save(1, state)
        sync_stall = time.perf_counter() - start

        asynchronous = CheckpointManager(Path(tmp) / "async", rank=0, keep=1, async_save=True)
        start = time.perf_counter()
        asynchronous.save(1, state)
        async_stall = time.perf_counter() - start
        asynchronous.wait()
        async_total = time.perf_counter() - start
    print(
        f"{args.mb} MB save: synchronous stalls training {sync_stall:.3f} s; asynchronous stalls "
        f"{async_stall:.3f} s (the copy to host memory), done in the background after {async_total:.3f} s; "
        f"stall ratio async/sync {async_stall / sync_stall:.2f}"
    )


if __name__ == "__main__":
    main()
