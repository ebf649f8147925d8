"""DLRover's flash checkpoint on the same state as relaunch's peer-memory benchmark, run under
`dlrover-run --standalone` (relaunch_bench.peer_memory): the first worker saves the state to
DLRover's shared memory (the loop's stall) and to disk, then fails; dlrover-run restarts it on
the same node, and the new worker loads the state back from the shared memory its agent kept,
timed from `load_checkpoint()` to its return. Each worker appends one JSON line to --out.

Runs in DLRover's own virtual environment (torch and dlrover there, nothing of relaunch's)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checkpointer = DdpCheckpointer(args.dir)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        generator = torch.Generator().manual_seed(args.mb)
        state = {f"w{i}": torch.randn(args.mb << 14, generator=generator) for i in range(16)}
        start = time.perf_counter()
        checkpointer.save_checkpoint(1, state, storage_type=StorageType.MEMORY)
        stall = time.perf_counter() - start
        checkpointer.save_checkpoint(
            2, state, os.path.join(args.dir, "2", "rank_0.pt"), storage_type=StorageType.DISK
        )
        _persisted(os.path.join(args.dir, "dlrover_latest.txt"), "2", 1800)
        _say(args.out, memory_save_stall_s=stall)
        sys.exit(1)  # the fault: dlrover-run restarts this worker on the same node
    start = time.perf_counter()
    loaded = checkpointer.load_checkpoint()
    took = time.perf_counter() - start
    size = sum(t.numel() * t.element_size() for t in loaded.values() if torch.is_tensor(t))
    _say(args.out, memory_restore_s=took, restored_bytes=size)


def _persisted(tracker: str, step: str, timeout_s: float) -> None:
    """Until DLRover's agent wrote step `step` to storage (its tracker file names it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(tracker) as f:
                if f.read().strip() == step:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"DLRover did not persist step {step} in {timeout_s} s")


def _say(path: str, **values: float) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(values) + "\n")


if __name__ == "__main__":
    main()
