"""`relaunch server`: the REST API against a real server process, its runner and its jobs."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cli import relaunch_here
from tests.runtime import (
    ROOT,
    UNCONDITIONAL,
    Server,
    kill_all,
    processes_of,
    toy_job,
    wait_gone,
)

BAD_JOBS = ROOT / "tests" / "data" / "bad_jobs"

# The request body of seed 000 (ModelArts "Auto restart" page), completed with a command.
SEED_BODY = {
    "kind": "job",
    "metadata": {
        "annotations": {
            "fault-tolerance/job-retry-num": "8",
            "fault-tolerance/job-unconditional-retry": "true",
            "fault-tolerance/hang-retry": "true",
            "fault-tolerance/pod-retry-num": "3",
        }
    },
}


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _cleanup(server: Server) -> None:
    server.stop()
    left = wait_gone(server.state, timeout=15)
    kill_all(server.state)
    assert not left, f"processes outlived the server test: {[p.cmdline() for p in left]}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path).start()
    yield s
    _cleanup(s)


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module's tests of requests it refuses (nothing they send is created):
    each start is a new interpreter."""
    s = Server(tmp_path_factory.mktemp("refusing")).start()
    yield s
    _cleanup(s)


def auth(server: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def job_status(server: Server, job_id: str, project: str = "default") -> str:
    r = httpx.get(f"{server.url}/v2/{project}/training-jobs/{job_id}")
    assert r.status_code == 200, r.text
    phase: str = r.json()["status"]["phase"]
    return phase


def wait_ended(server: Server, job_id: str, project: str = "default", timeout: float = 90) -> str:
    phase: str = wait_until(
        lambda: (
            (p := job_status(server, job_id, project)) in ("Succeeded", "Failed", "Stopped") and p
        ),
        timeout,
        f"job {job_id} to end",
    )
    return phase


def test_token_file_is_private_and_writes_need_it(server: Server) -> None:
    token_file = server.state / "server-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    body = {**SEED_BODY, "spec": {"command": "true"}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        for method, path, payload in (
            ("POST", "/v2/p/training-jobs", body),
            ("POST", "/v2/p/training-jobs/1/actions", {"action_type": "terminate"}),
            ("POST", "/v2/p/training-jobs/1/faults", {"faults": []}),
            ("POST", "/v2/nodes/node-0/cordon", None),
            ("POST", "/v2/nodes/node-0/release", None),
        ):
            r = httpx.request(method, server.url + path, json=payload, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error_code"] == "RL.0401"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/v2/p/training-jobs").json()["count"] == 0
    # No endpoint reveals the token: not the reads, not the document, not the page, not errors.
    created = httpx.post(f"{server.url}/v2/p/training-jobs", json=body, headers=auth(server))
    assert created.status_code == 201, created.text
    job_id = created.json()["metadata"]["id"]
    wait_ended(server, job_id, "p")
    for path in (
        "/openapi.json", "/", "/static/app.js", "/metrics", "/healthz", "/v2/nodes",
        "/v2/p/training-jobs", f"/v2/p/training-jobs/{job_id}",
        f"/v2/p/training-jobs/{job_id}/recoveries", f"/v2/p/training-jobs/{job_id}/progress",
        "/v2/p/training-jobs/999",
    ):  # fmt: skip
        r = httpx.get(server.url + path, headers=auth(server))
        assert server.token not in r.text, path
    first_output = server.stop()
    assert server.token in first_output  # shown once, at the first start...
    server.start()
    assert server.token not in server.stop()  # ...and never again
    assert "server-token" in server.output


def test_reads_can_be_locked(tmp_path: Path) -> None:
    s = Server(tmp_path, "--lock-reads").start()
    try:
        for path in ("/v2/p/training-jobs", "/v2/nodes", "/metrics"):
            assert httpx.get(s.url + path).status_code == 401, path
            assert httpx.get(s.url + path, headers=auth(s)).status_code == 200, path
        assert httpx.get(s.url + "/healthz").status_code == 200
    finally:
        _cleanup(s)


def _validate_problems(path: Path) -> list[str]:
    done = relaunch_here("validate", str(path))  # the process itself: tests/test_validate_cli.py
    assert done.returncode == 2
    return [line[4:] for line in done.stderr.splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize(
    "name",
    [
        "r01_retry_num_too_big.yaml",
        "spec_missing_command.yaml",
        "process_recovery_without_grace.yaml",
        "r01_unconditional_without_retry_num.json",
        "spec_unknown_key.yaml",
    ],
)
def test_invalid_jobs_get_the_messages_of_validate(refusing: Server, name: str) -> None:
    server = refusing
    path = BAD_JOBS / name
    body = yaml.safe_load(path.read_text())
    r = httpx.post(f"{server.url}/v2/p/training-jobs", json=body, headers=auth(server))
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["error_code"] == "RL.0400"
    assert [p["message"] for p in error["problems"]] == _validate_problems(path)
    assert all(p["key"] and p["allowed"] for p in error["problems"])


def test_malformed_requests_are_400_with_a_reason(refusing: Server) -> None:
    server = refusing
    url = f"{server.url}/v2/p/training-jobs"
    r = httpx.post(
        url, content=b"{not json", headers={**auth(server), "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["problems"], r.text
    r = httpx.post(url, content=b'{"a": 1}', headers=auth(server))  # no content type
    assert r.status_code == 400 and "application/json" in r.json()["problems"][0]["message"]
    r = httpx.post(url, json=[1, 2], headers=auth(server))
    assert r.status_code == 400
    r = httpx.post(
        url,
        json={**SEED_BODY, "spec": {"command": "true"}, "fault_plan": [{"kind": "meteor"}]},
        headers=auth(server),
    )
    # a fault plan's problems are 422 (the request was well formed; its faults cannot happen)
    assert r.status_code == 422 and r.json()["problems"][0]["key"].startswith("faults")
    r = httpx.post(
        url, json={**SEED_BODY, "spec": {"command": "true", "replicas": 99}}, headers=auth(server)
    )
    assert r.status_code == 400 and r.json()["problems"][0]["key"] == "spec.replicas"
    assert httpx.get(f"{server.url}/v2/p/training-jobs/abc").status_code == 404
    assert httpx.get(f"{server.url}/v2/p/training-jobs/12345").status_code == 404
    assert httpx.post(f"{server.url}/v2/nodes/nope/cordon", headers=auth(server)).status_code == 404
    assert httpx.get(f"{server.url}/v2/p/nothing-here").status_code == 404


def test_a_seed_body_runs_recovers_and_shows_in_records_and_metrics(server: Server) -> None:
    body = {
        **SEED_BODY,
        "spec": toy_job(steps=60)["spec"],
        "fault_plan": [{"kind": "process-exit", "at_step": 15, "pod": 1, "exit_code": 3}],
    }
    r = httpx.post(f"{server.url}/v2/team-a/training-jobs", json=body, headers=auth(server))
    assert r.status_code == 201, r.text
    job = r.json()
    job_id = job["metadata"]["id"]
    assert job["metadata"]["project_id"] == "team-a"
    assert job["metadata"]["annotations"] == SEED_BODY["metadata"]["annotations"]
    assert wait_ended(server, job_id, "team-a") == "Succeeded"

    records = httpx.get(f"{server.url}/v2/team-a/training-jobs/{job_id}/recoveries").json()
    assert records["count"] == 1
    record = records["items"][0]
    assert record["fault"]["kind"] == "process-exit" and record["fault"]["exit_code"] == 3
    assert record["action"] == "job-reschedule" and record["outcome"] == "succeeded"
    assert record["mttr_s"] > 0 and record["detect_s"] >= 0
    shown = httpx.get(f"{server.url}/v2/team-a/training-jobs/{job_id}").json()
    assert shown["recovery"]["restarts_used"] == 1
    assert shown["recovery"]["budgets_left"]["job"] == 7
    assert [p["schedule_count"] for p in shown["recovery"]["pods"]] == [2, 2]
    progress = httpx.get(f"{server.url}/v2/team-a/training-jobs/{job_id}/progress").json()
    steps = [s["step"] for s in progress["samples"]]
    assert steps and max(steps) == 60
    decided = [e["fields"]["action"] for e in progress["events"] if e["kind"] == "decision"]
    assert "job-reschedule" in decided, progress["events"]

    listed = httpx.get(f"{server.url}/v2/team-a/training-jobs").json()
    assert [j["metadata"]["id"] for j in listed["items"]] == [job_id]
    assert httpx.get(f"{server.url}/v2/team-b/training-jobs").json()["count"] == 0
    assert httpx.get(f"{server.url}/v2/team-b/training-jobs/{job_id}").status_code == 404

    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'relaunch_recoveries_total{action="job-reschedule",outcome="succeeded"} 1.0' in metrics
    assert 'relaunch_recovery_mttr_seconds_count{action="job-reschedule"} 1.0' in metrics
    assert 'relaunch_fault_detection_seconds_count{kind="process-exit"} 1.0' in metrics
    assert 'relaunch_jobs{status="Succeeded"} 1.0' in metrics
    assert 'relaunch_nodes{state="Ready"} 4.0' in metrics


def test_inject_into_a_running_job_then_stop_it(server: Server) -> None:
    body = toy_job(UNCONDITIONAL, steps=100000)
    r = httpx.post(f"{server.url}/v2/p/training-jobs", json=body, headers=auth(server))
    job_id = r.json()["metadata"]["id"]
    base = f"{server.url}/v2/p/training-jobs/{job_id}"
    wait_until(
        lambda: (httpx.get(base).json()["status"]["last_step"] or 0) > 5, 60, "the job to train"
    )
    plan = {
        "faults": [
            {"kind": "chip-fault", "after_s": 0, "pod": 0, "code": "80E18005", "heals": True}
        ]
    }
    r = httpx.post(base + "/faults", json=plan, headers=auth(server))
    assert r.status_code == 202, r.text
    assert r.json() == {"job_id": job_id, "first_index": 0, "count": 1}
    record = wait_until(
        lambda: [x for x in httpx.get(base + "/recoveries").json()["items"] if x["mttr_s"]],
        60,
        "the injected fault's recovery",
    )[0]
    assert record["fault"]["kind"] == "chip" and record["fault"]["code"] == "80E18005"
    assert record["action"] == "in-place"

    bad = httpx.post(base + "/actions", json={"action_type": "explode"}, headers=auth(server))
    assert bad.status_code == 400 and bad.json()["problems"][0]["key"] == "action_type"
    r = httpx.post(base + "/actions", json={"action_type": "terminate"}, headers=auth(server))
    assert r.status_code == 202, r.text
    assert wait_ended(server, job_id, "p") == "Stopped"
    assert "terminated through the API" in httpx.get(base).json()["status"]["reason"]
    again = httpx.post(base + "/actions", json={"action_type": "terminate"}, headers=auth(server))
    assert again.status_code == 409
    late = httpx.post(base + "/faults", json=plan, headers=auth(server))
    assert late.status_code == 409
    left = wait_gone(server.state, timeout=15)
    assert [p for p in left if "server" not in " ".join(p.cmdline())] == []


def test_the_server_restarts_without_touching_a_running_job(server: Server) -> None:
    body = toy_job(UNCONDITIONAL, steps=120)
    r = httpx.post(f"{server.url}/v2/p/training-jobs", json=body, headers=auth(server))
    job_id = r.json()["metadata"]["id"]
    base = f"{server.url}/v2/p/training-jobs/{job_id}"
    wait_until(lambda: (httpx.get(base).json()["status"]["last_step"] or 0) > 10, 60, "training")
    workers = {p.pid for p in processes_of(server.state) if p.environ().get("RANK") is not None}
    assert workers
    server.stop(kill=True)
    time.sleep(1.0)
    alive = {p.pid for p in processes_of(server.state) if p.environ().get("RANK") is not None}
    assert alive == workers, "the workers should not notice the server going away"
    server.start()
    assert wait_ended(server, job_id, "p") == "Succeeded"
    shown = httpx.get(base).json()
    assert shown["status"]["last_step"] == 120 and shown["recovery"]["records"] == []


def test_queued_jobs_run_in_order_and_a_queued_one_stops_at_once(server: Server) -> None:
    url = f"{server.url}/v2/p/training-jobs"
    ids = [
        httpx.post(url, json=toy_job(steps=s), headers=auth(server)).json()["metadata"]["id"]
        for s in (30, 30, 30)
    ]
    r = httpx.post(
        f"{url}/{ids[2]}/actions", json={"action_type": "terminate"}, headers=auth(server)
    )
    assert r.status_code == 202
    assert [wait_ended(server, i, "p") for i in ids] == ["Succeeded", "Succeeded", "Stopped"]
    shown = [httpx.get(f"{url}/{i}").json() for i in ids[:2]]
    assert shown[0]["status"]["duration"] > 0


def test_cli_verbs_talk_to_the_server(server: Server, tmp_path: Path) -> None:
    env = {"RELAUNCH_SERVER": server.url, "RELAUNCH_TOKEN": server.token}

    def cli(*args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
        import os

        environment = {**os.environ, **env}
        if not token:
            environment.pop("RELAUNCH_TOKEN")
            environment["RELAUNCH_STATE_DIR"] = str(tmp_path / "elsewhere")
        return subprocess.run(
            [sys.executable, "-m", "relaunch", *args],
            capture_output=True, text=True, env=environment, cwd=ROOT, check=False,
        )  # fmt: skip

    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(toy_job(UNCONDITIONAL, steps=40)))
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        yaml.safe_dump({"faults": [{"kind": "process-exit", "at_step": 10, "pod": 0}]})
    )
    done = cli("submit", str(job_file), "--faults", str(faults))
    assert done.returncode == 0, done.stderr
    assert "submitted (id 1)" in done.stdout
    assert wait_ended(server, "1") == "Succeeded"
    jobs = cli("jobs")
    assert jobs.returncode == 0 and "Succeeded" in jobs.stdout and "e2e" in jobs.stdout
    described = cli("describe", "e2e", "-o", "json")
    summary = json.loads(described.stdout)
    assert summary["status"] == "Succeeded"
    assert [r["action"] for r in summary["recoveries"]] == ["job-reschedule"]
    assert summary["restores"] == []  # the toy script restores through no SDK checkpoint
    table = cli("describe", "1")
    assert "job-reschedule" in table.stdout and "Fault recovery details" in table.stdout

    assert "node-3" in cli("nodes").stdout
    assert cli("cordon", "node-3").stdout.strip() == "node-3: Isolated"
    nodes = httpx.get(f"{server.url}/v2/nodes").json()["items"]
    assert [n["state"] for n in nodes if n["name"] == "node-3"] == ["Isolated"]
    assert cli("release", "node-3").stdout.strip() == "node-3: Ready"

    refused = cli("cordon", "node-3", token=False)
    assert (
        refused.returncode == 2
        and "HTTP 401" in refused.stderr
        and "RELAUNCH_TOKEN" in refused.stderr
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "job", "spec": {}}))
    rejected = cli("submit", str(bad))
    assert rejected.returncode == 2 and "spec.command: missing" in rejected.stderr
    gone = cli("describe", "no-such-job")
    assert gone.returncode == 2 and "no job 'no-such-job'" in gone.stderr
    unreachable = subprocess.run(
        [sys.executable, "-m", "relaunch", "jobs", "--server", "http://127.0.0.1:9"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert unreachable.returncode == 2 and "cannot reach the relaunch server" in unreachable.stderr


def test_local_submit_and_stop_without_a_server(tmp_path: Path) -> None:
    state = tmp_path / "state"
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(toy_job(steps=100000)))
    cluster = tmp_path / "cluster.yaml"
    from tests.runtime import FAST_CLUSTER

    cluster.write_text(yaml.safe_dump(FAST_CLUSTER))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "relaunch", *args, "--state-dir", str(state)],
            capture_output=True, text=True, cwd=ROOT, check=False,
        )  # fmt: skip

    try:
        done = cli("submit", str(job_file), "--cluster", str(cluster))
        assert done.returncode == 0, done.stderr
        assert "runner started" in done.stdout
        wait_until(lambda: "Running" in cli("jobs").stdout, 30, "the job to run")
        stopped = cli("stop", "1")
        assert stopped.returncode == 0 and "stop requested" in stopped.stdout
        wait_until(lambda: "Stopped" in cli("jobs").stdout, 30, "the job to stop")
        assert cli("stop", "1").returncode == 2
        left = wait_gone(state, timeout=15)
        assert not left, [p.cmdline() for p in left]
    finally:
        kill_all(state)
