"""The server and the store under concurrent and hostile input, against a real `relaunch server`
on loopback: never a 500, never another request's data, nothing stored from a refused request.
"""

from __future__ import annotations

import itertools
import json
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.runtime import FAST_CLUSTER, ROOT, Cluster, Server, kill_all, toy_job, wait_gone


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server that queues jobs and starts none: what it answers is all there is to see. One
    for the module (each start is a new interpreter); each test keeps to a project of its own."""
    s = Server(tmp_path_factory.mktemp("paused"), "--paused").start()
    yield s
    s.stop()
    left = wait_gone(s.state, timeout=10)
    kill_all(s.state)
    assert not left


PROJECTS = itertools.count(1)


@pytest.fixture
def project() -> str:
    """A project of this test's own on the shared server: its listings are its jobs only."""
    return f"hostile-{next(PROJECTS)}"


def auth(server: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def body(name: str = "hostile", **spec: Any) -> dict[str, Any]:
    return {"kind": "job", "metadata": {"name": name}, "spec": {"command": "true", **spec}}


def listed(server: Server, project: str) -> int:
    r = httpx.get(f"{server.url}/v2/{project}/training-jobs")
    assert r.status_code == 200, r.text
    count: int = r.json()["count"]
    return count


def test_40_concurrent_creates_and_terminates_return_each_its_own_job_and_never_500(
    paused: Server,
    project: str,
) -> None:
    n = 40
    barrier = threading.Barrier(n)
    created: dict[int, httpx.Response] = {}
    stopped: dict[int, httpx.Response] = {}

    def create(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            created[i] = client.post(
                f"{paused.url}/v2/{project}/training-jobs",
                json=body(f"job-{i}"),
                headers=auth(paused),
            )

    def terminate(i: int, job_id: str) -> None:
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            stopped[i] = client.post(
                f"{paused.url}/v2/{project}/training-jobs/{job_id}/actions",
                json={"action_type": "terminate"},
                headers=auth(paused),
            )

    threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in created.values()) == [201] * n
    views = {i: r.json() for i, r in created.items()}
    assert all(v["metadata"]["name"] == f"job-{i}" for i, v in views.items())  # its own job
    ids = {v["metadata"]["id"] for v in views.values()}
    assert len(ids) == n and listed(paused, project) == n

    threads = [
        threading.Thread(target=terminate, args=(i, v["metadata"]["id"])) for i, v in views.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in stopped.values()) == [202] * n, [
        r.text for r in stopped.values() if r.status_code != 202
    ]
    for i, r in stopped.items():
        assert r.json()["metadata"]["id"] == views[i]["metadata"]["id"]
        assert r.json()["status"]["phase"] == "Stopped"


def test_superscript_digit_as_job_id_is_404_not_500(paused: Server, project: str) -> None:
    base = f"{paused.url}/v2/{project}/training-jobs/%C2%B2"
    for suffix in ("", "/progress", "/recoveries"):
        r = httpx.get(base + suffix)
        assert r.status_code == 404 and r.json()["error_code"] == "RL.0404", (suffix, r.text)
    r = httpx.post(base + "/actions", json={"action_type": "terminate"}, headers=auth(paused))
    assert r.status_code == 404, r.text
    r = httpx.post(base + "/faults", json={"faults": []}, headers=auth(paused))
    assert r.status_code == 404, r.text


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_a_spec_value_is_400_naming_the_key(
    paused: Server, project: str, constant: str
) -> None:
    raw = json.dumps(body()).replace(
        '"command": "true"', f'"command": "true", "monitor_interval": {constant}'
    )
    r = httpx.post(
        f"{paused.url}/v2/{project}/training-jobs",
        content=raw.encode(),
        headers={**auth(paused), "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert [p["key"] for p in r.json()["problems"]] == ["spec.monitor_interval"]
    assert listed(paused, project) == 0


@pytest.mark.parametrize("levels", [30, 260])
def test_deeply_nested_annotations_are_400_and_nothing_is_created(
    paused: Server, project: str, levels: int
) -> None:
    nested: Any = "x"
    for _ in range(levels):
        nested = {"a": nested}
    job = body()
    job["metadata"]["annotations"] = {"deep": nested}
    r = httpx.post(f"{paused.url}/v2/{project}/training-jobs", json=job, headers=auth(paused))
    assert r.status_code == 400, r.text
    assert r.json()["problems"][0]["key"].startswith("metadata.annotations.deep")
    assert (
        listed(paused, project) == 0
    )  # before the fix the row was committed, and this answered 500


def test_400_digit_integer_is_400_and_metrics_stay_200(paused: Server, project: str) -> None:
    job = body()
    job["metadata"]["annotations"] = {
        "fault-tolerance/job-retry-num": "3",
        "fault-tolerance/pod-retry-num": "9" * 400,
    }
    r = httpx.post(f"{paused.url}/v2/{project}/training-jobs", json=job, headers=auth(paused))
    assert r.status_code == 400, r.text
    assert r.json()["problems"][0]["key"] == "metadata.annotations.fault-tolerance/pod-retry-num"
    assert listed(paused, project) == 0
    assert httpx.get(f"{paused.url}/metrics").status_code == 200


@pytest.mark.parametrize(
    "spec, key",
    [
        ({"working_dir": "/no/such/directory"}, "spec.working_dir"),
        ({"env": {"A": "x\u0000y"}}, "spec.env"),
        ({"command": "python\u0000 train.py"}, "spec.command"),
        ({"command": ["python", "a\u0000b"]}, "spec.command"),
    ],
)
def test_a_spec_that_cannot_start_is_refused(
    paused: Server, project: str, spec: dict[str, Any], key: str
) -> None:
    r = httpx.post(
        f"{paused.url}/v2/{project}/training-jobs", json=body(**spec), headers=auth(paused)
    )
    assert r.status_code == 400, r.text
    assert [p["key"] for p in r.json()["problems"]] == [key]
    assert listed(paused, project) == 0


def test_a_command_that_cannot_start_is_a_fault_the_ladder_handles(cluster: Cluster) -> None:
    """Every pod's command fails to start (no such program): each launcher reports the rank's
    exit (127, as a shell would), and R-41's "every pod failed at start" ends the job Failed,
    saying so. Before the fix the launchers crash-looped and the job showed Running for ever."""
    job = toy_job(labels={"fault-retry-times": "3"}, replicas=2)
    job["spec"]["command"] = ["/no/such/program", "--steps", "10"]
    result = cluster.run(job, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    record = result.report["recoveries"][-1]
    assert record["fault"]["kind"] == "process-exit" and record["fault"]["exit_code"] == 127
    assert record["action"] == "fail" and "every pod failed right after start" in record["reason"]
    logs = result.logs()
    assert "could not start '/no/such/program'" in logs


def test_out_of_range_pod_in_post_faults_is_422_and_nothing_is_added(
    paused: Server, project: str
) -> None:
    r = httpx.post(
        f"{paused.url}/v2/{project}/training-jobs", json=body(replicas=2), headers=auth(paused)
    )
    job_id = r.json()["metadata"]["id"]
    url = f"{paused.url}/v2/{project}/training-jobs/{job_id}"
    r = httpx.post(
        url + "/faults",
        json={"faults": [{"kind": "process-exit", "after_s": 0, "pod": 5}]},
        headers=auth(paused),
    )
    assert r.status_code == 422, r.text
    assert [p["key"] for p in r.json()["problems"]] == ["faults[0].pod"]
    assert "0 to 1" in r.json()["problems"][0]["message"]
    assert httpx.get(url).json()["fault_plan"] == []
    r = httpx.post(
        f"{paused.url}/v2/{project}/training-jobs",
        json={**body(), "fault_plan": [{"kind": "hang", "after_s": 1, "pod": 0, "rank": 3}]},
        headers=auth(paused),
    )
    assert r.status_code == 422 and r.json()["problems"][0]["key"] == "faults[0].rank", r.text


def test_a_stale_runner_pid_reused_by_another_process_does_not_keep_jobs_pending(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (state / "runner.pid").write_text(str(bystander.pid))
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(toy_job(steps=10)))
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(yaml.safe_dump(FAST_CLUSTER))
        done = subprocess.run(
            [sys.executable, "-m", "relaunch", "submit", str(job), "--cluster", str(cluster),
             "--state-dir", str(state)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "runner started" in done.stdout, done.stdout
        left = wait_gone(state, timeout=60)  # the runner runs the job and exits
        assert not left
        jobs = subprocess.run(
            [sys.executable, "-m", "relaunch", "jobs", "--state-dir", str(state)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "Succeeded" in jobs.stdout, jobs.stdout
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        kill_all(state)


def test_the_token_is_checked_before_a_body_is_read_and_bodies_are_bounded(
    paused: Server,
    project: str,
) -> None:
    assert paused.process is not None
    server = psutil.Process(paused.process.pid)
    before = server.memory_info().rss
    huge = b"[" + b"1," * (10 * 1024 * 1024) + b"1]"  # 21 MB
    r = httpx.post(
        f"{paused.url}/v2/{project}/training-jobs",
        content=huge,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 401, r.text
    assert server.memory_info().rss - before < 50 * 1024 * 1024  # before the fix: +500 MiB
    r = httpx.post(
        f"{paused.url}/v2/{project}/training-jobs",
        content=b'{"kind": "job", "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}',
        headers={**auth(paused), "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error_code"] == "RL.0413", r.text
    assert listed(paused, project) == 0


def test_state_directory_and_database_are_readable_by_their_owner_only(paused: Server) -> None:
    assert stat.S_IMODE(paused.state.stat().st_mode) == 0o700
    for name in ("relaunch.db", "relaunch.db-wal", "server-token"):
        path = paused.state / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name


def test_loopback_reads_without_the_token_need_a_loopback_host_name(
    paused: Server, project: str
) -> None:
    url = f"{paused.url}/v2/{project}/training-jobs"
    assert httpx.get(url).status_code == 200
    assert httpx.get(url, headers={"Host": f"localhost:{paused.port}"}).status_code == 200
    rebound = httpx.get(url, headers={"Host": f"attacker.example:{paused.port}"})
    assert rebound.status_code == 401 and "loopback host" in rebound.json()["error_msg"]
    with_token = httpx.get(url, headers={"Host": "attacker.example", **auth(paused)})
    assert with_token.status_code == 200
