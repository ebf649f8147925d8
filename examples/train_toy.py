"""A toy training job for the embedded cluster: pure Python, deterministic, resumable.

Each rank fits y = 3x + 1 by SGD on data that depends only on the step, saves a checkpoint every
`--ckpt-every` steps (atomically: temporary file, then rename) in the job's shared directory, and
resumes from it after a restart. It reports progress through relaunch's SDK and prints the
counters relaunch gives it, so that the recoveries are visible.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

from relaunch.train import env, report_progress


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--ckpt-every", type=int, default=5, help="0: no checkpoint")
    parser.add_argument(
        "--crash-at-step", type=int, default=None, help="exit 1 here in every attempt (a code bug)"
    )
    parser.add_argument("--ckpt-dir", default=None, help="default: the job's shared directory")
    parser.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="ignore SIGTERM, as PyTorch Lightning's handler does (it only sets a flag)",
    )
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
    job = env()
    directory = Path(args.ckpt_dir or os.environ.get("RELAUNCH_SHARED_DIR", "."))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-rank{job.rank}.json"
    state = {"step": 0, "w": 0.0, "b": 0.0}
    if path.exists():
        state = json.loads(path.read_text())
    print(
        f"start: rank {job.rank}/{job.world_size} MA_SCHEDULE_CNT={job.schedule_cnt} "
        f"MA_PROC_START_CNT={job.proc_start_cnt} resume_step={state['step']}",
        flush=True,
    )
    while state["step"] < args.steps:
        step = state["step"] + 1
        rng = random.Random(step)
        x = rng.uniform(-1, 1)
        error = state["w"] * x + state["b"] - (3 * x + 1)
        state = {"step": step, "w": state["w"] - 0.1 * error * x, "b": state["b"] - 0.1 * error}
        if args.crash_at_step is not None and step == args.crash_at_step:
            print(f"step {step}: simulated bug, exiting 1", flush=True)
            raise SystemExit(1)
        if args.ckpt_every and step % args.ckpt_every == 0:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(path)
        report_progress(step)
        if step % 10 == 0:
            print(f"step {step} w={state['w']:.4f} b={state['b']:.4f}", flush=True)
        time.sleep(args.step_seconds)
    print(f"done: w={state['w']:.6f} b={state['b']:.6f}", flush=True)


if __name__ == "__main__":
    main()
