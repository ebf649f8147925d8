"""torchrun's form, `relaunch run --nnodes N --nproc-per-node M script.py ARGS`: the job it builds
is the job file's (same checks, same recovery ladder), every bad option is named, and a DDP run
in this form recovers from a crash. Real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from relaunch.cli import app
from relaunch.spec import parse_job
from relaunch.spec.launch import DEFAULT_MAX_RESTARTS, Launch, job_name_of, launch_job
from tests.cli import relaunch_here
from tests.test_torchrun_forms import ELASTIC

ROOT = Path(__file__).resolve().parents[1]
DDP = "examples/ddp/train_ddp.py"


def relaunch(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def validate(*args: str) -> subprocess.CompletedProcess[str]:
    """`relaunch validate ARGS` in this process (tests/cli.py): it starts nothing; the options'
    way through a real `relaunch run` process is test_relaunch_run_reads_the_options_..."""
    return relaunch_here("validate", *args, cwd=ROOT)


def test_the_torchrun_form_defaults_to_torchruns_shape_with_the_ladder_on() -> None:
    raw, problems = launch_job(Launch("train.py", ("--lr", "0.1"), "2", "4"))
    job = parse_job(raw)
    assert problems == []
    assert (job.replicas, job.procs_per_pod, job.chips_per_pod) == (2, 4, 4)
    assert job.command == ("python", "train.py", "--lr", "0.1")
    assert job.name == "train"
    assert job.recovery.job_retry_budget == DEFAULT_MAX_RESTARTS
    assert job.recovery.unconditional_retry  # torchrun restarts on any failure
    assert job.recovery.hang_retry


def test_max_restarts_0_is_torchruns_no_restart() -> None:
    raw, _ = launch_job(Launch("train.py", max_restarts=0))
    job = parse_job(raw)
    assert not job.recovery.auto_restart
    assert not job.recovery.unconditional_retry


@pytest.mark.parametrize(
    ("script", "name"),
    [
        ("train.py", "train"),
        ("examples/ddp/train_ddp.py", "train-ddp"),
        ("My Model.V2.py", "my-model-v2"),
        ("___.py", "job"),
        ("9lives.py", "9lives"),
        ("x" * 80 + ".py", "x" * 63),
    ],
)
def test_a_job_is_named_after_its_script_with_a_name_the_spec_accepts(
    script: str, name: str
) -> None:
    assert job_name_of(script) == name
    raw, _ = launch_job(Launch(script))
    assert parse_job(raw).name == name


def test_the_torchrun_form_has_the_job_files_settings_and_ladder() -> None:
    """examples/ddp/job.yaml, said as options: `relaunch validate --json` prints the same."""
    from_file = validate("--json", "examples/ddp/job.yaml")
    spec = yaml.safe_load((ROOT / "examples/ddp/job.yaml").read_text())["spec"]
    script, *args = spec["command"].split()[1:]
    from_options = validate(
        "--json",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--name",
        "ddp",
        "--max-restarts",
        "6",
        "--pod-retry-num",
        "2",
        "--label",
        "fault-scheduling=grace",
        "--label",
        "grace-over-time=5",
        "--hang-detect-seconds",
        "4",
        "--monitor-interval",
        "0.2",
        script,
        *args,
    )
    assert from_file.returncode == 0, from_file.stderr
    assert from_options.returncode == 0, from_options.stderr
    shown, expected = json.loads(from_options.stdout), json.loads(from_file.stdout)
    # the file's command is a shell line; the script's words are the same
    assert expected.pop("command") == ["/bin/sh", "-c", " ".join(shown.pop("command"))]
    assert shown == expected


def test_everything_after_the_script_is_the_scripts() -> None:
    """As under torchrun: relaunch's own option names after the script go to the script."""
    result = validate("--json", "--nproc_per_node=3", DDP, "--report", "x", "-q", "--nnodes", "9")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["command"] == ["python", DDP, "--report", "x", "-q", "--nnodes", "9"]
    assert (shown["replicas"], shown["procs_per_pod"]) == (1, 3)


def test_a_py_file_alone_runs_as_torchrun_would_one_process() -> None:
    shown = json.loads(validate("--json", DDP, "--steps", "3").stdout)
    assert (shown["replicas"], shown["procs_per_pod"]) == (1, 1)
    assert shown["command"] == ["python", DDP, "--steps", "3"]


BAD_OPTIONS = {
    "nodes zero": (["--nnodes", "0", DDP], "--nnodes: '0'"),
    "nodes text": (["--nnodes", "two", DDP], "--nnodes: 'two'"),
    "nodes range": (["--nnodes", "1:4", DDP], "restart every worker at a new size"),
    "nodes range above one": (["--nnodes", "2:4", *ELASTIC, DDP], "--nnodes: '2:4'"),
    "nodes range malformed": (["--nnodes", "1:2:3", DDP], "--nnodes: '1:2:3'"),
    "procs zero": (["--nproc-per-node", "0", DDP], "--nproc-per-node: '0'"),
    "procs text": (["--nproc-per-node", "two", DDP], "--nproc-per-node: 'two'"),
    "procs on a device relaunch does not run": (
        ["--nproc-per-node", "xpu", DDP],
        "no xpu or other device",
    ),
    "a module that is not there": (["-m", "no_such_package.train"], "MODULE: 'no_such_package"),
    "a module name that is no name": (["-m", "examples/ddp"], "MODULE: 'examples/ddp'"),
    "restarts over": (["--max-restarts", "500", DDP], "--max-restarts: '500'"),
    "restarts negative": (["--max-restarts", "-1", DDP], "--max-restarts: '-1'"),
    "pod retries zero": (["--pod-retry-num", "0", DDP], "--pod-retry-num: '0'"),
    "hang seconds": (["--hang-detect-seconds", "-4", DDP], "--hang-detect-seconds: -4"),
    "monitor": (["--monitor-interval", "0", DDP], "--monitor-interval: 0"),
    "spares": (["--warm-spares", "99", DDP], "--warm-spares: 99"),
    "name": (["--name", "Not_A_Name", DDP], "--name: 'Not_A_Name'"),
    "annotation pair": (["--annotation", "job-retry", DDP], "--annotation: 'job-retry'"),
    "annotation value": (
        ["--annotation", "recover-strategy=bogus", DDP],
        "--annotation recover-strategy: 'bogus'",
    ),
    "unknown ft annotation": (
        ["--annotation", "fault-tolerance/typo=1", DDP],
        "fault-tolerance/typo",
    ),
    "label value": (
        ["--label", "fault-scheduling=sometimes", DDP],
        "--label fault-scheduling: 'sometimes'",
    ),
    "label twice": (
        ["--label", "pod-rescheduling=on", "--label", "pod-rescheduling=off", DDP],
        "pod-rescheduling was given twice",
    ),
    "env pair": (["--env", "NOVALUE", DDP], "--env: 'NOVALUE'"),
    "no script": (["--nnodes", "2"], "SCRIPT"),
    "missing script": (["--nnodes", "2", "nothere.py"], "a training script that exists"),
    "job file as script": (
        ["--nnodes", "2", "examples/ddp/job.yaml"],
        "a job file takes no --nnodes",
    ),
    "standalone and nodes": (["--standalone", "--nnodes", "2", DDP], "--standalone: '2'"),
    "job file with torchrun options": (
        ["examples/ddp/job.yaml", "--max-restarts", "2", "--label", "a=b"],
        "--max-restarts, --label",
    ),
    "a rendezvous option relaunch runs itself": (
        ["--rdzv-backend", "c10d", "--nnodes", "2", DDP],
        "No such option",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_each_bad_option_is_named(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`relaunch validate`, in this process (typer's runner: the command line as parsed)."""
    monkeypatch.chdir(ROOT)
    args, expected = BAD_OPTIONS[case]
    result = CliRunner().invoke(app, ["validate", *args])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    said = " ".join(result.stderr.split())
    assert expected in said, said
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    "case", ["nodes range", "missing script", "job file with torchrun options", "label value"]
)
def test_relaunch_run_reads_the_options_as_validate_does_and_starts_nothing(
    case: str, tmp_path: Path
) -> None:
    args, expected = BAD_OPTIONS[case]
    state = tmp_path / "state"
    result = relaunch("run", "--state-dir", str(state), *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    said = " ".join(result.stderr.split())
    assert expected in said and "Traceback" not in said, said
    jobs = relaunch("jobs", "--state-dir", str(state))
    assert "train" not in jobs.stdout and "ddp" not in jobs.stdout, jobs.stdout  # none stored


def test_every_bad_option_is_reported_at_once() -> None:
    result = validate(
        "--nnodes",
        "0",
        "--nproc-per-node",
        "x",
        "--max-restarts",
        "500",
        "--label",
        "fault-scheduling=bogus",
        "--env",
        "NOEQ",
        DDP,
    )
    assert result.returncode == 2
    for option in ("--nnodes", "--nproc-per-node", "--max-restarts", "--label", "--env"):
        assert f"  - {option}" in result.stderr, result.stderr
    assert result.stderr.count("\n  - ") == 5


def test_a_missing_script_is_reported_with_the_options_problems_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 49: a missing script and `--nnodes 1:2` reported only the script; every problem
    goes in one answer, as `relaunch validate` promises."""
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(
        app, ["validate", "--nnodes", "1:2", "--max-restarts", "500", "nothere.py"]
    )
    assert result.exit_code == 2, (result.stdout, result.stderr)
    said = " ".join(result.stderr.split())
    for problem in ("SCRIPT: 'nothere.py'", "--nnodes: '1:2'", "--max-restarts"):
        assert problem in said, said


UNDERSCORED = {
    "--nproc_per_node": ("--nproc-per-node", "2", "procs_per_pod", 2),
    "--max_restarts": ("--max-restarts", "5", "job_retry_budget", 5),
    "--monitor_interval": ("--monitor-interval", "0.5", "monitor_interval_s", 0.5),
    "--hang_detect_seconds": ("--hang-detect-seconds", "7", "hang_detect_s", 7),
    "--warm_spares": ("--warm-spares", "1", "warm_spares", 1),
    "--pod_retry_num": ("--pod-retry-num", "2", "pod_retry_budget", 2),
}


@pytest.mark.parametrize("underscored", sorted(UNDERSCORED))
def test_torchruns_underscore_spellings_are_taken_for_every_option(
    underscored: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun takes `--max_restarts` as it takes `--max-restarts`; so does relaunch, for every
    option of more than one word (before: `--nproc_per_node` only)."""
    monkeypatch.chdir(ROOT)
    dashed, value, key, expected = UNDERSCORED[underscored]
    shown = []
    for option in (dashed, underscored):
        result = CliRunner().invoke(
            app, ["validate", "--json", "--nnodes", "2", option, value, DDP]
        )
        assert result.exit_code == 0, (option, result.stdout, result.stderr)
        shown.append(json.loads(result.stdout))
    assert shown[0] == shown[1]
    found = shown[0].get(key, shown[0].get("recovery", {}).get(key))
    assert found == expected, shown[0]


@pytest.mark.parametrize(
    "on, off, key",
    [
        ("--unconditional-retry", "--environment-faults-only", "unconditional_retry"),
        ("--hang-retry", "--no-hang-retry", "hang_retry"),
    ],
)
def test_a_default_said_is_taken_its_opposite_turns_it_off_and_both_are_refused(
    on: str, off: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--help` lists only the switch that changes something (`--no-hang-retry`); the default's
    own name is still taken, as a torchrun user may say it, and both at once are refused."""
    monkeypatch.chdir(ROOT)

    def recovery(*options: str) -> bool:
        result = CliRunner().invoke(app, ["validate", "--json", "--nnodes", "2", *options, DDP])
        assert result.exit_code == 0, (options, result.stdout, result.stderr)
        value: bool = json.loads(result.stdout)["recovery"][key]
        return value

    assert recovery() is recovery(on) is True
    assert recovery(off) is False
    both = CliRunner().invoke(app, ["validate", "--nnodes", "2", on, off, DDP])
    assert both.exit_code == 2
    said = " ".join(both.stderr.replace("│", " ").split())
    assert f"{on} and {off} say opposite things" in said, said
    shown = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "80"}).stdout
    assert off in shown and on not in shown.replace(off, "")


def test_resume_takes_a_job_not_a_script(tmp_path: Path) -> None:
    result = relaunch("run", "--resume", "--state-dir", str(tmp_path), "--nnodes", "2", DDP)
    assert result.returncode == 2
    assert "the job's name or id, with --resume" in " ".join(result.stderr.split())


def test_a_ddp_script_run_in_the_torchrun_form_recovers_from_a_crash(tmp_path: Path) -> None:
    """The README's line, with a crash: a job-level restart, the run resumed from its checkpoint
    and every rank a torchelastic launch."""
    plan = tmp_path / "faults.yaml"
    plan.write_text(
        yaml.safe_dump({"faults": [{"kind": "process-exit", "at_step": 6, "pod": 1, "rank": 3}]})
    )
    report = tmp_path / "report.json"
    result = relaunch(
        "run",
        "--state-dir",
        str(tmp_path / "state"),
        "--faults",
        str(plan),
        "--report",
        str(report),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        DDP,
        "--steps",
        "14",
        "--ckpt-every",
        "5",
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(report.read_text())
    assert summary["job"] == "train-ddp"
    assert [r["action"] for r in summary["recoveries"]] == ["job-reschedule"]
    resumed = {int(n) for n in re.findall(r"resume_step=(\d+)", result.stdout)}
    # the restart resumed from a checkpoint (which one: how far the ranks ran past step 6
    # before the crash landed)
    assert len(resumed) == 2 and min(resumed) == 0 and 0 < max(resumed) <= 14, resumed
