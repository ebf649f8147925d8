"""torchrun's last forms, held to torchrun's own parser: `-m MODULE`, `--nproc-per-node
auto|gpu|cpu` and `--nnodes MIN:MAX`. Each command line is read by torch.distributed.run's
parser and by `relaunch validate`; the job relaunch builds runs what torchrun would run, with as
many nodes and processes, or is refused in one line. One real run of `-m` at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import run as torchrun

from relaunch.spec.launch import Machine, nproc_of
from tests.cli import relaunch_here

ROOT = Path(__file__).resolve().parents[1]
DDP = "examples/ddp/train_ddp.py"
MODULE = "examples.ddp.train_ddp"
ELASTIC = [
    "--annotation",
    "recover-strategy=elastic-training",
    "--label",
    "process-recover-enable=on",
    "--label",
    "fault-scheduling=grace",
]


def relaunch_reads(argv: list[str]) -> dict[str, Any]:
    """The job `relaunch validate ARGV` builds, as its --json prints it."""
    result = relaunch_here("validate", "--json", *argv, cwd=ROOT)
    assert result.returncode == 0, (argv, result.stdout, result.stderr)
    shown: dict[str, Any] = json.loads(result.stdout)
    return shown


def torchrun_reads(argv: list[str]) -> dict[str, Any]:
    """What torchrun makes of ARGV on this machine: the command each worker runs, its nodes
    (the range's upper bound: the nodes it starts with when all are there) and its processes
    per node."""
    args = torchrun.get_args_parser().parse_args(argv)
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    program = ["-m", args.training_script] if args.module else [args.training_script]
    return {
        "command": ["python", *program, *args.training_script_args],
        "replicas": max_nodes,
        "procs_per_pod": torchrun.determine_local_world_size(args.nproc_per_node),
    }


FORMS = {
    "numbers": ["--nnodes", "2", "--nproc-per-node", "2", DDP, "--steps", "3"],
    "underscores and =": ["--nnodes=2", "--nproc_per_node=3", DDP],
    "a module": ["--nnodes", "2", "-m", MODULE, "--steps", "3"],
    "a module after options": ["-m", "--nnodes", "2", "--nproc-per-node", "1", MODULE, "--lr", "1"],
    "--module spelled out": ["--module", MODULE, "-m", "x", "--nnodes", "9"],
    "a module, a flag between": ["-m", "--standalone", MODULE, "-q"],
    "a process per CPU": ["--nproc-per-node", "cpu", DDP],
    "auto, no GPU": ["--nproc-per-node", "auto", "-m", MODULE],
    "an equal range": ["--nnodes", "2:2", DDP],
    "an elastic range from one": ["--nnodes", "1:3", DDP],
}
RELAUNCH_SAYS_TOO = {"an elastic range from one": ELASTIC}
"""relaunch's own options a form needs beside torchrun's (which torchrun's parser refuses)."""


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_torchrun_command_line_builds_the_job_torchrun_would_run(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if form == "auto, no GPU":  # what torchrun counts where no accelerator is there
        monkeypatch.setattr(torchrun.torch.accelerator, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = FORMS[form]
    theirs = torchrun_reads(argv)
    ours = relaunch_reads([*RELAUNCH_SAYS_TOO.get(form, []), *argv])
    assert {key: ours[key] for key in theirs} == theirs, ours


def test_a_process_per_cpu_holds_no_chip_and_a_number_a_chip_each() -> None:
    assert relaunch_reads(["--nproc-per-node", "cpu", DDP])["chips_per_pod"] == 0
    assert relaunch_reads(["--nproc-per-node", "2", DDP])["chips_per_pod"] == 2


def test_a_module_job_is_named_after_its_module() -> None:
    assert relaunch_reads(["-m", MODULE])["name"] == "examples-ddp-train-ddp"


def test_the_elastic_range_is_the_strategys_bounds() -> None:
    """`1:MAX` with elastic-training: MAX pods, scaled in down to one (R-33) without a restart."""
    shown = relaunch_reads(["--nnodes", "1:3", *ELASTIC, DDP])
    assert shown["replicas"] == 3
    assert shown["recovery"]["recover_strategies"] == ["elastic-training"]


@pytest.mark.parametrize(
    "gpus, visible, expected",
    [(4, None, 4), (4, "0,1", 2), (4, "", 0), (4, "1,-1,2", 1), (0, "0,1", 0), (2, "0,1,2,3", 2)],
)
def test_the_gpus_counted_are_those_a_process_here_sees(
    gpus: int, visible: str | None, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA_VISIBLE_DEVICES' share of NVML's GPUs, as torch.cuda.device_count() counts them."""
    from relaunch.cli import launch

    monkeypatch.setattr(launch, "gpu_count", lambda: gpus)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert launch.this_machine().gpus == expected


@pytest.mark.parametrize("word", ["gpu", "auto"])
def test_gpu_and_auto_count_gpus_as_torchrun_does(
    word: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine of 3 GPUs (torch's view stubbed, as this machine may have none), torchrun
    starts 3 processes a node for `gpu` and `auto`, and so does relaunch, a chip each."""
    monkeypatch.setattr(torchrun.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torchrun.torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torchrun.torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torchrun.torch.accelerator, "device_count", lambda: 3)
    monkeypatch.setattr(
        torchrun.torch.accelerator,
        "current_accelerator",
        lambda: torchrun.torch.device("cuda"),
    )
    procs = nproc_of(word, Machine(gpus=3, cpus=16))
    assert int(procs.procs) == torchrun.determine_local_world_size(word) == 3
    assert procs.chips is None and procs.problem is None  # a chip per process


def test_gpu_without_a_gpu_is_refused_as_torchrun_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torchrun.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="Cuda is not available"):
        torchrun.determine_local_world_size("gpu")
    problem = nproc_of("gpu", Machine(gpus=0, cpus=2)).problem
    assert problem is not None and problem.key == "--nproc-per-node"


@pytest.mark.parametrize("nnodes", ["1:2", "2:4", "0:2", "1:2:3", "a:b"])
def test_a_range_relaunch_cannot_keep_is_refused_in_one_line(nnodes: str) -> None:
    """Without elastic-training every unequal range is refused (torchrun would restart every
    worker at a new size); with it, only 1:MAX maps. One problem, one line, nothing started."""
    for extra in ([], ELASTIC):
        if nnodes == "1:2" and extra:
            continue  # the mapped case, above
        result = relaunch_here("validate", "--nnodes", nnodes, *extra, DDP, cwd=ROOT)
        assert result.returncode == 2, (nnodes, extra, result.stdout)
        problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
        assert problems == [problems[0]] and f"--nnodes: '{nnodes}'" in problems[0], problems


def test_a_module_runs_as_python_m_would_run_it(tmp_path: Path) -> None:
    """A real run of `relaunch run --nproc-per-node cpu -m MODULE ARGS`: the ranks run the
    module (a process per CPU, no chips), each a torchelastic launch, and the job succeeds."""
    from tests.test_torchrun_form import relaunch

    report = tmp_path / "report.json"
    result = relaunch(
        "run",
        "--state-dir",
        str(tmp_path / "state"),
        "--report",
        str(report),
        "--nproc-per-node",
        "cpu",
        "--monitor-interval",
        "0.2",
        "-m",
        MODULE,
        "--steps",
        "3",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "hash"),
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(report.read_text())
    assert summary["job"] == "examples-ddp-train-ddp"
    assert summary["status"] == "Succeeded" and summary["recoveries"] == []
    assert (tmp_path / "hash").read_text().strip()  # rank 0 trained to the end and said so
