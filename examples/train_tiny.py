"""A tiny deterministic training loop with no dependencies, for demos and tests.

Prints one line per step (`step N loss X`); the loss depends only on the step, so every run and
every resumed run prints the same numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()
    rank = os.environ.get("RANK", "0")
    for step in range(1, args.steps + 1):
        loss = 1.0 / math.sqrt(step)
        print(f"rank {rank} step {step} loss {loss:.6f}", flush=True)
        time.sleep(args.step_seconds)


if __name__ == "__main__":
    main()
