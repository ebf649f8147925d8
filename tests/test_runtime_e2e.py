"""End to end: real jobs with real fault plans on the embedded cluster, one or more per policy.

Every test runs `relaunch run` in a subprocess with real node agents, launchers and workers, reads
the JSON report, and checks afterwards that no process of the run is left.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest

from relaunch.store import NodeState, Store
from tests.runtime import (
    AUTO,
    FAST_CLUSTER,
    HANG,
    HANG_S,
    POD_LEVEL,
    ROOT,
    Cluster,
    toy_job,
)


def start_counters(logs: str) -> list[tuple[int, int, int]]:
    """(rank, MA_SCHEDULE_CNT, MA_PROC_START_CNT) as each process saw them, in log order."""
    return [
        (int(m[1]), int(m[2]), int(m[3]))
        for m in re.finditer(
            r"start: rank (\d+)/\d+ MA_SCHEDULE_CNT=(\d+) MA_PROC_START_CNT=(\d+)", logs
        )
    ]


def test_fault_free_run_succeeds_with_no_records(cluster: Cluster) -> None:
    result = cluster.run(toy_job(AUTO, steps=20))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.report["status"] == "Succeeded" and result.report["recoveries"] == []
    assert [p["node"] for p in result.report["pods"]] == ["node-0", "node-1"]
    assert sorted(start_counters(result.logs())) == [(r, 1, 1) for r in range(4)]


# -- R-20 ---------------------------------------------------------------------------------------

HEALING_CHIP_FAULT = {
    "kind": "chip-fault",
    "at_step": 10,
    "pod": 1,
    "chip": 0,
    "code": "80E18005",
    "heals": True,
}


def test_r20_chip_fault_heals_in_place_without_consuming_restarts(cluster: Cluster) -> None:
    result = cluster.run(toy_job(AUTO), [HEALING_CHIP_FAULT])
    assert result.returncode == 0, result.stdout
    assert result.actions == ["in-place"]
    record = result.report["recoveries"][0]
    assert record["fault"]["code"] == "80E18005" and record["fault"]["node"] == "node-1"
    assert record["outcome"] == "succeeded" and record["mttr_s"] is not None
    assert result.report["restarts_used"] == 0 and result.report["isolated_nodes"] == []
    # every container ran the start command a second time; nothing was rescheduled.
    assert [(p["schedule_count"], p["proc_start_count"]) for p in result.report["pods"]] == [
        (1, 2),
        (1, 2),
    ]
    # the toy's ranks do not wait for each other: the fault is due at the furthest rank's step
    # 10, and a rank a loaded machine started late can be restarted before its first line
    seen = set(start_counters(result.logs()))
    assert {(r, 1, 2) for r in range(4)} <= seen <= {(r, 1, n) for r in range(4) for n in (1, 2)}


def test_a_chip_fault_and_its_heal_are_sent_at_once_not_at_the_next_heartbeat(
    cluster: Cluster,
) -> None:
    """Agents beat every 30 s here: a 40-step job would end long before a beat carried the
    fault (no recovery at all), and the healed node would stay faulty until the next one. Both
    go at once, so the fault is healed in place as with fast beats and the node is Ready."""
    slow_beats = {**FAST_CLUSTER, "heartbeat_interval_s": 30, "heartbeat_timeout_s": 120}
    result = cluster.run(toy_job(AUTO), [HEALING_CHIP_FAULT], slow_beats)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["in-place"], result.stdout
    assert result.report["recoveries"][0]["outcome"] == "succeeded"
    assert result.report["restarts_used"] == 0 and result.report["isolated_nodes"] == []
    healed = Store(result.state_dir / "relaunch.db").node("node-1")
    assert healed is not None and healed.state is NodeState.READY, healed


def test_r20_heal_fails_isolate_and_rebuild_at_job_level(cluster: Cluster) -> None:
    faults = [
        {
            "kind": "chip-fault",
            "at_step": 10,
            "pod": 1,
            "chip": 1,
            "code": "80E18005",
            "heals": False,
        }
    ]
    result = cluster.run(toy_job(AUTO), faults)
    assert result.returncode == 0, result.stdout
    assert result.actions == ["in-place", "isolated-job-reschedule"]
    assert [r["outcome"] for r in result.report["recoveries"]] == ["failed", "succeeded"]
    assert result.report["isolated_nodes"] == ["node-1"] and result.report["restarts_used"] == 1
    assert [p["node"] for p in result.report["pods"]] == ["node-0", "node-2"]


# R-10, R-11, R-21, R-02, R-26 and R-24's row of hangs: tests/test_ladder_sequences.py (and
# test_restart_storm.py) drive the controller through each row on its simulator.


# -- R-22 / R-23 --------------------------------------------------------------------------------------


def test_r22_node_down_isolates_and_rebuilds_the_job_on_a_standby_node(cluster: Cluster) -> None:
    faults = [{"kind": "node-down", "at_step": 10, "pod": 1}]
    result = cluster.run(toy_job(AUTO), faults)
    assert result.returncode == 0, result.stdout
    assert result.actions == ["isolated-job-reschedule"]
    record = result.report["recoveries"][0]
    assert record["fault"]["kind"] == "node-lost" and record["isolated_nodes"] == ["node-1"]
    assert record["detect_s"] >= 0 and record["mttr_s"] > record["detect_s"]
    assert result.report["isolated_nodes"] == ["node-1"]
    first = result.launch_nodes()[:2]
    assert first == ["node-0", "node-1"] and "node-1" not in result.launch_nodes()[2:]
    # the rebuilt job is a second scheduling for every pod.
    assert [(p["schedule_count"], p["proc_start_count"]) for p in result.report["pods"]] == [
        (2, 1),
        (2, 1),
    ]


def test_r23_only_the_lost_pod_moves_and_healthy_pods_keep_their_container(
    cluster: Cluster,
) -> None:
    faults = [{"kind": "node-down", "at_step": 10, "pod": 1}]
    result = cluster.run(toy_job(POD_LEVEL), faults)
    assert result.returncode == 0, result.stdout
    assert result.actions == ["pod-reschedule"]
    pods = result.report["pods"]
    assert (
        pods[0]["node"] == "node-0" and pods[0]["generation"] == 1
    )  # same container, same workdir
    assert pods[0]["workdir"].endswith("pod-0-g1")
    assert pods[1]["node"] == "node-2" and pods[1]["generation"] == 2
    assert [(p["schedule_count"], p["proc_start_count"]) for p in pods] == [(1, 2), (2, 1)]
    assert result.report["pod_restarts_used"] == 1 and result.report["restarts_used"] == 0
    seen = set(start_counters(result.logs()))
    assert {(0, 1, 2), (1, 1, 2), (2, 2, 1), (3, 2, 1)} <= seen
    reschedules = result.report["reschedules"]  # as MindCluster keeps them
    assert reschedules["total"] == 1
    [entry] = reschedules["records"]
    assert entry["action"] == "pod-reschedule" and entry["at"] is not None
    assert entry["pods"] == [{"reason": "NodeUnhealthy", "pod": "e2e-pod-1", "node": "node-1",
                              "rank": None}]  # fmt: skip


def test_r23_no_standby_node_falls_back_to_job_level(cluster: Cluster) -> None:
    # Three 2-chip pods fill node-0, node-1 and one of node-2's two slots: no standby node, but a
    # rebuilt job fits on node-0 and node-2.
    shape = {
        **FAST_CLUSTER,
        "nodes": [
            {"name": "node-0", "chips": 2},
            {"name": "node-1", "chips": 2},
            {"name": "node-2", "chips": 4},
        ],
    }
    faults = [{"kind": "node-down", "at_step": 10, "pod": 1}]
    result = cluster.run(toy_job(POD_LEVEL, replicas=3), faults, shape)
    assert result.returncode == 0, result.stdout
    assert result.actions == ["isolated-job-reschedule"]
    assert "node-1" not in [p["node"] for p in result.report["pods"]]


# -- a lost node: an agent that died, an agent that lives but is silent -----------------------------


def test_a_node_whose_agent_died_is_lost_at_once_not_at_its_heartbeat_timeout(
    cluster: Cluster,
) -> None:
    """node-down kills node-1's agent and its pod: the engine sees the agent exit (a pidfd) and
    the node is lost then, though its heartbeat timeout (120 s) is twice the run's limit."""
    shape = {**FAST_CLUSTER, "heartbeat_timeout_s": 120}
    faults = [{"kind": "node-down", "at_step": 10, "pod": 1}]
    result = cluster.run(toy_job(POD_LEVEL), faults, shape, timeout=60)
    result.assert_pod_moved_off_lost_node("node-1", "the engine reports the node dead")


def test_a_node_whose_agent_lives_but_is_silent_is_lost_at_its_heartbeat_timeout(
    cluster: Cluster,
) -> None:
    """node-1's agent stopped (SIGSTOP): alive, so the engine has nothing to say; its silence
    for the heartbeat timeout (1 s) loses the node, and only pod 1 moves."""
    job = toy_job(POD_LEVEL, steps=300)
    run = subprocess.Popen(
        cluster.command(job), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    result = cluster.signal_agent_at_step(run, 5, "node-1", signal.SIGSTOP)
    result.assert_pod_moved_off_lost_node("node-1", "no heartbeat for 1 s")


# -- R-24 -------------------------------------------------------------------------------------------


def test_r24_sigstop_hang_restarts_in_place_once_the_window_passed(cluster: Cluster) -> None:
    """A real SIGSTOP found by the real launcher's sampling: never before the hang window (how
    soon after it, a pass at most, is the simulator's: test_controller_unit.py,
    test_a_hang_restarts_in_place_with_the_hang_grace; a busy machine stretches it here)."""
    faults = [{"kind": "hang", "at_step": 10, "pod": 0, "rank": 1}]
    result = cluster.run(toy_job(HANG), faults)
    assert result.returncode == 0, result.stdout
    assert result.actions == ["hang-restart"]
    record = result.report["recoveries"][0]
    assert record["fault"]["kind"] == "hang" and record["fault"]["rank"] == 1
    # silence starts at the rank's last report, up to a step before the SIGSTOP
    assert record["detect_s"] >= HANG_S - 0.25
    assert result.report["restarts_used"] == 0
    assert [p["proc_start_count"] for p in result.report["pods"]] == [2, 2]


def test_r24_a_script_that_hangs_at_every_start_fails_after_three_restarts_upon_suspension(
    cluster: Cluster,
) -> None:
    """A user's script that hangs at every start (it sleeps: no step, no line, no computation),
    with hang-retry: three restarts upon suspension, then Failed naming R-24, as seed 001 says
    (before: one restart, then "hang-restart did not recover it"). The same on every ladder, on
    the simulator: test_restart_storm.py."""
    job = toy_job(HANG, replicas=1)
    job["spec"]["command"] = "sleep 600"
    result = cluster.run(job, startup_s=2, timeout=150)
    assert result.returncode == 1, result.stdout[-3000:]
    assert result.actions == ["hang-restart"] * 3 + ["fail"], result.actions
    assert "in a row (R-24)" in result.report["reason"], result.report["reason"]
    assert result.report["restarts_used"] == 0


# -- bad input -------------------------------------------------------------------------------------


def test_bad_job_plan_or_cluster_file_exits_2_with_a_clear_message(cluster: Cluster) -> None:
    import subprocess
    import sys

    from tests.runtime import ROOT

    bad_plan = [{"kind": "meteor", "at_step": 1, "pod": 0}]
    for args in (
        cluster.command({"kind": "job", "spec": {}}),
        cluster.command(toy_job(AUTO), bad_plan),
        cluster.command(toy_job(AUTO), None, {"nodes": 0}),
    ):
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=30, cwd=ROOT, check=False
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr and "error:" in done.stderr
    assert sys.executable


# -- memory and network faults ----------------------------------------------------------------------


def test_r20_memory_uce_recovers_in_place(cluster: Cluster) -> None:
    faults = [{"kind": "memory-uce", "at_step": 10, "pod": 1, "chip": 1}]
    result = cluster.run(toy_job(AUTO), faults)
    assert result.returncode == 0, result.stdout
    assert result.actions == ["in-place"]
    fault = result.report["recoveries"][0]["fault"]
    assert fault["kind"] == "memory-uce" and fault["code"] == "80E01801" and fault["chip"] == 1


@pytest.mark.parametrize("network", ["namespaces", "loopback"])
def test_r12_short_link_fault_is_recorded_and_a_long_one_recovered(
    cluster: Cluster, network: str
) -> None:
    """With real networks (each node a namespace: the data link really goes down) and on the
    shared loopback (the agent simulates the link): a link down for less than R-12's window is
    recorded, one down longer is handled. A real link still down when in-place recovery asks
    the agent to heal it is not healed: the ladder goes on and moves the job off the node."""
    import os
    import subprocess

    from relaunch.cluster.network import NETWORK_ENV, ClusterNetwork
    from tests.runtime import ROOT

    if network == "namespaces" and ClusterNetwork.unavailable() is not None:
        pytest.skip(f"needs network namespaces: {ClusterNetwork.unavailable()} (CI runs as root)")
    table = cluster.write("table.yaml", {"escalation": {"network_blip_seconds": 1}})
    faults = [
        {"kind": "network", "at_step": 8, "pod": 1, "duration_s": 0.3},
        {"kind": "network", "at_step": 16, "pod": 1, "duration_s": 30},
    ]
    job = toy_job(AUTO, steps=80, args="--step-seconds 0.05")
    args = [*cluster.command(job, faults), "--fault-table", str(table)]
    env = {**os.environ, NETWORK_ENV: "loopback" if network == "loopback" else ""}
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=90, cwd=ROOT, check=False, env=env
    )
    result = cluster.result(done.returncode, done.stdout, done.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    short, long = (r["fault"] for r in result.report["recoveries"][:2])
    assert long["duration_s"] is None
    if network == "loopback":
        assert "nodes share the loopback" in result.stdout
        assert result.actions == ["ignore", "in-place"]
        assert short["duration_s"] == 0.3
    else:
        assert "nodes are network namespaces" in result.stdout
        assert result.actions == ["ignore", "in-place", "isolated-job-reschedule"]
        outcomes = [r["outcome"] for r in result.report["recoveries"]]
        assert outcomes == ["succeeded", "failed", "succeeded"]
        assert short["duration_s"] > 0 and short["detail"] == "carrier lost"


# -- torchrun's contract (R-06) ---------------------------------------------------------------------


def test_r06_every_rank_gets_torchrun_s_whole_environment_and_counts_as_torchelastic_launched(
    cluster: Cluster,
) -> None:
    """The same script under torchrun and under relaunch (1 pod of 2 ranks): the same variables,
    the same values where they do not depend on the launch (run id, port, restart budget, the
    error file's path, and the agent store, which relaunch does not run), and torch's
    `is_torchelastic_launched()` true in every rank."""
    import subprocess
    import sys

    from tests.runtime import ROOT

    script = ROOT / "tests" / "scripts" / "dump_env.py"
    under_torchrun = cluster.dir / "torchrun"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(under_torchrun)],
        check=True, capture_output=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    under_relaunch = cluster.dir / "relaunch"
    job = toy_job(AUTO, replicas=1)
    job["spec"]["command"] = f"python {script} {under_relaunch}"
    result = cluster.run(job)
    assert result.returncode == 0, result.stdout + result.stderr
    launch_dependent = {
        "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
    }  # fmt: skip
    for rank in (0, 1):
        theirs = json.loads((under_torchrun / f"rank-{rank}.json").read_text())
        ours = json.loads((under_relaunch / f"rank-{rank}.json").read_text())
        assert theirs["launched"] and ours["launched"]
        assert set(theirs["env"]) <= set(ours["env"]), set(theirs["env"]) - set(ours["env"])
        for name, value in theirs["env"].items():
            if name not in launch_dependent:
                assert ours["env"][name] == value, (name, ours["env"][name], value)
        assert ours["env"]["TORCHELASTIC_RUN_ID"] == f"e2e-{result.report['id']}"
        assert ours["env"]["TORCHELASTIC_MAX_RESTARTS"] == "4"
        assert ours["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        # each node is a host of its own to NCCL, though the embedded cluster's share a machine
        assert ours["env"]["NCCL_HOSTID"] == "relaunch-node-0"
