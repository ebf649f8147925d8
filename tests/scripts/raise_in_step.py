"""A torchrun script written from PyTorch's docs alone, not for relaunch: gloo, an all-reduce per
step, `errors.record` on main (unless `--no-record`), the process group destroyed in a `finally`. In its first attempt
rank `--fail-rank` raises at `--fail-step`; its peers then fail in their all-reduce ("Connection
closed by peer") while the failing rank is still busy exiting (its uploader thread flushes for
`--exit-seconds`), so their exits reach relaunch first."""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fail-rank", type=int, default=3)
    parser.add_argument("--fail-step", type=int, default=10)
    parser.add_argument("--exit-seconds", type=float, default=3.0)
    parser.add_argument("--no-record", action="store_true", help="leave no error file")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    total = torch.zeros(1)
    try:
        for step in range(1, args.steps + 1):
            if first and rank == args.fail_rank and step == args.fail_step:
                uploader = threading.Thread(target=time.sleep, args=(args.exit_seconds,))
                uploader.start()  # not a daemon: the process exits when it is done
                raise ValueError(f"bad batch at step {step}: labels out of range")
            value = torch.ones(1)
            dist.all_reduce(value)
            total += value
            print(f"step {step} total {total.item():g}", flush=True)
            time.sleep(0.05)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    if "--no-record" in sys.argv:
        main()
    else:
        record(main)()
