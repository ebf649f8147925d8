"""What a launcher's usage sample of a rank costs: read from the rank's cgroup (cpu.stat, the pids
of cgroup.procs) against the /proc walk it replaces (the whole process table for the children,
then each of the rank's processes), measured side by side in one run, alternated.

A rank here is a Python that has started `--children` helpers (as a data loader's workers would);
`--others` idle processes stand for the rest of a busy machine (the walk reads them all).

Needs root or a delegated cgroup. Run: .venv/bin/python benchmarks/cgroup_usage.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from relaunch.containers import ClusterCgroups
from relaunch.launcher.processes import cgroup_usage, children_by_parent, tree_usage

RANK = """
import subprocess, sys, time
helpers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
           for _ in range(int(sys.argv[1]))]
time.sleep(600)
"""


def per_call_ms(call: object, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        call()  # type: ignore[operator]
    return (time.perf_counter() - start) / rounds * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--others", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterCgroups.probe(Path(tmp))
        if isinstance(cluster, str):
            sys.exit(f"needs cgroups: {cluster}")
        rank_cgroup = cluster.pod("node-0", 1, 0, 1).child("rank-0").make()
        others = [
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            for _ in range(args.others)
        ]
        rank = subprocess.Popen(
            [sys.executable, "-c", RANK, str(args.children)], preexec_fn=rank_cgroup.join
        )
        try:
            while len(psutil.Process(rank.pid).children()) < args.children:
                time.sleep(0.05)
            processes = len(psutil.pids())
            walk, read = [], []
            for _ in range(args.pairs):
                walk.append(
                    per_call_ms(lambda: tree_usage(rank.pid, children_by_parent()), args.rounds)
                )
                read.append(per_call_ms(lambda: cgroup_usage(rank_cgroup), args.rounds))
        finally:
            for proc in [rank, *others]:
                proc.kill()
                proc.wait()
            cluster.shutdown()
    result = {
        "processes_on_the_machine": processes,
        "rank_processes": 1 + args.children,
        "proc_walk_ms": [round(x, 3) for x in walk],
        "cgroup_ms": [round(x, 3) for x in read],
        "proc_walk_median_ms": round(statistics.median(walk), 3),
        "cgroup_median_ms": round(statistics.median(read), 3),
        "ratio_cgroup_to_walk": round(statistics.median(read) / statistics.median(walk), 3),
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
