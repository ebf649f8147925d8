"""Schemathesis against the OpenAPI document of a real server process: no server error, and every
answer in its documented status codes, content types and response schemas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.runtime import Server, kill_all, wait_gone


def _schemathesis(server: Server, config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,"
            "response_schema_conformance,response_headers_conformance",
            "-H",
            f"Authorization: Bearer {server.token}",
            "--max-examples",
            "40",
            "--generation-deterministic",
            "--request-timeout",
            "20",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=config.parent,  # its cache goes beside the config, not into the checkout
    )


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    # Paused: jobs that the fuzzer manages to create are queued, not run.
    server = Server(tmp_path, "--paused").start()
    try:
        job = httpx.post(
            f"{server.url}/v2/fuzz/training-jobs",
            json={"kind": "job", "spec": {"command": "true"}},
            headers={"Authorization": f"Bearer {server.token}"},
        ).json()
        free = tmp_path / "free.toml"
        free.write_text("")
        pinned = tmp_path / "pinned.toml"  # real ids, so that requests reach past the 404s
        pinned.write_text(
            "[parameters]\n"
            '"path.project_id" = "fuzz"\n'
            f'"path.training_job_id" = "{job["metadata"]["id"]}"\n'
            '"path.node_name" = "node-0"\n'
        )
        for config in (free, pinned):
            done = _schemathesis(server, config)
            assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
            assert "passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]
    finally:
        output = server.stop()
        left = wait_gone(server.state, timeout=10)
        kill_all(server.state)
    assert "Traceback" not in output and "Exception" not in output, output[-4000:]
    assert not left
