"""`relaunch validate` as a user runs it: exit codes, messages, no tracebacks. The real `relaunch`
process runs once for a bad file and once for a good one; every other case runs the same app in
this process (tests/cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cli import relaunch_here

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "data" / "bad_jobs"
EXPECTED: dict[str, str] = yaml.safe_load((BAD / "EXPECTED.yaml").read_text())
EXAMPLE_JOBS = sorted(
    p
    for p in (ROOT / "examples").glob("*")
    if p.suffix in (".yaml", ".json") and "spec" in (yaml.safe_load(p.read_text()) or {})
)


def relaunch_process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


relaunch = relaunch_here


def test_the_relaunch_process_refuses_a_bad_file_and_accepts_a_good_one() -> None:
    bad = relaunch_process("validate", str(BAD / "spec_unknown_key.yaml"))
    assert bad.returncode == 2 and EXPECTED["spec_unknown_key.yaml"] in bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout and bad.stdout == ""
    good = relaunch_process("validate", str(EXAMPLE_JOBS[0]))
    assert good.returncode == 0, good.stderr
    assert "valid" in good.stdout and "Recovery levels" in good.stdout


def test_at_least_15_distinct_bad_files_are_kept_as_test_data() -> None:
    files = {p.name for p in BAD.iterdir() if p.name != "EXPECTED.yaml"}
    assert files == set(EXPECTED)
    assert len(files) >= 15


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_validate_rejects_bad_file_naming_the_key(name: str) -> None:
    result = relaunch("validate", str(BAD / name))
    assert result.returncode == 2, result.stdout + result.stderr
    assert EXPECTED[name] in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""


def test_examples_include_the_seeds_annotation_blocks() -> None:
    seeds = {
        "modelarts-recovery.json": {
            "fault-tolerance/job-retry-num": "8",
            "fault-tolerance/job-unconditional-retry": "true",
            "fault-tolerance/hang-retry": "true",
            "fault-tolerance/pod-retry-num": "3",
        },
        "modelarts-unconditional.json": {
            "fault-tolerance/job-retry-num": "8",
            "fault-tolerance/job-unconditional-retry": "true",
        },
        "modelarts-hang-retry.json": {
            "fault-tolerance/job-retry-num": "3",
            "fault-tolerance/hang-retry": "true",
        },
    }
    for name, expected in seeds.items():
        data = json.loads((ROOT / "examples" / name).read_text())
        assert data["kind"] == "job"
        assert data["metadata"]["annotations"] == expected


@pytest.mark.parametrize("path", EXAMPLE_JOBS, ids=lambda p: p.name)
def test_validate_accepts_every_example_and_prints_the_ladder(path: Path) -> None:
    result = relaunch("validate", str(path))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "Recovery levels" in result.stdout
    assert "What happens on a fault" in result.stdout


def test_validate_json_reports_effective_settings_and_ladder() -> None:
    result = relaunch("validate", "--json", "examples/modelarts-recovery.json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["recovery"]["job_retry_budget"] == 8
    assert report["recovery"]["pod_retry_budget"] == 3
    assert report["recovery"]["hang_retry"] is True
    assert report["ladder"]["rank crashes (exit 1)"] == ["job-reschedule", "fail"]
    assert report["ladder"]["node lost"] == ["pod-reschedule", "job-reschedule", "fail"]
    assert report["ladder"]["job hangs"] == ["hang-restart", "fail"]


def test_validate_of_a_missing_file_is_a_clear_error() -> None:
    result = relaunch("validate", "no/such/job.yaml")
    assert result.returncode == 2
    assert "no such file" in result.stderr and "Traceback" not in result.stderr


def test_faults_lists_the_table_and_applies_overrides() -> None:
    result = relaunch("faults", "--fault-table", "examples/fault-table.yaml")
    assert result.returncode == 0, result.stderr
    assert "80E01801" in result.stdout and "RestartBusiness" in result.stdout
    assert "3 in a row within 24 h" in result.stdout


def test_faults_with_a_bad_table_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "table.yaml"
    bad.write_text("codes:\n  - code: XYZ\n    level: Reboot\n")
    result = relaunch("faults", "--fault-table", str(bad))
    assert result.returncode == 2
    assert "codes[0].code" in result.stderr and "codes[0].level" in result.stderr


def test_version_prints_and_exits_zero() -> None:
    from relaunch import __version__

    done = relaunch("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"relaunch {__version__}"
