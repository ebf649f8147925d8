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
    RECOVER_STRATEGY,
    RecoverStrategy,
)

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "NPROC_WORDS",
    "OPTION_OF",
    "Launch",
    "Machine",
    "launch_job",
    "nproc_of",
    "option_problems",
]

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

NPROC_WORDS: Final = ("auto", "gpu", "cpu")
"""The words torchrun's `--nproc-per-node` takes besides a number (torch.distributed.run's
determine_local_world_size): a process per GPU, per CPU, or per GPU where there are GPUs and per
CPU where there are none. torchrun's `xpu` and private-backend words name devices relaunch does
not run on, and are refused."""


@dataclass(frozen=True)
class Machine:
    """What `--nproc-per-node auto|gpu|cpu` counts, read by the command line on the machine it
    runs on: the GPUs a process there sees (CUDA_VISIBLE_DEVICES' share of NVML's) and the CPUs
    it may run on (its affinity, as torchrun counts them)."""

    gpus: int
    cpus: int


@dataclass(frozen=True)
class Procs:
    """`--nproc-per-node` resolved: processes per pod as text (parse_job checks a number), the
    chips they hold (None: as many as processes, parse_job's default), or the problem."""

    procs: str
    chips: int | None = None
    problem: Problem | None = None


def nproc_of(value: str, machine: Machine) -> Procs:
    """`--nproc-per-node` as torchrun resolves it on `machine`: a number as typed (a chip per
    process, as torchrun on GPUs), `gpu` one per GPU (refused without one, as torchrun raises
    "Cuda is not available"), `cpu` one per CPU with no chips (CPU processes), `auto` `gpu`
    where there are GPUs, else `cpu`."""
    word = value.strip().lower()
    if word == "auto":
        word = "gpu" if machine.gpus > 0 else "cpu"
    if word == "gpu":
        if machine.gpus <= 0:
            return Procs(
                "1",  # the problem below is the one to report
                problem=Problem(
                    "--nproc-per-node",
                    value,
                    "a process per GPU, and this machine has none that NVML sees: give a "
                    "number, or auto (a process per CPU where there is no GPU)",
                ),
            )
        return Procs(str(machine.gpus))
    if word == "cpu":
        return Procs(str(max(1, machine.cpus)), chips=0)
    if value.strip().lstrip("+-").isdigit():
        return Procs(value)  # parse_job checks the number's range, as a job file's
    return Procs(
        "1",
        problem=Problem(
            "--nproc-per-node",
            value,
            "a number of processes, or torchrun's gpu, cpu or auto (relaunch runs on NVIDIA "
            "GPUs and CPUs: no xpu or other device)",
        ),
    )


@dataclass(frozen=True)
class Launch:
    """What a torchrun-shaped command line says. `nnodes` and `nproc_per_node` stay text, as
    typed, so that a wrong one is reported against its option like any other bad input."""

    script: str
    """The training script's path, or with `module` the module `python -m` runs."""
    args: tuple[str, ...] = ()
    nnodes: str = "1"
    nproc_per_node: str = "1"
    """A number as typed; torchrun's words (NPROC_WORDS) are resolved before, by nproc_of."""
    chips_per_pod: int | None = None
    """nproc_of's chips (0 for CPU processes); None: a chip per process."""
    module: bool = False
    """torchrun's `-m`: the script is a module, run as `python -m MODULE ARGS`."""
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
    processes with a chip each, running `python SCRIPT ARGS` (`python -m MODULE ARGS` with
    `-m`); `--max-restarts` job-level restarts on any failure (torchrun's meaning: unconditional
    retry), hang retry on; the rest as a job file would say it. Returned with the problems of
    what cannot even be put into a mapping (a MIN:MAX node range relaunch has no equivalent of,
    a pair without `=`), each naming its option; the values themselves are `parse_job`'s to
    check, as a file's are (counts are passed on as typed, so that parse_job names a bad one)."""
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
    program = ["-m", launch.script] if launch.module else [launch.script]
    spec: dict[str, Any] = {
        "procs_per_pod": launch.nproc_per_node,
        "command": ["python", *program, *launch.args],
    }
    replicas, problem = _nodes(launch.nnodes, annotations)
    if problem is not None:
        problems.append(problem)
    else:
        spec["replicas"] = replicas
    if launch.chips_per_pod is not None:
        spec["chips_per_pod"] = launch.chips_per_pod
    elif launch.nproc_per_node.isdigit():
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


def _nodes(nnodes: str, annotations: Mapping[str, str]) -> tuple[str, Problem | None]:
    """`--nnodes` as torchrun parses it (parse_min_max_nnodes): `N`, or `MIN:MAX`, whose equal
    bounds are N. A range of unequal bounds is torchrun's elastic job, which restarts every
    worker at a new world size; relaunch's elastic-training strategy scales in whole replicas
    down to one, with no restart, through the SDK's keeper: `1:MAX` is exactly its bounds where
    the job asks for it (MAX pods), anything else is refused with what to say instead."""
    low, sep, high = nnodes.partition(":")
    if not sep:
        return nnodes, None
    if low.strip().isdigit() and high.strip().isdigit():
        if int(low) == int(high):
            return high.strip(), None
        strategies = {word.strip() for word in annotations.get(RECOVER_STRATEGY, "").split(",")}
        elastic = RecoverStrategy.ELASTIC_TRAINING.value in strategies
        if int(low) == 1 and int(high) > 1 and elastic:
            return high.strip(), None
    return nnodes, Problem(
        "--nnodes",
        nnodes,
        "N; or 1:MAX with the elastic-training strategy (--annotation "
        "recover-strategy=elastic-training --label process-recover-enable=on --label "
        "fault-scheduling=grace, the SDK's keeper in the script), which keeps MAX pods and "
        "scales in down to one without a restart; torchrun's other ranges restart every worker "
        "at a new size, which relaunch does not",
    )


def job_name_of(script: str) -> str:
    """A job's name from its script's file name (`train_ddp.py` -> `train-ddp`), or from a
    module's name (`torchtitan.train` -> `torchtitan-train`)."""
    stem = script.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py").replace(".", "-")
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
