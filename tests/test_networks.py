"""Real networks on the embedded cluster (issue 32): each node a network namespace with a
management link to the controller and a data link to its peers, and link faults that are real.

The end-to-end tests need root and iproute2 (CI runs as root) and say so when they skip; the
layout, the fault commands and the fault plan's checks are pure and run everywhere."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from relaunch.cluster.linkwatch import still_cut
from relaunch.cluster.network import (
    ClusterNetwork,
    Layout,
    NamespaceGone,
    _used_prefixes,
    new_layout,
)
from relaunch.errors import FaultPlanError
from relaunch.events import EventKind
from relaunch.faults.plan import PlannedFaultKind, parse_plan
from relaunch.protocol.links import Cut, LinkFaultKind
from tests.runtime import DDP_CLUSTER, ROOT, Cluster, Result, ddp_job

# -- the layout and the fault commands (pure) ---------------------------------------------------


def layout(nodes: int = 4) -> Layout:
    return Layout("abcd1234", 101, 102, {f"node-{i}": i for i in range(nodes)})


def test_every_node_has_a_management_and_a_data_address_the_controller_the_first() -> None:
    net = layout()
    assert net.controller_address == "10.101.0.1"
    assert [net.mgmt_address(f"node-{i}") for i in range(4)] == [
        "10.101.0.2", "10.101.0.3", "10.101.0.4", "10.101.0.5",
    ]  # fmt: skip
    assert net.data_address("node-3") == "10.102.0.5"
    big = Layout("x", 101, 102, {"node-300": 300})
    assert big.data_address("node-300") == "10.102.1.46"  # 302 = 1 * 256 + 46
    assert net.namespace("node-2") == "rlabcd1234n2" and net.switch == "rlabcd1234sw"
    assert len(net.controller_link) <= 15  # an interface name's limit


def test_an_agent_probes_the_next_nodes_wrapping() -> None:
    net = layout(5)
    assert net.neighbours("node-0") == ["node-1", "node-2", "node-3"]
    assert net.neighbours("node-3") == ["node-4", "node-0", "node-1"]
    assert layout(2).neighbours("node-1") == ["node-0"]


def test_a_cut_from_the_peers_ends_only_when_the_data_link_answers_again() -> None:
    """A loaded machine answers late on both links: a beat without any answer neither starts nor
    ends a cut (an 8 s partition was once recorded as two)."""
    assert still_cut(False, data_answers=False, management_answers=True)
    assert still_cut(True, data_answers=False, management_answers=False)
    assert not still_cut(False, data_answers=False, management_answers=False)
    assert not still_cut(True, data_answers=True, management_answers=True)
    assert not still_cut(True, data_answers=True, management_answers=False)


def test_the_management_prefix_avoids_networks_the_machine_routes() -> None:
    table = (
        "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
        # 0.0.0.0/0 (default), 10.7.0.0/16, 10.64.0.0/12 (little-endian hex, as /proc shows it)
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eth0\t0000070A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
        "eth1\t0000400A\t00000000\t0001\t0\t0\t0\t0000F0FF\t0\t0\t0\n"
    )
    used = _used_prefixes(table)
    assert 7 in used and set(range(64, 80)) <= used  # the /12 covers 10.64 to 10.79
    assert 80 not in used and 8 not in used  # the default route does not count


def test_each_link_fault_is_the_kernels_own_mechanism() -> None:
    net = ClusterNetwork(Path("/nonexistent"), layout(3))

    def commands(kind: LinkFaultKind, cut: Cut | None = None, undo: bool = False) -> list[str]:
        steps = net.fault_commands("node-1", kind, cut, 2.0, undo)
        return [f"{ns or 'root'}: {tool} {c}" for ns, tool, cs in steps for c in cs]

    assert commands(LinkFaultKind.DOWN) == ["rlabcd1234sw: ip link set d1 down"]
    assert commands(LinkFaultKind.DOWN, undo=True) == ["rlabcd1234sw: ip link set d1 up"]
    assert commands(LinkFaultKind.PARTITION, Cut.CONTROLLER) == [
        "rlabcd1234n1: ip route add blackhole 10.101.0.1/32",
        "root: ip route add blackhole 10.101.0.3/32",
    ]
    peers = commands(LinkFaultKind.PARTITION, Cut.PEERS)
    assert "rlabcd1234n1: ip route add blackhole 10.102.0.2/32" in peers
    assert "rlabcd1234n1: ip route add blackhole 10.102.0.4/32" in peers
    both = commands(LinkFaultKind.PARTITION, Cut.BOTH, undo=True)
    assert "rlabcd1234n1: ip route del blackhole 10.101.0.1/32" in both
    assert "rlabcd1234n1: ip route del blackhole 10.102.0.2/32" in both
    degraded = commands(LinkFaultKind.DEGRADED)
    assert degraded == [
        "rlabcd1234n1: tc qdisc replace dev data0 root tbf rate 2mbit burst 32kbit latency 400ms",
        "rlabcd1234sw: tc qdisc replace dev d1 root tbf rate 2mbit burst 32kbit latency 400ms",
    ]


# -- the fault plan's link faults -------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "where", "says"),
    [
        ({"kind": "partition", "after_s": 1, "node": "node-1"}, "cut", "partition needs cut"),
        (
            {"kind": "partition", "after_s": 1, "node": "node-1", "cut": "everyone"},
            "cut",
            "'controller', 'peers', 'both'",
        ),
        ({"kind": "degraded-link", "at_step": 3, "pod": 1}, "rate_mbit", "needs rate_mbit"),
        (
            {"kind": "degraded-link", "at_step": 3, "pod": 1, "rate_mbit": 0},
            "rate_mbit",
            "above 0",
        ),
        (
            {"kind": "network", "at_step": 3, "pod": 1, "cut": "peers"},
            "cut",
            "cut only for partition",
        ),
        (
            {"kind": "hang", "at_step": 3, "pod": 1, "rate_mbit": 2},
            "rate_mbit",
            "rate_mbit only for degraded-link",
        ),
        (
            {"kind": "partition", "at_step": 3, "pod": 1, "cut": "peers", "duration_s": -1},
            "duration_s",
            "",
        ),
    ],
)
def test_a_bad_link_fault_is_refused_naming_the_key(
    entry: dict[str, Any], where: str, says: str
) -> None:
    with pytest.raises(FaultPlanError) as caught:
        parse_plan({"faults": [entry]})
    text = str(caught.value)
    assert f"faults[0].{where}" in text and says in text, text


def test_link_faults_say_what_they_do() -> None:
    plan = parse_plan(
        {
            "faults": [
                {"kind": "partition", "at_step": 5, "pod": 1, "cut": "peers", "duration_s": 15},
                {"kind": "partition", "after_s": 2, "node": "node-2", "cut": "both"},
                {"kind": "degraded-link", "at_step": 9, "pod": 0, "rate_mbit": 2.5},
                {"kind": "network", "at_step": 7, "pod": 0, "duration_s": 10},
            ]
        }
    )
    assert [e.kind for e in plan] == [
        PlannedFaultKind.PARTITION, PlannedFaultKind.PARTITION, PlannedFaultKind.DEGRADED_LINK, PlannedFaultKind.NETWORK,
    ]  # fmt: skip
    assert plan[0].cut is Cut.PEERS and plan[2].rate_mbit == 2.5
    assert [e.describe() for e in plan] == [
        "partition from its peers for 15 s on pod 1 at step 5",
        "partition from all on node node-2 after 2 s",
        "degraded link (2.5 Mbit/s) on pod 0 at step 9",
        "network for 10 s on pod 0 at step 7",
    ]


# -- end to end: real namespaces (root) -------------------------------------------------------


def _needs_namespaces() -> None:
    why = ClusterNetwork.unavailable()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why} (CI runs as root)")


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _links() -> set[str]:
    listed = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return {line.split()[0].split("@")[0] for line in listed.splitlines() if line.strip()}


def _routes(prefix: int) -> set[str]:
    listed = subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout
    return {line.strip() for line in listed.splitlines() if f"10.{prefix}." in line}


def assert_nothing_left(state: Path, timeout: float = 5.0) -> None:
    """No namespace, link or route of the cluster of `state` is left (the kernel frees a
    namespace's links a moment after its last process)."""
    layout = Layout.read(state / "network.json")
    assert layout is not None, "the cluster had no network"
    ours = f"rl{layout.digest}"
    deadline = time.monotonic() + timeout
    while True:
        left = {n for n in _namespaces() | _links() if n.startswith(ours)}
        left |= _routes(layout.mgmt)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"left behind: {sorted(left)}"


def test_each_node_is_a_network_host_and_its_links_go_with_the_cluster(tmp_path: Path) -> None:
    _needs_namespaces()
    opened = ClusterNetwork.open(tmp_path)
    assert isinstance(opened, ClusterNetwork), opened
    net = opened
    try:
        for node in ("node-0", "node-1", "node-2"):
            net.ensure_node(node)
        layout = net.layout

        def reach(node: str, address: str) -> str:
            import socket

            def probe() -> str:
                try:
                    socket.create_connection((address, 9), timeout=1).close()
                except ConnectionRefusedError:
                    return "reached"  # a host answered: nobody listens on port 9
                except OSError as error:
                    return f"cut ({error.strerror})"
                return "reached"

            return net.in_namespace(node, probe)

        assert reach("node-0", layout.controller_address) == "reached"
        assert reach("node-0", layout.data_address("node-2")) == "reached"
        net.apply("node-0", LinkFaultKind.PARTITION, Cut.PEERS)
        assert reach("node-0", layout.data_address("node-2")).startswith("cut")
        assert reach("node-2", layout.data_address("node-0")).startswith("cut")  # both ways
        assert reach("node-0", layout.controller_address) == "reached"
        assert reach("node-1", layout.data_address("node-2")) == "reached"
        net.apply("node-0", LinkFaultKind.PARTITION, Cut.PEERS, undo=True)
        assert reach("node-0", layout.data_address("node-2")) == "reached"
        assert net.free_port("node-1") > 0
    finally:
        net.remove()
    assert_nothing_left(tmp_path)


def test_a_fault_that_comes_after_its_cluster_was_removed_leaves_no_route(tmp_path: Path) -> None:
    """A fault plan's helper that applies its cut after `relaunch run` removed the cluster's
    network (the run ended meanwhile) changes nothing: before, the cut's blackhole route in the
    machine's own namespace outlived the cluster, a route nobody would remove again."""
    _needs_namespaces()
    opened = ClusterNetwork.open(tmp_path)
    assert isinstance(opened, ClusterNetwork), opened
    net = opened
    try:
        net.ensure_node("node-0")
        net.ensure_node("node-1")
    finally:
        net.remove()
    late = ClusterNetwork.existing(tmp_path)  # as the helper finds it: from network.json
    assert late is not None
    assert late.apply("node-1", LinkFaultKind.PARTITION, Cut.BOTH) is False
    assert not [r for r in _routes(late.layout.mgmt) if r.startswith("blackhole")]
    done = subprocess.run(
        [sys.executable, "-m", "relaunch.cluster.linkfault", "--state-dir", str(tmp_path),
         "--node", "node-1", "--kind", "partition", "--cut", "controller"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "network is gone" in done.stdout, done
    assert_nothing_left(tmp_path)


def _same_prefix_pair(base: Path) -> tuple[Path, Path]:
    """Two state directories whose digests pick the same management prefix first."""
    seen: dict[int, Path] = {}
    for i in range(1000):
        state = base / f"cluster-{i}"
        wanted = new_layout(state).mgmt
        if wanted in seen:
            return seen[wanted], state
        seen[wanted] = state
    raise AssertionError("no two of 1,000 names pick one prefix")  # 190 prefixes: cannot be


def test_two_clusters_started_at_once_reach_each_its_own_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clusters whose digests want one management prefix, opened at the same moment: the
    second chooses once the first's link is made, so each node reaches its own controller. Before,
    each chose before the other's route was there: two links of one /16 in the machine's
    namespace, and one cluster's agents never reached their controller (they ended, deleting
    their namespaces, and the controller died asking one for a port)."""
    _needs_namespaces()
    first_dir, second_dir = _same_prefix_pair(tmp_path)
    first_making, second_making = threading.Event(), threading.Event()
    make_links = ClusterNetwork._make_links

    def paced(net: ClusterNetwork) -> None:
        if net.state_dir == first_dir:  # the first waits (a while) for the second to choose
            first_making.set()
            second_making.wait(timeout=3)
        else:
            second_making.set()
        make_links(net)

    monkeypatch.setattr(ClusterNetwork, "_make_links", paced)
    opened: dict[Path, ClusterNetwork | str] = {}

    def open_one(state: Path) -> None:
        opened[state] = ClusterNetwork.open(state)

    first = threading.Thread(target=open_one, args=(first_dir,))
    first.start()
    first_making.wait(timeout=60)
    second = threading.Thread(target=open_one, args=(second_dir,))
    second.start()
    first.join()
    second.join()
    nets = [opened[first_dir], opened[second_dir]]
    try:
        assert all(isinstance(n, ClusterNetwork) for n in nets), nets
        a, b = (n for n in nets if isinstance(n, ClusterNetwork))
        assert a.layout.mgmt != b.layout.mgmt
        assert Layout.read(second_dir / "network.json") == b.layout  # what its agents read
        for net in (a, b):
            net.ensure_node("node-0")
            assert _seen_by_controller(net, "node-0") == net.layout.mgmt_address("node-0")
    finally:
        for net in nets:
            if isinstance(net, ClusterNetwork):
                net.remove()


def _seen_by_controller(net: ClusterNetwork, node: str) -> str:
    """The address the controller's end of the management link sees `node` connect from."""
    import socket

    with contextlib.closing(socket.socket()) as server:
        server.bind((net.layout.controller_address, 0))
        server.listen()
        server.settimeout(30)
        port = server.getsockname()[1]
        net.in_namespace(
            node,
            lambda: socket.create_connection((net.layout.controller_address, port), 30).close(),
        )
        conn, (host, _) = server.accept()
        conn.close()
        return str(host)


def test_a_node_whose_namespace_is_gone_is_named_and_the_engine_still_gives_a_port(
    tmp_path: Path,
) -> None:
    """A node's agent deletes its namespace on its way out: asking it for a port says which node
    and why; the embedded engine gives a port anyway (the launch there fails and the lost node's
    recovery asks again), where its controller once died of a bare FileNotFoundError."""
    _needs_namespaces()
    from relaunch.cluster.local import LocalCluster

    engine = LocalCluster(tmp_path)
    net = engine.network
    assert net is not None
    try:
        net.ensure_node("node-0")
        subprocess.run(["ip", "netns", "del", net.layout.namespace("node-0")], check=True)
        with pytest.raises(NamespaceGone, match=r"node node-0's network namespace .* is gone"):
            net.free_port("node-0")
        assert engine.free_port("node-0") > 0
    finally:
        net.remove()


CLUSTER = {**DDP_CLUSTER, "adopt_grace_s": 4}
"""4 nodes, heartbeats every 0.2 s, a node lost after 1.5 s of silence; a pod's lease (the
adopt grace) of 4 s."""


def run(cluster: Cluster, job: dict[str, Any], faults: list[dict[str, Any]]) -> Result:
    result = cluster.run(job, faults, CLUSTER, timeout=240, startup_s=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture
def unbroken(unbroken: str) -> str:
    """The session's fault-free DDP run (tests/conftest.py), where this machine can cut links."""
    _needs_namespaces()
    return unbroken


def test_r12_a_10_s_link_flap_and_a_partition_from_the_peers_are_ridden_out(
    cluster: Cluster, unbroken: str
) -> None:
    """The node's data link really goes down for 10 s (its carrier), then the node is cut from
    its peers for 8 s (blackhole routes): gloo's connections wait, the agent sees both and says
    so at once (no hang, though the 4 s hang window passes), and once they are back each is
    recorded as R-12 asks, not handled. No process restarts; the model is bit for bit the
    fault-free run's."""
    out = cluster.dir / "hash.txt"
    faults = [
        {"kind": "network", "at_step": 30, "pod": 1, "duration_s": 10},
        {"kind": "partition", "at_step": 70, "pod": 1, "cut": "peers", "duration_s": 8},
    ]
    result = run(cluster, ddp_job(out), faults)
    records = result.report["recoveries"]
    assert [(r["action"], r["fault"]["kind"]) for r in records] == [
        ("ignore", "network"), ("ignore", "network"),
    ], records  # fmt: skip
    flap, cut = (r["fault"] for r in records)
    assert flap["duration_s"] >= 9 and flap["detail"] == "carrier lost"
    assert cut["duration_s"] >= 7 and "peers do not answer" in cut["detail"]
    assert result.report["restarts_used"] == 0
    assert "relaunch: attempt 2" not in result.logs()
    assert out.read_text().strip() == unbroken
    assert_nothing_left(cluster.state)


def run_with(
    cluster: Cluster,
    job: dict[str, Any],
    faults: list[dict[str, Any]],
    blip_s: float | None = None,
    nodes: dict[str, Any] | None = None,
    during: Any = None,
) -> Result:
    """`relaunch run` of `job` on the test cluster, R-12's window set to `blip_s` (a fault
    table file); `during(proc)` runs while it does."""
    extra: tuple[str, ...] = ()
    if blip_s is not None:
        table = cluster.write("table.yaml", {"escalation": {"network_blip_seconds": blip_s}})
        extra = ("--fault-table", str(table))
    args = cluster.command(job, faults, nodes or CLUSTER, extra=extra, startup_s=60)
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        if during is not None:
            during(proc)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = cluster.result(proc.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture
def unbroken_process(unbroken_process_pair: str) -> str:
    """The session's fault-free run of the DDP example under process-level recovery."""
    _needs_namespaces()
    return unbroken_process_pair


def test_r12_r30_a_link_lost_past_the_blip_window_is_retried_by_the_sdk_once_it_is_back(
    cluster: Cluster, unbroken_process: str
) -> None:
    """The data link down for 8 s, R-12's window 3 s (the 60 s loss of the bench, in seconds):
    a network fault at 3 s, decided process-retry (R-30): every rank forms the group anew once
    the link is back and runs the interrupted step again. No process restarts; the retry is
    proved only by a step done after it began (not by a report of an earlier step held back
    meanwhile); bit-identical."""
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "network", "at_step": 30, "pod": 1, "duration_s": 8}]
    result = run_with(cluster, ddp_job(out, process=True), faults, blip_s=3)
    (record,) = result.report["recoveries"]
    assert (record["action"], record["outcome"]) == ("process-retry", "succeeded")
    assert record["fault"]["duration_s"] is None  # decided while still down
    assert record["mttr_s"] >= 7.5  # proved once the link was back, not before
    logs = result.logs()
    assert logs.count("--- relaunch: attempt") == 2  # one start a rank, no restart
    assert logs.count("rejoin at step") == 2
    assert out.read_text().strip() == unbroken_process


def test_r12_r20_r23_a_link_that_stays_down_fails_its_heal_and_the_pod_moves(
    cluster: Cluster, unbroken: str
) -> None:
    """Without the SDK's keeper: the data link down for 30 s, R-12's window 3 s. In-place
    recovery asks the agent to heal the link, which it cannot (the link is still down): the
    recovery fails and the pod moves off the node (R-23). Bit-identical."""
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "network", "at_step": 30, "pod": 1, "duration_s": 30}]
    result = run_with(cluster, ddp_job(out), faults, blip_s=3)
    records = result.report["recoveries"]
    assert [(r["action"], r["outcome"]) for r in records] == [
        ("in-place", "failed"), ("pod-reschedule", "succeeded"),
    ]  # fmt: skip
    assert records[1]["isolated_nodes"] == ["node-1"]
    failed = [(e.fields["action"], e.fields["why"]) for e in result.said(EventKind.RECOVERY_FAILED)]
    assert len(failed) == 1 and failed[0][0] == "in-place", failed
    assert "the link is still down" in failed[0][1], failed
    assert out.read_text().strip() == unbroken
    assert_nothing_left(cluster.state)


class Incarnations:
    """When each generation of pod 1's rank of the cluster in `state` was seen running (sampled
    every 20 ms). Only this cluster's: a test beside it (another pytest worker, a bench) may run
    the same script as pod 1, generation 1 too."""

    def __init__(self, state: Path) -> None:
        self.state = str(state)
        self.seen: dict[str, list[float]] = {}
        self.stop = threading.Event()

    def watch(self, proc: subprocess.Popen[str]) -> None:
        while proc.poll() is None and not self.stop.is_set():
            now = time.time()
            for process in psutil.process_iter(["cmdline"]):
                try:
                    if "train_ddp.py" not in " ".join(process.info["cmdline"] or []):
                        continue
                    env = process.environ()
                except psutil.Error:
                    continue
                if env.get("RELAUNCH_POD") != "1" or self.state not in env.get(
                    "RELAUNCH_WORKDIR", ""
                ):
                    continue
                span = self.seen.setdefault(env.get("RELAUNCH_GENERATION", "?"), [now, now])
                span[1] = now
            time.sleep(0.02)


def test_r14_a_node_cut_off_from_the_controller_stops_its_pod_before_the_replacement_starts(
    cluster: Cluster, unbroken: str
) -> None:
    """The node of pod 1 cut off from the controller (its management link) but running, its
    rank still talking to its peer: it falls silent, is lost, and its pod is moved. Its launcher
    hears nothing for its lease (4 s) and stops its rank; the replacement starts only after that
    lease and the grace: the two incarnations of rank 1 never run at the same time, and the job
    ends bit-identical. (A node cut from everything, data link too, is test_slurm.py's R-14.)"""
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "partition", "at_step": 30, "pod": 1, "cut": "controller", "duration_s": 60}]
    seen = Incarnations(cluster.state)
    result = run_with(cluster, ddp_job(out), faults, during=seen.watch)
    records = result.report["recoveries"]
    assert [(r["action"], r["fault"]["kind"]) for r in records] == [
        ("pod-reschedule", "node-lost")
    ], records
    assert records[0]["fault"]["detail"].startswith("silent")
    old, new = seen.seen["1"], seen.seen["2"]
    assert old[1] < new[0], f"the old incarnation ran until {old[1]}, the new one from {new[0]}"
    fenced = result.said(EventKind.FENCE_WAIT)
    assert [e.fields["node"] for e in fenced] == ["node-1"], result.events()
    old_launcher = (cluster.state / "jobs" / "1" / "pods" / "pod-1-g1" / "launcher.log").read_text()
    assert "no word from the controller" in old_launcher
    assert out.read_text().strip() == unbroken
    assert_nothing_left(cluster.state)


def test_a_degraded_link_is_found_slow_and_its_pod_moved(cluster: Cluster) -> None:
    """pod 1's node's data link limited to 0.25 Mbit/s: every rank waits on the network alike, so
    busy shares cannot tell; its agent's probes can (they queue behind the ranks' traffic on
    that link only). Found slow within the slow window (4 s here), the pod moves to a standby
    node (SubHealthFault with pod-level rescheduling on)."""
    out = cluster.dir / "hash.txt"
    # a quarter of a megabit: the probes queue far longer than a machine busy with a neighbouring
    # test delays the other nodes' answers (at 1 Mbit/s, beside another test file, its round trip
    # stayed under five times theirs)
    faults = [{"kind": "degraded-link", "at_step": 30, "pod": 1, "rate_mbit": 0.25}]
    job = ddp_job(out, steps=400)
    result = run_with(cluster, job, faults, nodes={**CLUSTER, "slow_window_s": 4})
    records = result.report["recoveries"]
    assert [(r["action"], r["fault"]["kind"], r["fault"]["pod"]) for r in records] == [
        ("pod-reschedule", "slow", 1)
    ], records
    assert "data link is slow" in records[0]["fault"]["detail"]
    assert records[0]["isolated_nodes"] == ["node-1"]
    assert out.read_text().strip()  # it finished (bit-identity after a move: test_ddp_exactly_once)


@pytest.mark.parametrize("sends", [True, False])
def test_a_flap_row_counts_only_where_the_cut_link_carried_the_systems_traffic(
    tmp_path: Path, sends: bool
) -> None:
    """Issue 49: torchft's flap row measured 65.4 s in one run and 0.03 s in another. The bench
    now reads the cut link's counters: a system whose traffic goes over node-1's data link
    (here: a sender on node-1 to node-0's data address until the cut) carried it before the
    flap and nothing while it was down; one that sends nothing there did not, and its row is
    not counted."""
    import socket
    import threading

    from relaunch_bench.jobs import FAULT_STEP
    from relaunch_bench.link_traffic import LinkTraffic, _fault_at_step, data_link_bytes

    _needs_namespaces()
    opened = ClusterNetwork.open(tmp_path)
    assert isinstance(opened, ClusterNetwork), opened
    net = opened
    stop = threading.Event()
    try:
        for node in ("node-0", "node-1"):
            net.ensure_node(node)
        assert data_link_bytes(net, "node-1") is not None
        target = (net.layout.data_address("node-0"), 9)
        sent = threading.Event()

        def send() -> None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                while not stop.is_set():
                    with contextlib.suppress(OSError):  # the link is down: nowhere to go
                        sock.sendto(b"x" * 1400, target)
                        sent.set()
                    stop.wait(0.001)

        sender = threading.Thread(target=lambda: net.in_namespace("node-1", send), daemon=True)
        timeline = tmp_path / "timeline.txt"
        agent = subprocess.Popen(["sleep", "60"])
        if sends:
            sender.start()
            assert sent.wait(10)

        def stepped() -> None:  # rank 0 passes the fault's step a moment later
            stop.wait(0.5)
            timeline.write_text(f"step {FAULT_STEP} {time.time()}\n")

        threading.Thread(target=stepped, daemon=True).start()
        traffic = _fault_at_step(net, {"kind": "network", "duration_s": 1.0}, timeline, [agent])
        deadline = time.monotonic() + 30
        while traffic.during_bytes is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the flap's end reads the counters before it undoes the cut
        agent.kill()
        agent.wait()
        assert isinstance(traffic, LinkTraffic) and traffic.during_bytes is not None
        assert traffic.carried is sends, traffic.describe()
        if not sends:
            assert "carried none of this system's collectives" in traffic.describe()
    finally:
        stop.set()
        net.remove()
    assert_nothing_left(tmp_path)


def test_link_traffic_counts_a_link_that_carried_and_then_stopped() -> None:
    from relaunch_bench.link_traffic import CARRIED_BYTES_PER_S, LinkTraffic

    assert LinkTraffic(50_000.0, 0).carried
    assert not LinkTraffic(CARRIED_BYTES_PER_S / 2, 0).carried  # it carried nothing
    assert not LinkTraffic(50_000.0, 10_000_000).carried  # traffic did not stop
    assert not LinkTraffic(None, 0).carried and "could not be read" in LinkTraffic().describe()
