"""R-42 on a machine with a core per rank: process-level MTTR of the DDP job at 4 and 16
processes (2 pods), `--repeats` runs per cell, torchrun's crash restart once per size beside it,
measured in one run with the functions `relaunch bench --only sizes` runs
(`relaunch_bench.mttr.relaunch_once`, `torchrun.crash_once`).

The flatness target: each process level's median at the largest size within +-25 % of its median
at the smallest. On 2 cores it cannot be shown (16 ranks and 16 spares share them); run it where
there are at least as many cores as ranks. Run: python benchmarks/sizes_flatness.py --out FILE

A level named LEVEL/no-template runs LEVEL with RELAUNCH_RANK_TEMPLATE=0: every rank a new
process, as before the pods' rank templates, measured beside the level with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from relaunch_bench import torchrun
from relaunch_bench.mttr import relaunch_once

NO_TEMPLATE = "no-template"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4,16")
    parser.add_argument("--levels", default="process-retry,process-in-place+spare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--step-seconds", type=float, default=None,
        help="the DDP script's step time (default its own): long enough that warm spares are "
        "ready before the fault",
    )  # fmt: skip
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    levels = [lv for lv in args.levels.split(",") if lv]
    started = time.time()
    cells: list[dict[str, Any]] = []
    for size in sizes:
        procs = size // 2
        with tempfile.TemporaryDirectory(prefix="relaunch-sizes-") as tmp:
            baseline = torchrun.crash_once(Path(tmp), procs, step_s=args.step_seconds)
        print(f"[{time.time() - started:5.0f} s] {size} torchrun: {baseline.mttr_s}", flush=True)
        cells.append({"processes": size, "system": "torchrun", "samples": [baseline.mttr_s]})
        for level in levels:
            samples: list[float | None] = []
            notes: list[str] = []
            for _ in range(args.repeats):
                level_run, _, variant = level.partition("/")
                os.environ.pop("RELAUNCH_RANK_TEMPLATE", None)
                if variant == NO_TEMPLATE:
                    os.environ["RELAUNCH_RANK_TEMPLATE"] = "0"
                with tempfile.TemporaryDirectory(prefix="relaunch-sizes-") as tmp:
                    sample = relaunch_once(
                        "ddp", level_run, Path(tmp), procs, step_s=args.step_seconds
                    )
                os.environ.pop("RELAUNCH_RANK_TEMPLATE", None)
                samples.append(sample.mttr_s if sample.ok else None)
                notes.append(sample.note)
                print(
                    f"[{time.time() - started:5.0f} s] {size} {level}: {samples[-1]} {sample.note}",
                    flush=True,
                )
            cells.append(
                {"processes": size, "system": "relaunch", "level": level, "samples": samples,
                 "notes": notes}
            )  # fmt: skip
    for cell in cells:
        good = [s for s in cell["samples"] if s is not None]
        cell["median_s"] = round(statistics.median(good), 3) if good else None
    flat = {}
    for level in levels:
        by_size = {c["processes"]: c["median_s"] for c in cells if c.get("level") == level}
        low, high = by_size.get(min(sizes)), by_size.get(max(sizes))
        flat[level] = round(high / low - 1, 3) if low and high else None
    result = {"cpus": os.cpu_count(), "cells": cells, "growth_largest_vs_smallest": flat}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
