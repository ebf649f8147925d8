"""torchrun's form of a job: `relaunch run --nnodes N --nproc-per-node M script.py ARGS` builds
the job mapping a job file would hold, so that both forms are checked by the same parser and get
the same recovery ladder. Pure: the command line reads the options, this only shapes them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from relaunch.errors import Problem
from relaunch.spec.vocabulary import (
    HANG_RETRY,
    JOB_RETRY_NUM,
    JOB_UNCONDITIONAL_RETRY,
    POD_RETRY_NUM,
)

__all__ = ["DEFAULT_MAX_RESTARTS", "OPTION_OF", "Launch", "launch_job", "option_problems"]

DEFAULT_MAX_RESTARTS: Final = 3
"""Job-level restarts when `--max-restarts` is not given. torchrun's default is 0 (the first
fault ends the job); a user who replaces torchrun with relaunch wants the ladder, so relaunch
restarts three times, the value torchrun's own docs use in their fault-tolerant example."""

OPTION_OF: Final[Mapping[str, str]] = {
    "spec.replicas": "--nnodes",
    "spec.procs_per_pod": "--nproc-per-node",
    "spec.chips_per_pod": "--nproc-per-node",
    "spec.command": "SCRIPT",
    "spec.monitor_interval": "--monitor-interval",
    "spec.hang_detect_seconds": "--hang-detect-seconds",
    "spec.warm_spares": "--warm-spares",
    "metadata.name": "--name",
    f"metadata.annotations.{JOB_RETRY_NUM}": "--max-restarts",
    f"metadata.annotations.{JOB_UNCONDITIONAL_RETRY}": "--unconditional-retry",
    f"metadata.annotations.{HANG_RETRY}": "--hang-retry",
    f"metadata.annotations.{POD_RETRY_NUM}": "--pod-retry-num",
}
"""The job file key each option fills, to name the option the user typed in an error."""

_NAME_CHARS = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True)
class Launch:
    """What a torchrun-shaped command line says. `nnodes` and `nproc_per_node` stay text, as
    typed, so that a wrong one is reported against its option like any other bad input."""

    script: str
    args: tuple[str, ...] = ()
    nnodes: str = "1"
    nproc_per_node: str = "1"
    name: str | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    pod_retry_num: int | None = None
    hang_retry: bool = True
    unconditional_retry: bool = True
    """On with `--max-restarts`'s torchrun meaning: any failure restarts the job, not only the
    environment faults that relaunch's automatic restart is for (R-02)."""
    hang_detect_seconds: float | None = None
    monitor_interval: float | None = None
    warm_spares: int | None = None
    annotations: tuple[str, ...] = ()
    """`KEY=VALUE` pairs, any ModelArts annotation a job file may hold."""
    labels: tuple[str, ...] = ()
    """`KEY=VALUE` pairs, any MindCluster label a job file may hold."""
    env: tuple[str, ...] = field(default=())
    """`KEY=VALUE` pairs added to every rank's environment."""


def launch_job(launch: Launch) -> tuple[dict[str, Any], list[Problem]]:
    """The job mapping of a torchrun-shaped command line: `--nnodes` pods of `--nproc-per-node`
    processes with a chip each, running `python SCRIPT ARGS`; `--max-restarts` job-level restarts
    on any failure (torchrun's meaning: unconditional retry), hang retry on; the rest as a job file would say it. Returned with the
    problems of what cannot even be put into a mapping (a MIN:MAX node range, a pair without
    `=`), each naming its option; the values themselves are `parse_job`'s to check, as a file's
    are (counts are passed on as typed, so that parse_job names a bad one)."""
    problems: list[Problem] = []
    annotations = _pairs(launch.annotations, "--annotation", problems)
    labels = _pairs(launch.labels, "--label", problems)
    env = _pairs(launch.env, "--env", problems)
    if launch.max_restarts != 0:
        annotations.setdefault(JOB_RETRY_NUM, str(launch.max_restarts))
    if launch.unconditional_retry and launch.max_restarts != 0:
        annotations.setdefault(JOB_UNCONDITIONAL_RETRY, "true")
    if launch.hang_retry and launch.max_restarts != 0:  # a hang restart is a job-level restart
        annotations.setdefault(HANG_RETRY, "true")
    if launch.pod_retry_num is not None:
        annotations.setdefault(POD_RETRY_NUM, str(launch.pod_retry_num))
    spec: dict[str, Any] = {
        "procs_per_pod": launch.nproc_per_node,
        "command": ["python", launch.script, *launch.args],
    }
    if ":" in launch.nnodes:
        problems.append(
            Problem(
                "--nnodes",
                launch.nnodes,
                "a number of nodes; relaunch scales a job in and out with the recovery "
                "strategy elastic-training (--annotation recover-strategy=elastic-training,...), "
                "not a MIN:MAX range",
            )
        )
    else:
        spec["replicas"] = launch.nnodes
    if launch.nproc_per_node.isdigit():
        spec["chips_per_pod"] = launch.nproc_per_node  # a chip per rank, as torchrun on GPUs
    for key, value in (
        ("hang_detect_seconds", launch.hang_detect_seconds),
        ("monitor_interval", launch.monitor_interval),
        ("warm_spares", launch.warm_spares),
    ):
        if value is not None:
            spec[key] = value
    if env:
        spec["env"] = env
    document = {
        "kind": "job",
        "metadata": {
            "name": launch.name if launch.name is not None else job_name_of(launch.script),
            "annotations": annotations,
            "labels": labels,
        },
        "spec": spec,
    }
    return document, problems


def job_name_of(script: str) -> str:
    """A job's name from its script's file name: `train_ddp.py` -> `train-ddp`."""
    stem = script.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
    name = _NAME_CHARS.sub("-", stem.lower()).strip("-")[:63].strip("-")
    return name or "job"


def option_problems(problems: Sequence[Problem]) -> list[Problem]:
    """The parser's problems with each job file key replaced by the option that filled it."""
    return [Problem(_option_key(p.key), p.value, p.allowed, p.found) for p in problems]


def _option_key(key: str) -> str:
    if key in OPTION_OF:
        return OPTION_OF[key]
    for prefix, option in (
        ("metadata.annotations.", "--annotation "),
        ("metadata.labels.", "--label "),
        ("spec.env.", "--env "),
    ):
        if key.startswith(prefix):
            return option + key.removeprefix(prefix)
    return key


def _pairs(pairs: Sequence[str], option: str, problems: list[Problem]) -> dict[str, str]:
    found: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            problems.append(Problem(option, pair, "KEY=VALUE"))
            continue
        if key in found:
            problems.append(Problem(option, pair, f"each key once; {key} was given twice"))
            continue
        found[key] = value
    return found
