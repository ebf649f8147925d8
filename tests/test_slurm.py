"""The Slurm engine: `relaunch run --engine slurm` inside an allocation of a real Slurm cluster.

The cluster is Debian's Slurm started by the test (`cluster.slurm_trial`: its own munged,
slurmctld and one slurmd per node, each node a network namespace); the job is submitted with
`sbatch` as a user would, from a batch script written from docs/slurm.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import relaunch.cluster.slurm as slurm_engine
from relaunch.cli import app
from relaunch.cluster.slurm import Allocation, parse_nodes
from relaunch.cluster.slurm_trial import TrialSlurm, unavailable
from relaunch.containers import cluster_root
from relaunch.errors import EngineError
from relaunch.events import EventKind, Recorded
from relaunch.restores import restores
from relaunch.states import StopCause
from relaunch.store import JobStatus, Store
from tests.runtime import (
    DDP_CLUSTER,
    DDP_FAULTS,
    ROOT,
    Result,
    assert_issued_again_nothing_restarted,
    ddp_job,
    flap_pod_1_at_step_40,
    pod_1_node_at_step_40,
    wait_gone,
)
from tests.test_networks import Incarnations
from tests.test_operator_retry import ddp as ddp_command
from tests.test_operator_retry import job as operator_retry_job
from tests.test_process_recovery import assert_kept, process_job, starts

NODES = ["n1", "n2", "n3", "n4"]
"""Two for the job's pods, two standby nodes, as the embedded tests' four nodes."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
EMBEDDED_ACTIONS = ["job-reschedule", "in-place", "pod-reschedule", "hang-restart"]
"""What the embedded cluster decides for the DDP example's fault plan (test_sdk_bit_identical)."""

SCONTROL = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=10.9.0.2 NodeHostName=vm "
    "State=IDLE ThreadsPerCore=1 Reason=\n"
    "NodeName=n2 Arch=x86_64 NodeAddr=10.9.0.3 State=MIXED+DRAIN "
    "Reason=relaunch: isolated: node-lost (node n2) [root@2026-11-27T10:00:00]\n"
    "NodeName=n3 NodeAddr=10.9.0.4 State=DOWN* Reason=Not responding\n"
    "NodeName=n4 NodeAddr=10.9.0.5 State=ALLOCATED\n"
)
SCONTROL_UP = "NodeName=n1 NodeAddr=10.9.0.2 State=IDLE\nNodeName=n2 NodeAddr=10.9.0.3 State=IDLE\n"


def test_scontrol_nodes_parsed_with_slurms_states_as_lost_or_not() -> None:
    nodes = parse_nodes(SCONTROL)
    assert [n.address for n in nodes.values()] == ["10.9.0.2", "10.9.0.3", "10.9.0.4", "10.9.0.5"]
    assert {name: n.lost for name, n in nodes.items()} == {
        "n1": False,
        "n2": True,  # draining: Slurm takes it out
        "n3": True,
        "n4": False,
    }
    assert nodes["n2"].reason.startswith("relaunch: isolated: node-lost (node n2)")


def test_a_lost_node_says_what_slurm_saw_and_an_administrators_drain_is_named_as_such() -> None:
    said = parse_nodes(
        SCONTROL + "NodeName=n5 State=IDLE+DRAIN Reason=maint window [root@2026-12-01T10:00:00]\n"
    )
    assert said["n5"].lost and said["n5"].seen == "drained by the administrator: maint window"
    assert said["n5"].drained_by_someone_else
    assert not said["n2"].drained_by_someone_else  # relaunch's own drain is not an administrator's
    assert said["n2"].seen.startswith("Slurm marks it MIXED+DRAIN: relaunch: isolated")
    assert said["n3"].seen == "Slurm marks it DOWN*: Not responding"


def test_at_the_end_a_taken_out_nodes_step_is_cancelled_first_and_its_srun_not_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A node cut off (isolated) never hears the job's end, and its srun lasts until Slurm marks
    the node down: its step is cancelled before the others are waited for, and its srun is
    killed, not waited for; a healthy node's agent ends on its own. Slurm's commands are
    stand-ins here (what they were asked is the test); the srun's are real processes. The real
    cut node: test_r14_... below."""
    asked: list[list[str]] = []

    def scontrol(args: list[str], timeout: float = 0.0) -> str:
        asked.append(args)
        return "5.0 relaunch-agent-n1\n5.1 relaunch-agent-n2\n" if args[0] == "squeue" else ""

    monkeypatch.setattr(slurm_engine, "_slurm", scontrol)
    monkeypatch.setattr(slurm_engine, "node_states", lambda names: parse_nodes(SCONTROL_UP))
    engine = slurm_engine.SlurmCluster(tmp_path, Allocation("5", ("n1", "n2"), "n1"), 3600.0)
    ends = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    healthy, cut = subprocess.Popen(ends), subprocess.Popen(["sleep", "600"])
    engine.steps = {"n1": healthy, "n2": cut}
    assert engine.isolate_node("n2", "lost and isolated: node-lost (node n2)") is None
    engine.shutdown()
    assert cut.returncode == -signal.SIGKILL, "the cut node's srun was left"
    assert healthy.returncode == 0, "a healthy agent's step was cut short"
    cancels = [args for args in asked if args[0] == "scancel"]
    assert cancels[0] == ["scancel", "5.1"], asked  # before the healthy step is waited for


def test_outside_an_allocation_the_slurm_engine_says_how_to_run_it(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    with pytest.raises(EngineError, match="inside a Slurm allocation"):
        Allocation.from_environment(environ)
    runner = CliRunner()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(ddp_job(tmp_path / "hash.txt", 10)))
    result = runner.invoke(
        app,
        ["run", "--engine", "slurm", str(job), "--state-dir", str(tmp_path / "state")],
        env={"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": ""},
    )
    assert result.exit_code == 2, result.output
    assert "sbatch script or an salloc shell" in result.output


@pytest.fixture(scope="module")
def trial_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrialSlurm]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"needs a trial Slurm cluster: {why}")
    trial = TrialSlurm(tmp_path_factory.mktemp("slurm"), NODES).start()
    yield trial
    trial.stop()


@pytest.fixture
def slurm(trial_slurm: TrialSlurm) -> Iterator[TrialSlurm]:
    """The module's Slurm cluster; the nodes a test's job drained are returned after it."""
    yield trial_slurm
    drained = trial_slurm.slurm(["sinfo", "-h", "-R", "-o", "%n"]).stdout.split()
    for node in drained:
        trial_slurm.slurm(["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def batch_script(
    tmp: Path,
    job: dict[str, Any],
    faults: list[dict[str, Any]],
    nodes: int = len(NODES),
    body: str = "relaunch run --engine slurm $JOB $FILES --startup-seconds 60 --quiet",
    header: str = "",
    cluster_settings: dict[str, Any] | None = None,
) -> Path:
    """The job, its fault plan and the cluster's timings as files, and the sbatch script that
    runs them (docs/slurm.md's, with the trial cluster's data interface for gloo)."""
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp / "faults.yaml").write_text(yaml.safe_dump({"faults": faults}))
    cluster = {k: v for k, v in DDP_CLUSTER.items() if k != "nodes"} | (cluster_settings or {})
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    script = tmp / "job.sh"
    script.write_text(
        f"""#!/bin/bash
#SBATCH --nodes={nodes}
#SBATCH --output={tmp / "out.txt"}
#SBATCH --open-mode=append
{header}
export PATH={Path(sys.executable).parent}:$PATH
export GLOO_SOCKET_IFNAME=mgmt0
cd {ROOT}
JOB={tmp / "job.yaml"}
STATE={tmp / "state"}
FILES="--cluster {tmp / "cluster.yaml"} --faults {tmp / "faults.yaml"} --state-dir $STATE \\
    --report {tmp / "report.json"}"
{body}
"""
    )
    return script


def sbatch(slurm: TrialSlurm, script: Path) -> int:
    """Submit the script and wait for its job's end; the job's exit code."""
    job_id = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
    fields = wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    return int(fields["ExitCode"].split(":")[0])


@pytest.mark.parametrize("tier", ["peer-memory", "bad-peer-memory-then-local-disk"])
def test_ddp_example_on_slurm_same_decisions_bit_identical_nothing_left(
    slurm: TrialSlurm, tmp_path: Path, unbroken: str, tier: str
) -> None:
    """The DDP example's faults (a crash, a chip fault that heals, a lost node, a hang) inside a
    Slurm allocation: the embedded cluster's decisions, one record each, every one worked; the
    parameters bit-identical to a fault-free run; the lost node drained in Slurm with
    relaunch's reason; no step of relaunch's, no cgroup and no process left after the job.
    With `peer_memory_mb`: each rank's checkpoint also goes to another node's agent (a process
    srun started, as every agent here), and the pod moved off the lost node restores from a
    peer's memory, on record, as on the embedded cluster (test_peer_memory.py). With
    `local_checkpoint_dir` too, and every node's peer memory gone bad from the first step (the
    fault plan's `peer-copy-corrupt`, one byte of every copy flipped): each rank refuses its
    copies in peers' memory (their checksum) and takes the next tier, its node's disk; a rank
    restarted on the node that saved restores from there, the moved pod from storage, and the
    job's end leaves no copy but the lost node's (test_local_copies.py)."""
    out = tmp_path / "hash.txt"
    body = """relaunch run --engine slurm $JOB $FILES --startup-seconds 60 --quiet
code=$?
COLUMNS=200 relaunch nodes --engine slurm --state-dir $STATE
exit $code"""
    job = ddp_job(out, 10)
    disks = tmp_path / "node-disks"
    job["spec"]["peer_memory_mb"] = 16
    faults = DDP_FAULTS
    if tier != "peer-memory":
        job["spec"]["local_checkpoint_dir"] = str(disks)
        bad = [{"kind": "peer-copy-corrupt", "at_step": 1, "node": node} for node in NODES]
        faults = bad + DDP_FAULTS
    code = sbatch(slurm, batch_script(tmp_path, job, faults, body=body))
    log = (tmp_path / "out.txt").read_text()
    report = json.loads((tmp_path / "report.json").read_text())
    result = Result(code, report, log, "", tmp_path / "state")
    assert code == 0, log
    assert result.actions == EMBEDDED_ACTIONS, log
    assert all(r["outcome"] == "succeeded" for r in report["recoveries"]), log
    assert out.read_text().strip() == unbroken, log
    events = result.events()
    disk = "local-disk"
    if tier == "peer-memory":
        lost = next(i for i, e in enumerate(events) if e.fields.get("fault") == "node-lost")
        moved = [r for r in restores(events[lost:]) if (r["pod"], r["rank"]) == (1, 1)]
        assert moved and moved[0]["tier"] == "peer-memory", events
        assert moved[0]["holder"] in ("n1", "n3", "n4"), events
        # at every level (job-level, in-place, pod-level, hang-restart) both pods restore from
        # a peer's memory; after the crash, the crashed rank's copy may have died with it
        served = [tiers_after(events, n) for n in range(len(decisions(events)))]
        assert len(served) == 4 and all(sorted(by_pod) == [0, 1] for by_pod in served), events
        assert all(
            served_by[0] == "peer-memory" or (n, pod, served_by) == (0, 1, ("storage", ""))
            for n, by_pod in enumerate(served)
            for pod, served_by in by_pod.items()
        ), served
    else:  # each pod's rank restores where it saved, but the moved pod's, from storage
        assert not [r for r in restores(events) if r["tier"] == "peer-memory"], events
        refusals = re.findall(r"the copy in n\d's memory was refused: [^\n]*", result.logs())
        assert refusals and all("checksum" in r for r in refusals), refusals
        assert [tiers_after(events, n) for n in range(len(decisions(events)))] == [
            {0: (disk, "n1"), 1: tiers_after(events, 0)[1]},
            {0: (disk, "n1"), 1: (disk, "n2")},
            {0: (disk, "n1"), 1: ("storage", "")},
            {0: (disk, "n1"), 1: (disk, result.launch_nodes()[-1])},
        ], events
        # the crashed rank's copy of its last step may have died with it (no dying gasp for a
        # crash: the copy is made in the background after the save); then storage serves
        assert tiers_after(events, 0)[1] in ((disk, "n2"), ("storage", "")), events
        left = {p.relative_to(disks).parts[:2] for p in disks.rglob("*.ckpt")}
        assert left == {("n2", "job-1")}, left  # the lost node's: its agent died with it
    assert (
        "n2 relaunch: lost and isolated: node-lost"
        in slurm.slurm(["sinfo", "-R", "-h", "-o", "%n %E"]).stdout
    )
    assert slurm.slurm(["squeue", "-h", "-s"]).stdout.strip() == ""
    root = cluster_root(tmp_path / "state")
    assert root is None or not root.path.exists()
    assert not wait_gone(tmp_path / "state", timeout=5)
    # `relaunch nodes --engine slurm`, inside the allocation: Slurm's state beside relaunch's
    row = next(line for line in log.splitlines() if line.strip().startswith("n2 "))
    assert "DRAIN" in row and "Lost" in row and "relaunch: lost and isolated" in row, row


def decisions(events: list[Recorded]) -> list[int]:
    """Where in the record each decision is."""
    return [i for i, e in enumerate(events) if e.kind is EventKind.DECISION]


def tiers_after(events: list[Recorded], decision: int) -> dict[int, tuple[str, str]]:
    """Which tier (and node) served each pod's restore after the record's `decision`th decision
    (one rank a pod), up to the next decision."""
    at = [*decisions(events), len(events)]
    return {
        r["pod"]: (r["tier"], r["holder"])
        for r in restores(events[at[decision] : at[decision + 1]])
    }


def job_state(slurm: TrialSlurm, job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields of `job_id`."""
    line = slurm.slurm(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


def wait_for_job(slurm: TrialSlurm, job_id: str, done: Any, timeout: float = 400) -> dict[str, str]:
    """Poll the job until `done(fields)`; its fields then."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_state(slurm, job_id)
        if done(fields):
            return fields
        assert time.monotonic() < deadline, fields
        time.sleep(0.5)


def test_controller_killed_and_resumed_inside_the_allocation_keeps_job_and_records(
    slurm: TrialSlurm, tmp_path: Path, unbroken: str
) -> None:
    """The controller killed (SIGKILL) after a crash was recovered, then `relaunch run
    --resume` in the same batch script: the agents' steps and the pods carry on, the job ends
    bit-identical with its one record, and nothing of relaunch's is left in the allocation."""
    out = tmp_path / "hash.txt"
    faults = [{"kind": "process-exit", "at_step": 20, "pod": 1, "rank": 1, "exit_code": 1}]
    logs = f"{tmp_path}/state/jobs/*/pods/*/logs/*.log"
    body = f"""relaunch run --engine slurm $JOB $FILES --startup-seconds 60 --quiet &
controller=$!
until grep -qs "step 60" {logs}; do sleep 0.2; done
kill -9 $controller
relaunch run --resume --state-dir $STATE --report {tmp_path / "report.json"} --quiet"""
    code = sbatch(slurm, batch_script(tmp_path, ddp_job(out, 10), faults, body=body))
    log = (tmp_path / "out.txt").read_text()
    assert code == 0, log
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["action"] for r in report["recoveries"]] == ["job-reschedule"], log
    assert "controller resumed job" in log, log
    assert out.read_text().strip() == unbroken, log
    assert slurm.slurm(["squeue", "-h", "-s"]).stdout.strip() == ""


def test_r44_no_spare_left_the_job_stops_requeues_and_resumes_from_its_checkpoint(
    slurm: TrialSlurm, tmp_path: Path, unbroken: str
) -> None:
    """Two nodes for two pods, and one lost: no level has a node left, so the job stops
    `(waiting for nodes)` and relaunch exits 3; the batch script (docs/slurm.md's) requeues
    its job on that code, and in the new allocation (the drained node left out) `relaunch run
    --resume` rebuilds the job from its checkpoints: bit-identical, no restart spent."""
    out = tmp_path / "hash.txt"
    faults = [{"kind": "node-down", "at_step": 70, "pod": 1}]
    body = """if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  relaunch run --resume --state-dir $STATE --report REPORT --quiet
else
  relaunch run --engine slurm $JOB $FILES --startup-seconds 60 --quiet
fi
code=$?
if [ $code -eq 3 ]; then scontrol requeue $SLURM_JOB_ID; fi
exit $code""".replace("REPORT", str(tmp_path / "report.json"))
    header = "#SBATCH --requeue\n#SBATCH --no-kill"
    script = batch_script(tmp_path, ddp_job(out, 10), faults, 2, body, header)
    submitted = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip()
    job_id = submitted.split(";")[0]
    # Slurm holds the requeued job back while its last credential lives (the trial cluster's
    # cred_expire): forced to start sooner, it may land where that credential is revoked, and fail
    wait_for_job(slurm, job_id, lambda f: f.get("Restarts") == "1")
    fields = wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    log = (tmp_path / "out.txt").read_text()
    ctld = (slurm.home / "log" / "slurmctld.log").read_text()[-4000:]
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{log}\n{ctld}"
    (row,) = Store(tmp_path / "state" / "relaunch.db").jobs()
    restarted = [
        e.fields["cause"]
        for e in Store(tmp_path / "state" / "relaunch.db").events(row.id)
        if e.kind is EventKind.RESTARTED_FROM_CHECKPOINTS
    ]
    assert restarted == ["wants-nodes"], log
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["action"] for r in report["recoveries"]] == ["fail", "job-reschedule"], log
    assert report["recoveries"][-1]["outcome"] == "succeeded", log
    assert out.read_text().strip() == unbroken, log
    assert "n2" not in fields["NodeList"], fields


class SlurmJob:
    """A submitted job as `Incarnations.watch` polls a process: running until it ends."""

    def __init__(self, slurm: TrialSlurm, job_id: str) -> None:
        self.slurm, self.job_id = slurm, job_id

    def poll(self) -> int | None:
        return 0 if job_state(self.slurm, self.job_id).get("JobState") in ENDED else None


def test_r14_a_node_cut_off_is_fenced_before_its_replacement_starts_and_slurm_keeps_the_job(
    slurm: TrialSlurm, tmp_path: Path, unbroken: str
) -> None:
    """Pod 1's node cut off from every other node (its link down) but running: the controller
    finds it silent and moves its pod; the cut pod hears nothing for its lease (4 s) and stops
    its rank before the replacement starts (R-14); Slurm, which marks the node down too, keeps
    the job (`--no-kill`); the job ends bit-identical."""
    out = tmp_path / "hash.txt"
    script = batch_script(
        tmp_path, ddp_job(out, 10), [], header="#SBATCH --no-kill",
        cluster_settings={"adopt_grace_s": 4},
    )  # fmt: skip
    job_id = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
    seen = Incarnations(tmp_path / "state")
    watcher = threading.Thread(target=seen.watch, args=(SlurmJob(slurm, job_id),), daemon=True)
    watcher.start()
    logs = tmp_path / "state" / "jobs" / "1" / "pods"
    node = pod_1_node_at_step_40(tmp_path)
    slurm.cut_node(node)
    try:
        fields = wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    finally:
        slurm.cut_node(node, cut=False)
    watcher.join(timeout=10)
    log = (tmp_path / "out.txt").read_text()
    assert fields["JobState"] == "COMPLETED", log
    report = json.loads((tmp_path / "report.json").read_text())
    records = report["recoveries"]
    assert [(r["action"], r["fault"]["kind"]) for r in records] == [
        ("pod-reschedule", "node-lost")
    ], log
    old, new = seen.seen["1"], seen.seen["2"]
    assert old[1] < new[0], f"the old incarnation ran until {old[1]}, the new one from {new[0]}"
    assert "no word from the controller" in (logs / "pod-1-g1" / "launcher.log").read_text()
    assert out.read_text().strip() == unbroken, log


PROCESS_FAULTS = [
    {"kind": "memory-uce", "at_step": 30, "pod": 0, "code": "80E01801", "heals": True},
    {"kind": "process-exit", "at_step": 60, "pod": 0, "rank": 1, "exit_code": 1},
    {"kind": "node-down", "at_step": 90, "pod": 1},
]
"""One fault per process level, as the embedded cluster's tests decide each
(test_process_recovery: R-30, R-31, R-32)."""


def test_each_process_level_on_slurm_as_on_the_embedded_cluster(
    slurm: TrialSlurm, tmp_path: Path
) -> None:
    """The DDP example with process-level recovery (2 pods x 2 ranks): a memory UCE retried
    online by every rank, a crashed rank restarted in place, a lost node's pod moved while the
    other keeps running; one record each, each worked, the untouched ranks never restarted."""
    out = tmp_path / "hash.txt"
    job = process_job(out, extra="--step-seconds 0.1")
    code = sbatch(slurm, batch_script(tmp_path, job, PROCESS_FAULTS))
    log = (tmp_path / "out.txt").read_text()
    assert code == 0, log
    report = json.loads((tmp_path / "report.json").read_text())
    records = report["recoveries"]
    assert [r["action"] for r in records] == [
        "process-retry", "process-in-place", "process-reschedule",
    ], log  # fmt: skip
    assert all(r["outcome"] == "succeeded" for r in records), log
    assert report["restarts_used"] == 0, log
    found = starts(Result(code, report, log, "", tmp_path / "state"))
    assert_kept(found, [0])  # rank 0: one process from start to end
    assert out.read_text().strip()


def test_a_slow_pod_on_slurm_moves_to_the_standby_node(slurm: TrialSlurm, tmp_path: Path) -> None:
    """Pod 1 made 6 times slower at step 20: found slow from its busy share and moved to a
    standby node (pod-level rescheduling), as on the embedded cluster (test_diagnosis)."""
    job = ddp_job(tmp_path / "hash.txt", 10)
    job["spec"]["command"] = job["spec"]["command"].replace("--steps 120", "--steps 200")
    faults = [{"kind": "slow", "at_step": 20, "pod": 1, "factor": 6}]
    script = batch_script(
        tmp_path, job, faults, cluster_settings={"slow_window_s": 3, "slow_margin": 0.3}
    )
    code = sbatch(slurm, script)
    log = (tmp_path / "out.txt").read_text()
    assert code == 0, log
    first = json.loads((tmp_path / "report.json").read_text())["recoveries"][0]
    assert (first["fault"]["kind"], first["fault"]["pod"]) == ("slow", 1), log
    assert (first["action"], first["outcome"]) == ("pod-reschedule", "succeeded"), log


def test_r29_a_flap_of_the_data_network_on_slurm_issues_the_collective_again_nothing_restarts(
    slurm: TrialSlurm, tmp_path: Path, unbroken_process_pair: str
) -> None:
    """The ranks' collectives on the nodes' data network (`GLOO_SOCKET_IFNAME=data0`, as a user
    points NCCL at InfiniBand), the agents and Slurm on the management network: pod 1's node's
    data link down for 6 s in the middle of training. The SDK's report of the failed collective
    travels its launcher's path to the controller, as on the embedded cluster
    (test_operator_retry): the collective is issued again once the link is back, no process
    restarts, no step runs twice, and the job ends bit-identical to the fault-free run."""
    out, steps = tmp_path / "hash.txt", tmp_path / "steps.txt"
    spec = operator_retry_job(f"{ddp_command(out, steps)} --step-seconds 0.1")
    spec["spec"]["env"]["GLOO_SOCKET_IFNAME"] = "data0"
    script = batch_script(tmp_path, spec, [])
    job_id = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
    flap_pod_1_at_step_40(tmp_path, lambda node, up: slurm.set_data_link(node, up=up))
    fields = wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    log = (tmp_path / "out.txt").read_text()
    assert fields["JobState"] == "COMPLETED", log
    report = json.loads((tmp_path / "report.json").read_text())
    result = Result(0, report, log, "", tmp_path / "state")
    assert_issued_again_nothing_restarted(result, steps, out, unbroken_process_pair)


@pytest.mark.parametrize("form", ["torchrun", "job file"])
def test_a_pod_is_a_nodes_share_of_the_job_one_pod_per_node(
    slurm: TrialSlurm, tmp_path: Path, form: str
) -> None:
    """docs/slurm.md's script with `--nnodes 2 --nproc-per-node 1` (and a job file of two pods of
    one process) in a 3-node allocation: each pod on a node of its own, the third the standby,
    as torchrun's --nnodes counts nodes. Before: both pods on the batch host, whose loss was then
    every pod and the controller at once."""
    script_args = "examples/train_toy.py --steps 5"
    if form == "torchrun":
        body = (
            "relaunch run --engine slurm --cluster "
            f"{tmp_path / 'cluster.yaml'} --state-dir $STATE --report {tmp_path / 'report.json'} "
            f"--quiet --nnodes 2 --nproc-per-node 1 {script_args}"
        )
    else:
        body = "relaunch run --engine slurm $JOB $FILES --quiet"
    job = {
        "kind": "job",
        "metadata": {"name": "share"},
        "spec": {"replicas": 2, "procs_per_pod": 1, "command": f"python {script_args}"},
    }
    code = sbatch(slurm, batch_script(tmp_path, job, [], nodes=3, body=body))
    log = (tmp_path / "out.txt").read_text()
    assert code == 0, log
    result = Result(code, {}, log, "", tmp_path / "state")
    placed = result.launch_nodes()
    assert len(placed) == 2 and len(set(placed)) == 2, placed
    assert set(placed) <= {"n1", "n2", "n3"}, placed  # the allocation's, not n4


def test_an_administrators_drain_is_its_own_observation_and_keeps_its_reason(
    slurm: TrialSlurm, tmp_path: Path, unbroken: str
) -> None:
    """`scontrol update NodeName=X State=DRAIN Reason=maint` on pod 1's node while the job
    trains: the node is lost as drained by the administrator, with the reason, on record; the
    pod moves (a dying gasp first: its processes still run) and the job ends bit-identical; and
    Slurm still says `maint`, not a reason of relaunch's written over it."""
    out = tmp_path / "hash.txt"
    script = batch_script(tmp_path, ddp_job(out, 10), [])
    job_id = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
    node = pod_1_node_at_step_40(tmp_path)
    slurm.slurm(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=maint"])
    fields = wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    log = (tmp_path / "out.txt").read_text()
    assert fields["JobState"] == "COMPLETED", log
    (record,) = json.loads((tmp_path / "report.json").read_text())["recoveries"]
    assert (record["fault"]["kind"], record["fault"]["node"]) == ("node-lost", node), record
    assert "drained by the administrator: maint" in record["fault"]["detail"], record
    assert record["action"] == "pod-reschedule" and record["outcome"] == "succeeded", record
    reasons = dict(
        line.split(" ", 1)
        for line in slurm.slurm(["sinfo", "-R", "-h", "-o", "%n %E"]).stdout.splitlines()
    )
    assert reasons.get(node) == "maint", reasons
    assert out.read_text().strip() == unbroken, log


SCANCEL_BODY = """relaunch run --engine slurm $JOB $FILES --startup-seconds 60 &
pid=$!
trap 'kill -TERM $pid' TERM
wait $pid; code=$?
while kill -0 $pid 2>/dev/null; do wait $pid; code=$?; done
exit $code"""
"""docs/slurm.md's script's way of running relaunch: in the background, so that scancel's
SIGTERM to the batch shell is passed on and the shell waits for the orderly stop."""


def test_scancel_stops_the_job_in_order(slurm: TrialSlurm, tmp_path: Path) -> None:
    """`scancel JOB` of the docs' script while the job trains: relaunch hears SIGTERM and
    stops the job in order (its record says so, its summary is printed, exit 143), and
    nothing of the job runs on after it: no launcher or rank waiting out its lease on nodes
    Slurm already treats as free. Before: bash died at once, slurmstepd killed the controller
    0.15 s later with no record, and the pods ran on for the adopt grace."""
    job = ddp_job(tmp_path / "hash.txt", 10)
    job["metadata"]["labels"]["grace-over-time"] = "1"
    job["spec"]["command"] = f"python {ROOT / 'examples' / 'train_toy.py'} --steps 100000"
    script = batch_script(tmp_path, job, [], body=SCANCEL_BODY)
    job_id = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
    pod_1_node_at_step_40(tmp_path)
    slurm.slurm(["scancel", job_id])
    wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    log = (tmp_path / "out.txt").read_text()
    left = wait_gone(tmp_path / "state", timeout=10)
    assert not left, [p.cmdline() for p in left]
    assert "Stopped: job" in log and "(SIGTERM)" in log, log[-3000:]
    store = Store(tmp_path / "state" / "relaunch.db")
    (row,) = store.jobs()
    assert row.status is JobStatus.STOPPED and row.stop_cause is StopCause.SIGTERM, row


def test_a_lost_batch_host_comes_back_by_the_requeue_docs_slurm_md_says(
    slurm: TrialSlurm, tmp_path: Path, unbroken: str
) -> None:
    """Every process of the batch host killed (the controller with it) under `--no-kill
    --requeue`: Slurm removes the node, keeps the job RUNNING without its batch script, and
    nothing of relaunch is left in the allocation to bring it back (the agents' steps ended
    with their sruns, on the batch host; the pods elsewhere stop at their lease). What
    docs/slurm.md tells the user to run, `scontrol requeue JOB`, carries the job on: the
    requeued script's `relaunch run --resume` resumes it from its checkpoints in an allocation
    without the lost node, bit-identical, the first run's record kept."""
    out = tmp_path / "hash.txt"
    body = """if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  relaunch run --resume --state-dir $STATE --report REPORT --quiet
else
  relaunch run --engine slurm $JOB $FILES --startup-seconds 60 --quiet
fi""".replace("REPORT", str(tmp_path / "report.json"))
    header = "#SBATCH --requeue\n#SBATCH --no-kill"
    script = batch_script(tmp_path, ddp_job(out, 10), [], 3, body, header)
    job_id = slurm.slurm(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
    pod_1_node_at_step_40(tmp_path)
    batch_host = job_state(slurm, job_id)["BatchHost"]
    slurm.kill_node(batch_host)
    # what slurmctld does by itself once the node misses its pings (about 25 s here), at once
    down = ["scontrol", "update", f"NodeName={batch_host}", "State=DOWN", "Reason=died"]
    slurm.slurm(down)
    try:
        left = wait_for_job(slurm, job_id, lambda f: batch_host not in hostnames(slurm, f))
        assert left["JobState"] == "RUNNING", left  # Slurm keeps it, with no batch script
        slurm.slurm(["scontrol", "requeue", job_id])  # docs/slurm.md: "A lost batch host"
        fields = wait_for_job(slurm, job_id, lambda f: f.get("JobState") in ENDED)
    finally:
        slurm.start_node(batch_host)
        slurm.wait_idle()
    log = (tmp_path / "out.txt").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{log}"
    assert batch_host not in hostnames(slurm, fields), fields
    assert "resumed job" in log, log
    assert out.read_text().strip() == unbroken, log


def hostnames(slurm: TrialSlurm, fields: dict[str, str]) -> list[str]:
    """The nodes of a job's NodeList, each by name (`n[2-3]` is n2, n3)."""
    listed = fields.get("NodeList", "")
    if not listed or listed == "(null)":
        return []
    return slurm.slurm(["scontrol", "show", "hostnames", listed]).stdout.split()
