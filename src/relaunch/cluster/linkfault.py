"""A link fault for its duration, in a helper process of its own (the fault plan's `link-down`,
`partition`, `degraded`): applied now, undone after `--duration` seconds, so that the
controller's loop never waits for `ip` and a flap ends even if the controller dies. The links
and what a fault does to them: relaunch.cluster.network."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from relaunch.cluster.network import ClusterNetwork
from relaunch.protocol.links import Cut, LinkFaultKind

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """A link fault for its duration: applied now, undone after `--duration` seconds (none:
    left until the cluster's network is removed)."""
    parser = argparse.ArgumentParser(prog="python -m relaunch.cluster.linkfault")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--kind", choices=[k.value for k in LinkFaultKind], required=True)
    parser.add_argument("--cut", choices=[c.value for c in Cut], default=None)
    parser.add_argument("--rate-mbit", type=float, default=None)
    parser.add_argument("--duration", type=float, default=None)
    args = parser.parse_args(argv)
    network = ClusterNetwork.existing(args.state_dir)
    if network is None or args.node not in network.layout.nodes:
        sys.exit(f"no network for node {args.node} in {args.state_dir}")
    kind, cut = LinkFaultKind(args.kind), Cut(args.cut) if args.cut else None
    if not network.apply(args.node, kind, cut, args.rate_mbit):
        print(f"{time.time():.6f} the cluster's network is gone: no {kind.value}", flush=True)
        return
    print(f"{time.time():.6f} applied {kind.value} on {args.node}", flush=True)
    if args.duration is None:
        return
    time.sleep(args.duration)
    network.apply(args.node, kind, cut, args.rate_mbit, undo=True)
    print(f"{time.time():.6f} undone {kind.value} on {args.node}", flush=True)


if __name__ == "__main__":
    main()
