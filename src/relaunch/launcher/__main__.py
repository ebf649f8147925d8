"""`python -m relaunch.launcher --state-dir DIR --plan FILE [--container CGROUP]`: a pod's
launcher (`--container`: the pod's cgroup, which the engine started it in)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from relaunch.containers import Cgroup
from relaunch.launcher.supervisor import Launcher
from relaunch.protocol.plans import LaunchPlan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="relaunch.launcher")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument(
        "--container", type=Path, help="the pod's cgroup (v2), which this launcher runs in"
    )
    args = parser.parse_args(argv)
    plan = LaunchPlan.from_json(args.plan.read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    container = Cgroup(args.container) if args.container is not None else None
    launcher = Launcher(args.state_dir, plan, container)
    try:
        launcher.run()
    finally:
        try:
            launcher.spares.kill()  # with the template, at once: each takes a while to end
            launcher.template.kill()
            launcher.spares.retire()
            launcher.stop(0.0)
            launcher.template.retire()
        finally:  # whatever the stop raised: nothing the pod started outlives it
            launcher.close_container()


if __name__ == "__main__":
    main()
