"""How fast a lost node is noticed: Ray's GCS with relaunch's settings vs Ray's defaults, and
relaunch's detection on Ray vs on the embedded cluster, measured side by side in one run.

1. Ray alone (a local trial cluster of 4 nodes in a loopback-only network namespace): a node's
   raylet is SIGKILLed (crash) or SIGSTOPped (hang); the time until `ray.nodes()` marks it dead,
   with relaunch's GCS health-check settings and with Ray's defaults.
2. relaunch end to end: the toy job (pod-level rescheduling) loses a node (`node-down`); the
   record's detection time (fault injected -> node declared lost) on Ray, with the agents'
   heartbeat timeout raised to 20 s so that only Ray can see it in time, and on the embedded
   cluster with its default heartbeat timeout (3 s) and the short one of cluster-small.yaml
   (1.5 s).

Needs root (network namespace). Run: .venv/bin/python benchmarks/ray_detection.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relaunch.cluster.config import NodeSpec  # noqa: E402
from relaunch.cluster.ray import (  # noqa: E402
    HEALTH_CHECK,
    LoopbackNamespace,
    TrialCluster,
    connect,
    discover,
)


def raylet_of(trial: TrialCluster, node: str) -> psutil.Process:
    root = psutil.Process(trial.procs[node].pid)
    return next(p for p in root.children(recursive=True) if p.name() == "raylet")


def declared_dead_after(node_id: str, since: float, limit: float = 180) -> float:
    import ray

    while time.time() - since < limit:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return time.time() - since
        time.sleep(0.05)
    return float("inf")


def ray_alone(settings: dict[str, str], repeats: int, hang_repeats: int) -> dict[str, list[float]]:
    """Inside the namespace: crash and hang detection by Ray's GCS with `settings`."""
    nodes = tuple(NodeSpec(f"node-{i}", 2) for i in range(4))
    trial = TrialCluster(nodes, health_check=settings)
    results: dict[str, list[float]] = {"crash": [], "hang": []}
    try:
        trial.start()
        for kind, count in (("crash", repeats), ("hang", hang_repeats)):
            for _ in range(count):
                trial.heal()
                time.sleep(6)  # a node that just joined is not health-checked at once
                target = next(n for n in discover() if n.name == "node-1")
                raylet = raylet_of(trial, "node-1")
                at = time.time()
                if kind == "crash":
                    raylet.send_signal(signal.SIGKILL)
                else:
                    raylet.suspend()
                results[kind].append(declared_dead_after(target.node_id, at))
                if kind == "hang":
                    raylet.resume()
                print(f"  {kind}: {results[kind][-1]:.2f} s", flush=True)
                trial.remove_node("node-1")
    finally:
        trial.stop()
    return results


def toy(steps: int = 150) -> dict[str, Any]:
    return {
        "kind": "job",
        "metadata": {
            "name": "detect",
            "annotations": {
                "fault-tolerance/job-retry-num": "4",
                "fault-tolerance/pod-retry-num": "2",
            },
        },
        "spec": {
            "replicas": 2,
            "procs_per_pod": 2,
            "chips_per_pod": 2,
            "command": f"python {ROOT / 'examples' / 'train_toy.py'} --steps {steps} "
            "--step-seconds 0.03",
        },
    }


def relaunch_detect(
    tmp: Path, engine: list[str], cluster: dict[str, Any], prefix: list[str]
) -> float:
    tmp.mkdir(parents=True)
    (tmp / "job.yaml").write_text(yaml.safe_dump(toy()))
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    (tmp / "faults.yaml").write_text(
        yaml.safe_dump({"faults": [{"kind": "node-down", "at_step": 20, "pod": 1}]})
    )
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "relaunch", "run", str(tmp / "job.yaml"),
         "--cluster", str(tmp / "cluster.yaml"), "--faults", str(tmp / "faults.yaml"),
         "--state-dir", str(tmp / "state"), "--report", str(tmp / "report.json"), "-q", *engine],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stdout + done.stderr)
    record = json.loads((tmp / "report.json").read_text())["recoveries"][0]
    assert record["action"] == "pod-reschedule", record
    return float(record["detect_s"])


def inside(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    for label, settings in (("relaunch settings", HEALTH_CHECK), ("Ray defaults", {})):
        print(f"Ray alone, {label}:", flush=True)
        out[label] = ray_alone(settings, args.repeats, args.repeats if settings else 1)
    shape = {"nodes": 4, "chips_per_node": 2, "heartbeat_interval_s": 0.5}
    with tempfile.TemporaryDirectory() as d:
        nodes = tuple(NodeSpec(f"node-{i}", 2) for i in range(4))
        trial = TrialCluster(nodes)
        address = trial.start()
        connect(address)
        runs: dict[str, list[float]] = {"ray (agent timeout 20 s)": [], "embedded (3 s)": [],
                                        "embedded (1.5 s)": []}  # fmt: skip
        try:
            for i in range(args.repeats):
                trial.heal()
                runs["ray (agent timeout 20 s)"].append(
                    relaunch_detect(
                        Path(d) / f"ray-{i}",
                        ["--engine", "ray", "--address", address],
                        {**shape, "heartbeat_timeout_s": 20},
                        [],
                    )  # fmt: skip
                )
                runs["embedded (3 s)"].append(
                    relaunch_detect(
                        Path(d) / f"emb-{i}", [], {**shape, "heartbeat_timeout_s": 3}, []
                    )
                )
                runs["embedded (1.5 s)"].append(
                    relaunch_detect(
                        Path(d) / f"emb15-{i}", [], {**shape, "heartbeat_timeout_s": 1.5}, []
                    )  # fmt: skip
                )
                print({k: f"{v[-1]:.2f}" for k, v in runs.items()}, flush=True)
        finally:
            trial.stop()
        out["relaunch"] = runs
    Path(args.json).write_text(json.dumps(out, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "ray_detection.json")
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return
    namespace = LoopbackNamespace(f"relaunch-bench-{os.getpid()}").create()
    try:
        subprocess.run(
            namespace.command([sys.executable, __file__, "--inside", "--repeats",
                               str(args.repeats), "--json", args.json]),
            check=True,
        )  # fmt: skip
    finally:
        namespace.remove()
    data = json.loads(Path(args.json).read_text())
    print("\nnode declared dead (s), median [min-max]:")
    for label in ("relaunch settings", "Ray defaults"):
        for kind, values in data[label].items():
            print(f"  Ray GCS, {label:17s} {kind:5s}: {statistics.median(values):6.2f} "
                  f"[{min(values):.2f}-{max(values):.2f}] n={len(values)}")  # fmt: skip
    print("relaunch detection of a node-down (fault -> node lost), s:")
    for label, values in data["relaunch"].items():
        print(f"  {label:26s}: {statistics.median(values):6.2f} "
              f"[{min(values):.2f}-{max(values):.2f}] n={len(values)}")  # fmt: skip


if __name__ == "__main__":
    main()
