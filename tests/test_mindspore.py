"""MindSpore jobs unmodified, in MindSpore's own venv (`make mindspore`: relaunch installed beside
mindspore, no torch): the variables every process sees beside msrun's own, and a data-parallel
script written from MindSpore's docs (examples/frameworks/mindspore_dp.py) launched in msrun's
form through a crash, a hang and a lost node, ending bit-identical to its fault-free run under
msrun. Real MindSpore (the CPU `mccl` backend, its scheduler and workers)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".mindspore" / "bin"
SCRIPT = ROOT / "examples" / "frameworks" / "mindspore_dp.py"
DUMP = ROOT / "tests" / "scripts" / "dump_mindspore_env.py"
MIN_STEP_S = 0.06
AFTER_S = 10.0
"""When each fault fires from its attempt's start: MindSpore's init (the scheduler, the
workers' handshake) takes 4-6 s, then the workers train."""
STEPS = 700
"""More than four faulted attempts can train (4 * AFTER_S / MIN_STEP_S): the last one trains
to the end."""


@pytest.fixture(scope="module")
def venv() -> Path:
    assert (VENV / ".." / ".installed").exists(), "MindSpore's venv is built by `make mindspore`"
    return VENV


def environment(venv: Path) -> dict[str, str]:
    """The MindSpore venv first on PATH: `python` in a command is its Python, as for its user."""
    return {**os.environ, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}


def msrun(venv: Path, cwd: Path, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(venv / "msrun"), "--join=True", "--log_dir=msrun-logs", *args],
        cwd=cwd,
        env=environment(venv),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    logs = "".join(p.read_text() for p in sorted((cwd / "msrun-logs").glob("*.log")))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:] + logs[-3000:]
    return logs


def relaunch(venv: Path, cwd: Path, *args: str, timeout: float = 600) -> tuple[str, dict]:
    report = cwd / "report.json"
    done = subprocess.run(
        [str(venv / "relaunch"), "run", "--state-dir", str(cwd / "state"), "--report",
         str(report), *args],
        cwd=cwd, env=environment(venv), capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-5000:]
    return said, json.loads(report.read_text())


def test_every_process_sees_the_variables_msrun_gives_for_the_same_flags(
    venv: Path, tmp_path: Path
) -> None:
    """Four workers, two a node: relaunch's two pods beside msrun run once a node (its
    --node_rank 0 and 1). Names and values equal, but the scheduler's address: msrun's is its
    --master_addr, relaunch's the address of rank 0's node (an IP address, as msrun's)."""
    ours = tmp_path / "relaunch"
    ours.mkdir()
    _, report = relaunch(
        venv, ours, "--worker_num=4", "--local_worker_num=2", str(DUMP), str(ours / "env")
    )
    assert report["left_behind"] == 0, report["left_behind"]
    seen = {p.stem: json.loads(p.read_text()) for p in (ours / "env").glob("*.json")}
    assert sorted(seen) == ["MS_SCHED-0", *(f"MS_WORKER-{r}" for r in range(4))], sorted(seen)
    host, port = seen["MS_SCHED-0"]["MS_SCHED_HOST"], seen["MS_SCHED-0"]["MS_SCHED_PORT"]
    socket.inet_aton(host)  # an IP address
    theirs = tmp_path / "msrun"
    theirs.mkdir()
    for node in (0, 1):
        msrun(
            venv, theirs, "--worker_num=4", "--local_worker_num=2", f"--node_rank={node}",
            "--master_addr=127.0.0.1", f"--master_port={port}", str(DUMP), str(theirs / "env"),
            f"n{node}-",
        )  # fmt: skip
    given = {p.stem: json.loads(p.read_text()) for p in (theirs / "env").glob("*.json")}
    expected = {
        "MS_SCHED-0": given["n0-MS_SCHED-0"],
        **{f"MS_WORKER-{r}": given[f"n{r // 2}-MS_WORKER-{r}"] for r in range(4)},
    }
    for name, env in expected.items():
        assert env.pop("MS_SCHED_HOST") == "127.0.0.1"
        assert seen[name].pop("MS_SCHED_HOST") == host
        assert seen[name] == env, name


SDK_SCRIPT = ROOT / "examples" / "frameworks" / "mindspore_sdk.py"
SDK_STEPS = 120


@pytest.fixture(scope="module")
def baselines(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The final parameters' digest of each fault-free run under msrun the tests compare
    with (unpaced: pacing changes no number), the runs side by side (MindSpore's start and
    shutdown are mostly waits): the docs' script, and the SDK example's loop and Model.train
    on two workers and its loop on four."""
    runs = {
        "dp": (SCRIPT, 2, ("--steps", str(STEPS))),
        "loop": (SDK_SCRIPT, 2, ("--api", "loop", "--steps", str(SDK_STEPS))),
        "model": (SDK_SCRIPT, 2, ("--api", "model", "--steps", str(SDK_STEPS))),
        "loop-4": (SDK_SCRIPT, 4, ("--api", "loop", "--steps", str(SDK_STEPS))),
    }

    def digest(port: int, name: str) -> str:
        script, workers, args = runs[name]
        cwd = tmp_path_factory.mktemp(f"msrun-{name}")
        logs = msrun(venv, cwd, f"--worker_num={workers}", f"--local_worker_num={workers}",
                     f"--master_port={port}", str(script), *args)  # fmt: skip
        found = re.search(rf"done: step={args[-1]} digest=(\w+)", logs)
        assert found, logs[-3000:]
        return found.group(1)

    with ThreadPoolExecutor(len(runs)) as pool:
        done = {n: pool.submit(digest, 18119 + 10 * i, n) for i, n in enumerate(runs)}
        return {name: future.result() for name, future in done.items()}


@pytest.fixture(scope="module")
def msrun_digest(baselines: dict[str, str]) -> str:
    return baselines["dp"]


@pytest.fixture(scope="module")
def sdk_digests(baselines: dict[str, str]) -> dict[str, str]:
    return baselines


def test_a_mindspore_script_comes_through_a_crash_a_chip_fault_a_hang_and_a_lost_node(
    venv: Path, msrun_digest: str, tmp_path: Path
) -> None:
    """msrun's form, one word changed: each fault found at once (an exit, a chip's, a silence, a
    node's), the survivors stopped, the cluster formed anew around a new scheduler (in place
    for the chip that heals), every worker resumed from the newest step all saved; one record
    per recovery, nothing left behind, msrun's fault-free digest at the end."""
    assert STEPS > 4 * AFTER_S / MIN_STEP_S, "four faulted attempts could end the job"
    plan = tmp_path / "faults.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "faults": [
                    {"kind": "process-exit", "after_s": AFTER_S, "pod": 1, "rank": 1},
                    {
                        "kind": "chip-fault",
                        "after_s": AFTER_S,
                        "pod": 0,
                        "chip": 0,
                        "code": "80E18005",
                        "heals": True,
                    },
                    {"kind": "hang", "after_s": AFTER_S, "pod": 0, "rank": 0},
                    {"kind": "node-down", "after_s": AFTER_S, "pod": 1},
                ]
            }
        )
    )
    said, report = relaunch(
        venv, tmp_path, "--faults", str(plan), "--hang-detect-seconds", "8",
        "--monitor-interval", "0.2", "--worker_num=2", "--local_worker_num=1",
        "--master_port=8118", "--join=True", str(SCRIPT), "--steps", str(STEPS),
        "--min-step-seconds", str(MIN_STEP_S),
    )  # fmt: skip
    assert "msrun's --master_port is not used" in said
    assert [e["state"] for e in report["fault_plan"]] == ["fired"] * 4, report["fault_plan"]
    assert [(r["action"], r["outcome"]) for r in report["recoveries"]] == [
        ("job-reschedule", "succeeded"),
        ("in-place", "succeeded"),
        ("hang-restart", "succeeded"),
        ("isolated-job-reschedule", "succeeded"),
    ], report["recoveries"]
    assert report["left_behind"] == 0, report["left_behind"]
    resumed = [int(n) for n in re.findall(r"\] start: rank=\d+ size=2 step=(\d+)", said)]
    assert resumed == sorted(resumed), resumed
    # each fault strikes AFTER_S into its attempt: on a busy machine MindSpore's init (three
    # processes importing it on shared cores) may take most of it (CI: no attempt reached step
    # 20, its first save); once an attempt trained two save intervals, the last restart resumed
    last_start = [m.start() for m in re.finditer(r"\] start: ", said)][-1]
    trained = max((int(n) for n in re.findall(r"\] step (\d+)", said[:last_start])), default=0)
    assert trained < 40 or resumed[-1] > 0, (trained, resumed)
    found = re.search(rf"done: step={STEPS} digest=(\w+)", said)
    assert found, said[-3000:]
    assert found.group(1) == msrun_digest


def test_a_lost_scheduler_is_a_job_level_fault_found_at_once_not_at_mindspores_time_out(
    venv: Path, msrun_digest: str, tmp_path: Path
) -> None:
    """The scheduler killed while the workers train: its launcher ends rank 0 at once, saying
    why (MindSpore's workers would notice after their 30 s heartbeat time-out), the job restarts
    around a new scheduler and ends with msrun's digest."""
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        [str(venv / "relaunch"), "run", "--state-dir", str(tmp_path / "state"), "--report",
         str(report), "--monitor-interval", "0.2", "--worker_num=2", "--local_worker_num=1",
         str(SCRIPT), "--steps", str(STEPS)],
        cwd=tmp_path, env=environment(venv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    said = []
    for line in proc.stdout:
        said.append(line)
        if "[pod 0 rank 0] step 30 " in line:
            break
    (scheduler,) = [
        p
        for p in psutil.process_iter(["environ", "cwd"])
        if (p.info["environ"] or {}).get("MS_ROLE") == "MS_SCHED" and p.info["cwd"] == str(tmp_path)
    ]
    scheduler.kill()
    said.extend(proc.stdout)
    assert proc.wait(timeout=600) == 0, "".join(said)[-5000:]
    summary = json.loads(report.read_text())
    (record,) = summary["recoveries"]
    assert (record["action"], record["outcome"]) == ("job-reschedule", "succeeded"), record
    assert "MindSpore's scheduler" in record["fault"]["detail"], record["fault"]
    assert summary["left_behind"] == 0
    found = re.search(rf"done: step={STEPS} digest=(\w+)", "".join(said))
    assert found and found.group(1) == msrun_digest


@pytest.mark.parametrize("api", ["loop", "model"])
def test_the_sdks_reports_and_checkpoints_carry_a_mindspore_job_through_faults_at_steps(
    venv: Path, sdk_digests: dict[str, str], tmp_path: Path, api: str
) -> None:
    """relaunch.train.mindspore in a hand-written loop and in Model.train: its step reports
    are what a fault plan's `at_step` and hang detection by steps read; its checkpoints (the
    SDK's, verified) bring every worker back to one step; the job ends with msrun's digest."""
    plan = tmp_path / "faults.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "faults": [
                    {"kind": "process-exit", "at_step": 35, "pod": 1, "rank": 1},
                    {"kind": "hang", "at_step": 75, "pod": 0, "rank": 0},
                ]
            }
        )
    )
    said, report = relaunch(
        venv, tmp_path, "--faults", str(plan), "--hang-detect-seconds", "8",
        "--monitor-interval", "0.2", "--worker_num=2", "--local_worker_num=1", str(SDK_SCRIPT),
        "--api", api, "--steps", str(SDK_STEPS), "--min-step-seconds", "0.05",
    )  # fmt: skip
    assert [e["state"] for e in report["fault_plan"]] == ["fired"] * 2, report["fault_plan"]
    assert [(r["action"], r["outcome"]) for r in report["recoveries"]] == [
        ("job-reschedule", "succeeded"),
        ("hang-restart", "succeeded"),
    ], report["recoveries"]
    resumed = [int(n) for n in re.findall(r"\] start: rank=\d+ size=2 step=(\d+)", said)]
    assert resumed[:2] == [0, 0] and len(resumed) == 6 and resumed[-1] >= 60, resumed
    if api == "model":  # Model.train resumes at an epoch's start
        assert all(step % 10 == 0 for step in resumed), resumed
    found = re.search(rf"done: step={SDK_STEPS} digest=(\w+)", said)
    assert found and found.group(1) == sdk_digests[api], said[-3000:]


def test_a_lost_node_moves_its_mindspore_pod_and_the_cluster_forms_anew_around_it(
    venv: Path, sdk_digests: dict[str, str], tmp_path: Path
) -> None:
    """Pod-level rescheduling (R-23): two pods of two workers on nodes of their own; pod 1's
    node lost at a step: the pod moves to a standby node, pod 0's workers and its scheduler
    start again with it (MindSpore's cluster cannot take a newcomer), every worker resumes
    from the newest saved step and the job ends with msrun's digest for four workers."""
    plan = tmp_path / "faults.yaml"
    plan.write_text(yaml.safe_dump({"faults": [{"kind": "node-down", "at_step": 30, "pod": 1}]}))
    said, report = relaunch(
        venv, tmp_path, "--faults", str(plan), "--pod-retry-num", "1", "--monitor-interval",
        "0.2", "--worker_num=4", "--local_worker_num=2", str(SDK_SCRIPT), "--api", "loop",
        "--steps", str(SDK_STEPS), "--min-step-seconds", "0.05",
    )  # fmt: skip
    (record,) = report["recoveries"]
    assert (record["action"], record["outcome"]) == ("pod-reschedule", "succeeded"), record
    assert report["left_behind"] == 0
    resumed = [int(n) for n in re.findall(r"\] start: rank=\d+ size=4 step=(\d+)", said)]
    assert len(resumed) == 8 and resumed[4:] == [resumed[4]] * 4 and resumed[4] >= 20, resumed
    found = re.search(rf"done: step={SDK_STEPS} digest=(\w+)", said)
    assert found and found.group(1) == sdk_digests["loop-4"], said[-3000:]
