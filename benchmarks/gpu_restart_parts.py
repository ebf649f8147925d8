"""Where a GPU restart's time goes, cold and warm, beside torchrun (issue 46): the DDP example over
NCCL (2 pods of one rank), a crash at step 22, restarted at job level by relaunch without spares
(cold), with warm spares that started CUDA while they waited (warm), and by torchrun
(`--max-restarts 3`, cold). Each part of rank 0's restart from its timeline
(relaunch_bench.timeline.PHASES: process start, torch import, CUDA context, rendezvous, model,
NCCL communicator, checkpoint load, first step), measured with the functions `relaunch bench
--device cuda --only mttr` runs, in one run.

    python benchmarks/gpu_restart_parts.py --repeats 2 --out FILE
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from relaunch_bench.mttr import mttr_rows
from relaunch_bench.timeline import PHASES

LEVELS = ("job-reschedule", "job-reschedule+spare")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    began = time.time()

    def say(text: str) -> None:
        print(f"[{time.time() - began:5.0f} s] {text}", flush=True)

    rows = [
        r for r in mttr_rows(False, args.repeats, LEVELS, say, args.device) if r.workload == "ddp"
    ]
    names = {
        ("relaunch", "job-reschedule"): "relaunch, cold",
        ("relaunch", "job-reschedule+spare"): "relaunch, warm spares",
        ("torchrun", "job-reschedule"): "torchrun",
    }
    columns = [names.get((r.system, r.level), f"{r.system} {r.level}") for r in rows]
    lines = ["| part | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for part in (*PHASES, "MTTR"):
        cells = []
        for r in rows:
            value = r.median_s if part == "MTTR" else (r.phases or {}).get(part)
            cells.append("-" if value is None else f"{value:.2f}")
        lines.append(f"| {part.replace('_', ' ')} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    result = {"device": args.device, "rows": [dataclasses.asdict(r) for r in rows], "table": table}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
