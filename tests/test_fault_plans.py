"""Fault plans: an entry that cannot hit its target is refused before the job starts, and one
whose target is gone by the time it is due is recorded as not fired, holding nothing back.

The pure check (`relaunch.faults.plan.check_plan`) is tested entry by entry; `relaunch run`, `relaunch
validate --faults` and `relaunch submit` are run as a user runs them; the run-time behaviour on
the embedded cluster with real agents and launchers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.cluster.agent import Agent
from relaunch.cluster.config import parse_cluster
from relaunch.errors import FaultPlanError
from relaunch.events import EventKind
from relaunch.faults.plan import check_plan, parse_plan
from relaunch.protocol.messages import InjectChipFault, Injected, Message
from relaunch.spec import parse_job
from tests.runtime import ROOT, TOY, UNCONDITIONAL, Cluster, processes_of, toy_job

# The setting: 2 pods x 1 process on 3 nodes of 1 chip.
JOB = {
    "kind": "job",
    "metadata": {"name": "plan", "annotations": UNCONDITIONAL},
    "spec": {
        "replicas": 2,
        "procs_per_pod": 1,
        "command": f"python {TOY} --steps 400 --step-seconds 0.05",
        "hang_detect_seconds": 3,
    },
}
CLUSTER = {"nodes": 3, "chips_per_node": 1, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1}


def problems(entries: list[dict[str, Any]], job: dict[str, Any] = JOB) -> dict[str, str]:
    """key -> message of every problem the plan has against `job` on CLUSTER."""
    try:
        plan = parse_plan({"faults": entries})
    except FaultPlanError as error:
        return {p.key: str(p) for p in error.problems}
    found = check_plan(plan, parse_job(job), parse_cluster(CLUSTER))
    return {p.key: str(p) for p in found}


# -- the pure check, one bad input at a time ------------------------------------------------------


def test_plan_rank_not_held_by_its_pod_names_the_ranks_the_pod_holds() -> None:
    found = problems([{"kind": "process-exit", "after_s": 1, "pod": 1, "rank": 0}])
    assert list(found) == ["faults[0].rank"]
    assert "a global rank that pod 1 holds: 1" in found["faults[0].rank"]
    assert "local_rank" in found["faults[0].rank"]


def test_plan_pod_out_of_range_names_the_allowed_range() -> None:
    found = problems([{"kind": "process-exit", "after_s": 1, "pod": 5}])
    assert found == {"faults[0].pod": found["faults[0].pod"]}
    assert "0 to 1" in found["faults[0].pod"]


def test_plan_chip_the_nodes_lack_is_refused() -> None:
    found = problems([{"kind": "chip-fault", "after_s": 1, "pod": 0, "chip": 7}])
    assert list(found) == ["faults[0].chip"]
    assert "from 0 to 0" in found["faults[0].chip"]
    found = problems([{"kind": "memory-uce", "after_s": 1, "node": "node-2", "chip": 1}])
    assert "node node-2 has 1 chip(s)" in found["faults[0].chip"]


def test_plan_unknown_node_names_the_known_nodes() -> None:
    found = problems([{"kind": "node-down", "after_s": 1, "node": "node-42"}])
    assert list(found) == ["faults[0].node"]
    assert "node-0, node-1, node-2" in found["faults[0].node"]


def test_plan_local_rank_is_within_the_pod_and_rank_is_global() -> None:
    job = {**JOB, "spec": {**JOB["spec"], "procs_per_pod": 2, "chips_per_pod": 1}}
    ok = parse_plan(
        [
            {"kind": "hang", "after_s": 1, "pod": 1, "local_rank": 1},
            {"kind": "hang", "after_s": 2, "pod": 1, "rank": 3},
            {"kind": "process-exit", "after_s": 3, "pod": 1},
        ]
    )
    assert check_plan(ok, parse_job(job), parse_cluster(CLUSTER)) == []
    assert [e.target_rank(2) for e in ok] == [3, 3, 2]
    bad = problems([{"kind": "hang", "after_s": 1, "pod": 0, "local_rank": 2}], job)
    assert "a rank within the pod: 0 to 1" in bad["faults[0].local_rank"]
    both = problems([{"kind": "hang", "after_s": 1, "pod": 0, "rank": 0, "local_rank": 0}], job)
    assert "either rank (global) or local_rank" in both["faults[0].local_rank"]


@pytest.mark.parametrize(
    "entry, key",
    [
        ({"kind": "hang", "after_s": 1, "pod": 0, "exit_code": 3}, "exit_code"),
        ({"kind": "node-down", "after_s": 1, "pod": 0, "chip": 0}, "chip"),
        ({"kind": "chip-fault", "after_s": 1, "pod": 0, "duration_s": 5}, "duration_s"),
        ({"kind": "node-down", "after_s": 1, "node": "node-1", "rank": 0}, "rank"),
        ({"kind": "process-exit", "after_s": 1, "pod": 0, "heals": False}, "heals"),
        ({"kind": "network", "after_s": 1, "pod": 0, "code": "80E18005"}, "code"),
        ({"kind": "hang", "after_s": float("nan"), "pod": 0}, "after_s"),
        ({"kind": "hang", "after_s": float("inf"), "pod": 0}, "after_s"),
        ({"kind": "hang", "at_step": 10**13, "pod": 0}, "at_step"),
        ({"kind": "hang", "at_step": "9" * 400, "pod": 0}, "at_step"),
        ({"kind": "process-exit", "after_s": 1, "pod": 0, "exit_code": 0}, "exit_code"),
        ({"kind": "process-exit", "after_s": 1, "node": "node-0"}, "pod"),
        ({"kind": "chip-fault", "after_s": 1, "pod": 0, "node": "node-0"}, "pod"),
        ({"kind": "chip-fault", "pod": 0}, "at_step"),
        ({"kind": "slow", "after_s": 1, "pod": 0, "factor": 1}, "factor"),
        ({"kind": "slow", "after_s": 1, "pod": 0, "factor": 0.5}, "factor"),
        ({"kind": "slow", "after_s": 1, "pod": 0, "factor": 101}, "factor"),
        ({"kind": "slow", "after_s": 1, "pod": 0, "factor": "fast"}, "factor"),
        ({"kind": "slow", "after_s": 1, "pod": 0, "factor": True}, "factor"),
        ({"kind": "slow", "after_s": 1, "pod": 0, "rank": 0}, "rank"),
        ({"kind": "slow", "after_s": 1, "node": "node-0"}, "pod"),
        ({"kind": "hang", "after_s": 1, "pod": 0, "factor": 3}, "factor"),
        ({"kind": "hang", "at_step": 1, "pod": 0, "while_saving": "yes"}, "while_saving"),
        ({"kind": "hang", "at_step": 1, "pod": 0, "while_saving": 1}, "while_saving"),
        ({"kind": "hang", "at_step": 1, "pod": 0, "while_saving": None}, "while_saving"),
        ({"kind": "peer-copy-corrupt", "at_step": 1, "node": "node-1", "chip": 0}, "chip"),
        ({"kind": "peer-copy-corrupt", "at_step": 1, "pod": 0, "rank": 0}, "rank"),
        ({"kind": "peer-copy-corrupt", "at_step": 1, "pod": 0, "node": "node-1"}, "pod"),
        ({"kind": "peer-copy-corrupt", "at_step": 1, "pod": 0, "duration_s": 5}, "duration_s"),
    ],
)
def test_plan_key_that_means_nothing_or_is_out_of_bounds_is_refused(
    entry: dict[str, Any], key: str
) -> None:
    found = problems([entry])
    assert f"faults[0].{key}" in found, found


def test_plan_peer_copy_corrupt_needs_a_job_that_keeps_copies_in_peer_memory() -> None:
    entry = {"kind": "peer-copy-corrupt", "at_step": 30, "node": "node-1"}
    found = problems([entry])
    assert list(found) == ["faults[0].kind"], found
    assert (
        "keeps no checkpoint copies in peer memory (spec.peer_memory_mb)" in found["faults[0].kind"]
    )
    keeps = {**JOB, "spec": {**JOB["spec"], "peer_memory_mb": 16}}
    assert problems([entry, {"kind": "peer-copy-corrupt", "at_step": 30, "pod": 1}], keeps) == {}
    (parsed,) = parse_plan([entry])
    assert (
        parsed.describe()
        == "peer memory corrupted (one byte of each copy) on node node-1 at step 30"
    )
    assert not parsed.targets_process


def test_plan_while_saving_waits_for_its_step_and_a_save() -> None:
    """`while_saving`: due only once its step is reached and a rank says it saves; an entry
    without it does not care what the ranks do."""
    entry, plain = parse_plan(
        [
            {"kind": "memory-uce", "at_step": 40, "pod": 0, "while_saving": True},
            {"kind": "memory-uce", "at_step": 40, "pod": 0},
        ]
    )
    assert entry.while_saving and not plain.while_saving
    assert not entry.due(40, 9.0, saving=False)
    assert not entry.due(39, 9.0, saving=True)
    assert entry.due(40, 9.0, saving=True) and entry.due(41, 9.0, saving=True)
    assert plain.due(40, 9.0, saving=False) and plain.due(40, 9.0, saving=True)
    assert "at step 40 while a checkpoint is saved" in entry.describe()


# -- as a user runs it ------------------------------------------------------------------------------


def relaunch(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )


BAD_PLANS = {
    "rank-not-in-pod": ({"kind": "process-exit", "after_s": 1, "pod": 1, "rank": 0}, "rank"),
    "pod-out-of-range": ({"kind": "process-exit", "after_s": 1, "pod": 5}, "pod"),
    "chip-out-of-range": ({"kind": "chip-fault", "after_s": 1, "pod": 0, "chip": 7}, "chip"),
    "unknown-node": ({"kind": "node-down", "after_s": 1, "node": "node-42"}, "node"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_run_with_a_plan_that_cannot_hit_its_target_exits_2_before_anything_starts(
    cluster: Cluster, name: str
) -> None:
    entry, key = BAD_PLANS[name]
    args = cluster.command(JOB, [entry], CLUSTER)
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("  - ")]
    assert len(lines) == 1 and lines[0].startswith(f"  - faults[0].{key}:"), done.stderr
    assert "faults.yaml" in done.stderr  # names the plan file, not the job
    assert not (cluster.state / "logs").exists()  # no agent, no launcher was ever started
    assert not (cluster.state / "jobs").exists()
    assert not processes_of(cluster.state)


def test_validate_checks_a_plan_against_the_job_and_the_cluster(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"faults": [e for e, _ in BAD_PLANS.values()]}))
    done = relaunch("validate", str(job), "--faults", str(bad), "--cluster", str(cluster))
    assert done.returncode == 2, done.stdout + done.stderr
    for i, (_, key) in enumerate(BAD_PLANS.values()):
        assert f"faults[{i}].{key}" in done.stderr
    good = tmp_path / "good.yaml"
    good.write_text(
        yaml.safe_dump({"faults": [{"kind": "hang", "at_step": 5, "pod": 1, "rank": 1}]})
    )
    done = relaunch("validate", str(job), "--faults", str(good), "--cluster", str(cluster))
    assert done.returncode == 0, done.stderr
    shown = " ".join(done.stdout.split())  # the terminal may wrap a long path's line
    assert "1 entr(ies), each can hit its target" in shown
    assert "hang on pod 1 rank 1 at step 5" in shown


def test_local_submit_refuses_a_plan_that_does_not_fit(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"faults": [BAD_PLANS["pod-out-of-range"][0]]}))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    state = tmp_path / "state"
    done = relaunch(
        "submit", str(job), "--faults", str(plan), "--cluster", str(cluster), "--state-dir",
        str(state),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "faults[0].pod" in done.stderr and "Traceback" not in done.stderr
    assert not (state / "runner.pid").exists()  # nothing queued, no runner started


# -- at run time --------------------------------------------------------------------------------


def test_plan_entries_strike_in_order_a_later_one_waits_for_a_rank_still_starting(
    tmp_path: Path,
) -> None:
    """Both entries are due at once, the first on a rank its launcher has not started yet: the
    node fault after it waits, and the first strikes first once its rank runs (a rank forked
    from a template still importing torch once let a later node fault go first)."""
    from tests.controller_sim import Sim, job_spec

    plan = [
        {"kind": "process-exit", "after_s": 1, "pod": 1, "rank": 1},
        {"kind": "node-down", "after_s": 1, "pod": 0},
    ]
    sim = Sim(tmp_path, job_spec(replicas=2, procs_per_pod=1), plan=plan)
    sim.starting.add(1)
    sim.boot()
    sim.run(3)
    assert sim.store.fired(sim.job_id) == {}, sim.events
    sim.starting.clear()
    sim.run(0.5)
    assert {i: note for i, (_, note) in sim.store.fired(sim.job_id).items()} == {0: ""}, sim.events


def test_plan_entry_whose_target_is_gone_is_not_fired_and_never_holds_later_entries(
    cluster: Cluster,
) -> None:
    """node-1 is lost by the first entry and isolated by its recovery: the chip fault planned on
    it cannot fire any more. The process exit after it still fires at its time (before the fix,
    a dropped entry held every later one back for the 60 s startup allowance, and this job ended
    first)."""
    faults = [
        {"kind": "node-down", "at_step": 5, "node": "node-1"},
        {"kind": "chip-fault", "at_step": 10, "node": "node-1", "chip": 0},
        # pod 0 trains on while node-1's loss is detected (about 35 steps): far enough after it
        {"kind": "process-exit", "at_step": 100, "pod": 0},
    ]
    job = toy_job({**UNCONDITIONAL, "fault-tolerance/pod-retry-num": "2"}, steps=150, replicas=2)
    result = cluster.run(job, faults, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    states = [(e["index"], e["state"]) for e in result.report["fault_plan"]]
    assert states == [(0, "fired"), (1, "not fired"), (2, "fired")], result.report["fault_plan"]
    assert "node node-1 is" in result.report["fault_plan"][1]["note"]
    assert result.actions == ["pod-reschedule", "job-reschedule"]


def test_plan_at_step_on_a_script_that_never_reports_progress_says_it_was_not_fired(
    cluster: Cluster,
) -> None:
    job = toy_job(UNCONDITIONAL, replicas=1, hang_detect_seconds=20)
    job["spec"]["command"] = [sys.executable, "-c", "import time; print('working'); time.sleep(3)"]
    faults = [{"kind": "process-exit", "at_step": 5, "pod": 0}]
    result = cluster.run(job, faults, startup_s=1)
    assert result.returncode == 0, result.stdout + result.stderr
    [entry] = result.report["fault_plan"]
    assert entry["state"] == "not fired"
    assert "never reported a step" in entry["note"] and "report_progress" in entry["note"]
    assert "fault plan: 1 of 1 entr(ies) not fired" in result.stdout  # the summary a person reads
    said = [e.kind for e in result.events()]  # said while it ran, not only at the end
    assert said.index(EventKind.PLAN_WAITING) < said.index(EventKind.PLAN_NOT_FIRED), said


def test_plan_hang_is_reported_fired_only_when_it_did(cluster: Cluster) -> None:
    """Rank 1 exits 0 at once; a hang planned on it cannot fire, and is not reported as fired;
    rank 0's hang, planned before its first output, fires and is caught after the job's own
    startup allowance (spec.startup_seconds), not the default 60 s. Rank 1's hang is due at
    step 1, which rank 0 reports only once rank 1 is gone (reaped by its launcher, which said
    so before it passed the step on): no timing window, on a busy machine either."""
    marks = cluster.dir
    script = (
        "import os, sys, time\n"
        "from relaunch.train import report_progress\n"
        f"mark = os.path.join({str(marks)!r}, 'rank1-' + os.environ['MA_PROC_START_CNT'])\n"
        "if os.environ['RANK'] == '1':\n"
        "    open(mark + '.tmp', 'w').write(str(os.getpid()))\n"
        "    os.replace(mark + '.tmp', mark)\n"
        "    sys.exit(0)\n"
        "while not os.path.exists(mark): time.sleep(0.05)\n"
        "pid = int(open(mark).read())\n"
        "while os.path.exists(f'/proc/{pid}'): time.sleep(0.05)\n"
        "print('first output', flush=True)\n"
        "report_progress(1)\n"
        "time.sleep(3)\n"
    )
    job = toy_job(
        {**UNCONDITIONAL, "fault-tolerance/hang-retry": "true"},
        replicas=1,
        hang_detect_seconds=5,
        startup_seconds=4,
    )
    job["spec"]["command"] = [sys.executable, "-c", script]
    faults = [
        {"kind": "hang", "at_step": 1, "pod": 0, "rank": 1},  # rank 1 is gone by step 1
        {"kind": "hang", "after_s": 0, "pod": 0, "rank": 0},
    ]
    result = cluster.run(job, faults, startup_s=None)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = {e["index"]: e for e in result.report["fault_plan"]}
    assert plan[0]["state"] == "not fired", plan[0]
    assert "rank 1 has exited (code 0" in plan[0]["note"], plan[0]
    assert plan[1]["state"] == "fired"
    assert result.actions[:1] == ["hang-restart"], result.stdout


def test_agent_refuses_a_chip_it_does_not_have_instead_of_wrapping(tmp_path: Path) -> None:
    class Wire:
        def __init__(self) -> None:
            self.sent: list[Message] = []

        def send(self, message: Message) -> bool:
            self.sent.append(message)
            return True

    agent = Agent(tmp_path, "node-0", chips=1, interval=1.0, grace=1.0, blip_s=20.0)
    wire = Wire()
    agent.handle(wire, InjectChipFault(3, 7, "80E18005", True, "chip"))  # type: ignore[arg-type]
    assert agent.faults == {}  # chip 7 % 1 == 0 was faulted before the fix
    [refused] = wire.sent
    assert isinstance(refused, Injected) and refused.index == 3 and not refused.ok
    assert "chip 7 does not exist" in refused.why
    agent.handle(wire, InjectChipFault(4, 0, "80E18005", True, "chip"))  # type: ignore[arg-type]
    assert list(agent.faults) == [0] and wire.sent[-1] == Injected(4, True, "", wire.sent[-1].at)  # type: ignore[attr-defined]


def test_plan_slow_slows_a_whole_pod_by_a_factor_for_a_while() -> None:
    (entry,) = parse_plan(
        [{"kind": "slow", "at_step": 30, "pod": 1, "factor": 4, "duration_s": 60}]
    )
    assert (entry.kind.value, entry.pod, entry.factor, entry.duration_s) == ("slow", 1, 4.0, 60.0)
    assert entry.describe() == "slow (x4) on pod 1 at step 30"
    (default,) = parse_plan([{"kind": "slow", "after_s": 2, "pod": 0}])
    assert default.factor == 3.0 and default.duration_s is None
