"""The job spec: ModelArts annotations and MindCluster labels, read exactly, checked fully.

A job file has the ModelArts shape::

    kind: job
    metadata:
      name: demo
      annotations: {fault-tolerance/job-retry-num: "8", recover-strategy: "retry,dump"}
      labels: {fault-scheduling: grace, pod-rescheduling: "on"}
    spec:
      replicas: 2
      procs_per_pod: 2
      command: python train.py

:func:`parse_job` turns such a mapping into a :class:`JobSpec` or raises one
:class:`~relaunch.errors.SpecError` listing every problem, each naming the key, the value and what
is allowed. :attr:`JobSpec.recovery` is the effective :class:`RecoverySettings` that the policy
reads. This module is pure: it never touches files, the clock or an engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from relaunch.errors import MISSING, Problem, SpecError
from relaunch.validation import (
    boolean,
    choice,
    integer,
    lookup,
    problems_from,
    raise_,
    reject,
    seconds,
    v,
)

__all__ = [
    "JOB_RETRY_NUM_MAX",
    "FaultScheduling",
    "Framework",
    "JobSpec",
    "ProcessRecoverEnable",
    "RecoverStrategy",
    "RecoverySettings",
    "parse_job",
    "process_recovery_env",
]

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------

JOB_RETRY_NUM_MAX: Final = 128
POD_RETRY_NUM_MAX: Final = 1000
MODELARTS_GRACE_S: Final = 30
"""SIGTERM -> SIGKILL grace without a `fault-scheduling` label (ModelArts semantics): Kubernetes'
default termination grace period, which ModelArts training containers get."""
MINDCLUSTER_GRACE_S: Final = 900
"""`grace-over-time`'s MindCluster default, with `fault-scheduling: grace`."""
HANG_GRACE_S: Final = 5.0
"""Default grace for processes stopped because the job hung: a hung process cannot save."""
MIN_STARTUP_S: Final = 60.0
MAX_RESTARTS_UNSET: Final = 32767
"""`max_restarts` of 0 or absent means this many process restarts per container (seed 004)."""

FT_PREFIX: Final = "fault-tolerance/"
JOB_RETRY_NUM: Final = "fault-tolerance/job-retry-num"
JOB_UNCONDITIONAL_RETRY: Final = "fault-tolerance/job-unconditional-retry"
HANG_RETRY: Final = "fault-tolerance/hang-retry"
POD_RETRY_NUM: Final = "fault-tolerance/pod-retry-num"
RECOVER_STRATEGY: Final = "recover-strategy"
RECOVER_POLICY_PATH: Final = "huawei.com/recover_policy_path"
WAIT_RESCHEDULE_TIMEOUT: Final = "wait-reschedule-timeout"

POD_RESCHEDULING: Final = "pod-rescheduling"
FAULT_SCHEDULING: Final = "fault-scheduling"
GRACE_OVER_TIME: Final = "grace-over-time"
FAULT_RETRY_TIMES: Final = "fault-retry-times"
PROCESS_RECOVER_ENABLE: Final = "process-recover-enable"
FRAMEWORK: Final = "framework"

ENV_HANG_DETECT_TIME: Final = "MA_HANG_DETECT_TIME"
ENV_TERMINATION_GRACE: Final = "MA_FAILOVER_TERMINATION_GRACE_PERIOD_SECONDS"

FAULT_TOLERANCE_KEYS: Final = (JOB_RETRY_NUM, JOB_UNCONDITIONAL_RETRY, HANG_RETRY, POD_RETRY_NUM)


class FaultScheduling(StrEnum):
    """MindCluster `fault-scheduling`: how pods are stopped when a fault reschedules them."""

    GRACE = "grace"  # SIGTERM, then SIGKILL after grace-over-time
    FORCE = "force"  # SIGKILL at once
    OFF = "off"  # no rescheduling (no resumable training)


class ProcessRecoverEnable(StrEnum):
    """MindCluster `process-recover-enable`."""

    ON = "on"
    PAUSE = "pause"  # hands recovery to pod and job level for now
    OFF = "off"


class RecoverStrategy(StrEnum):
    """The process-level strategies of `recover-strategy`, declared in R-36 priority order."""

    RETRY = "retry"
    RECOVER_IN_PLACE = "recover-in-place"
    RECOVER = "recover"
    ELASTIC_TRAINING = "elastic-training"
    DUMP = "dump"
    EXIT = "exit"

    @property
    def priority(self) -> int:
        return list(RecoverStrategy).index(self)


class Framework(StrEnum):
    PYTORCH = "pytorch"
    MINDSPORE = "mindspore"


# ---------------------------------------------------------------------------------------------
# Scalar readers: the API sends every annotation as a string, so "8" and "true" are accepted.
# Each raises a PydanticCustomError whose message is the "what is allowed" half of a Problem.
# ---------------------------------------------------------------------------------------------


def _on_off(value: Any) -> bool:
    if isinstance(value, str) and value.strip() in ("on", "off"):
        return value.strip() == "on"
    raise reject("'on' or 'off' (MindCluster spelling; 'true' is not accepted)")


def _strategies(value: Any) -> tuple[RecoverStrategy, ...]:
    names = ", ".join(m.value for m in RecoverStrategy)
    allowed = f"a comma-separated list of: {names}"
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
    elif isinstance(value, list | tuple):
        items = [str(item).strip() for item in value]
    else:
        raise reject(allowed)
    if not items:
        raise reject(allowed + " (at least one)")
    unknown = [item for item in items if item not in {m.value for m in RecoverStrategy}]
    if unknown:
        raise reject(f"unknown strategy {', '.join(map(repr, unknown))}; {allowed}")
    chosen = {RecoverStrategy(item) for item in items}
    return tuple(sorted(chosen, key=lambda s: s.priority))


MAX_TEXT: Final = 65536
"""The longest string any spec value may be (a command, an env value, an annotation)."""


def _text_ok(value: str) -> bool:
    """A string a process can be given: no NUL byte (no C string holds one), not too long."""
    return "\0" not in value and len(value) <= MAX_TEXT


def _command(value: Any) -> tuple[str, ...]:
    allowed = "a non-empty shell command string or a non-empty list of strings, without NUL bytes"
    if isinstance(value, str) and value.strip() and _text_ok(value):
        return ("/bin/sh", "-c", value)
    if (
        isinstance(value, list | tuple)
        and value
        and len(value) <= 4096
        and all(isinstance(a, str | int) and not isinstance(a, bool) for a in value)
        and all(_text_ok(str(a)) for a in value)
    ):
        return tuple(str(a) for a in value)
    raise reject(allowed)


def _path(value: Any) -> str:
    if isinstance(value, str) and value.strip() and "\0" not in value and len(value) <= 4096:
        return value
    raise reject("a directory path (a non-empty string without NUL bytes)")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env(value: Any) -> dict[str, str]:
    allowed = "a mapping of environment variable names to string, number or boolean values"
    if not isinstance(value, Mapping):
        raise reject(allowed)
    env: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or len(name) > 256 or not _ENV_NAME.fullmatch(name):
            raise reject(f"{allowed}; {name!r} is not a valid variable name")
        if isinstance(item, bool):
            text = "true" if item else "false"
        elif isinstance(item, str | int) or (isinstance(item, float) and math.isfinite(item)):
            text = str(item)
        else:
            raise reject(f"{allowed}; the value of {name} is a {type(item).__name__}")
        if not _text_ok(text):
            raise reject(f"{allowed}; the value of {name} holds a NUL byte or is too long")
        env[name] = text
    return env


_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _short_text(value: Any) -> str:
    if isinstance(value, str) and len(value) <= 253 and "\0" not in value:
        return value
    raise reject("a string of at most 253 characters")


def _long_text(value: Any) -> str:
    if isinstance(value, str) and _text_ok(value):
        return value
    raise reject(f"a string of at most {MAX_TEXT} characters, without NUL bytes")


def _job_name(value: Any) -> str:
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    raise reject(
        "a name of lowercase letters, digits and '-', starting and ending with a letter or "
        "digit, at most 63 characters"
    )


# ---------------------------------------------------------------------------------------------
# The file's sections, as pydantic models. Unknown keys are rejected in `spec`; annotations and
# labels are Kubernetes maps that legitimately carry other keys, except under fault-tolerance/.
# ---------------------------------------------------------------------------------------------


class Annotations(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    job_retry_num: Annotated[int | None, v(integer(1, JOB_RETRY_NUM_MAX, "restarts"))] = Field(
        None, alias=JOB_RETRY_NUM
    )
    job_unconditional_retry: Annotated[bool, v(boolean)] = Field(
        False, alias=JOB_UNCONDITIONAL_RETRY
    )
    hang_retry: Annotated[bool, v(boolean)] = Field(False, alias=HANG_RETRY)
    pod_retry_num: Annotated[int | None, v(integer(1, POD_RETRY_NUM_MAX, "pod reschedules"))] = (
        Field(None, alias=POD_RETRY_NUM)
    )
    recover_strategy: Annotated[tuple[RecoverStrategy, ...], v(_strategies)] = Field(
        (), alias=RECOVER_STRATEGY
    )
    recover_policy_path: Annotated[
        str | None,
        v(lambda v: v if v in ("pod", "job") else raise_(reject("'pod' or 'job'"))),
    ] = Field(None, alias=RECOVER_POLICY_PATH)
    wait_reschedule_timeout: Annotated[
        int, v(integer(30, 270, "seconds to wait for a replacement"))
    ] = Field(270, alias=WAIT_RESCHEDULE_TIMEOUT)


class Labels(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    pod_rescheduling: Annotated[bool, v(_on_off)] = Field(False, alias=POD_RESCHEDULING)
    fault_scheduling: Annotated[
        FaultScheduling | None,
        v(choice(FaultScheduling, extra="grace: SIGTERM then SIGKILL; force: SIGKILL at once")),
    ] = Field(None, alias=FAULT_SCHEDULING)
    grace_over_time: Annotated[int | None, v(integer(1, 86400, "seconds"))] = Field(
        None, alias=GRACE_OVER_TIME
    )
    fault_retry_times: Annotated[int, v(integer(0, 100, "unconditional retries"))] = Field(
        0, alias=FAULT_RETRY_TIMES
    )
    process_recover_enable: Annotated[
        ProcessRecoverEnable | None, v(choice(ProcessRecoverEnable))
    ] = Field(None, alias=PROCESS_RECOVER_ENABLE)
    framework: Annotated[Framework, v(choice(Framework))] = Field(
        Framework.PYTORCH, alias=FRAMEWORK
    )


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, v(_job_name)] = "job"
    namespace: Annotated[str | None, v(_short_text)] = None
    description: Annotated[str, v(_long_text)] = ""
    annotations: Annotations = Annotations()
    labels: Labels = Labels()


class Workload(BaseModel):
    """`spec`: what runs, how many of it, and the in-container supervisor's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: Annotated[tuple[str, ...], v(_command)]
    replicas: Annotated[int, v(integer(1, 4096, "pods"))] = 1
    procs_per_pod: Annotated[int, v(integer(1, 1024, "processes per pod"))] = 1
    chips_per_pod: Annotated[int | None, v(integer(0, 1024, "chips per pod"))] = None
    env: Annotated[dict[str, str], v(_env)] = Field(default_factory=dict)
    working_dir: Annotated[str | None, v(_path)] = None
    max_restarts: Annotated[int, v(integer(0, MAX_RESTARTS_UNSET, "0 means 32767"))] = 0
    monitor_interval: Annotated[float, v(seconds(0, 3600))] = 5.0
    hang_detect_seconds: Annotated[float | None, v(seconds(0, 7 * 86400))] = None
    hang_grace_seconds: Annotated[float, v(seconds(-1e-9, 86400))] = HANG_GRACE_S
    startup_seconds: Annotated[float | None, v(seconds(0, 7 * 86400))] = None
    backoff_limit: Annotated[int | None, v(integer(0, 1000, "total reschedules"))] = None
    graceful_fault_tolerance: Annotated[bool, v(boolean)] = False
    warm_spares: Annotated[int, v(integer(0, 16, "spare processes per pod"))] = 0


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    api_version: str | None = Field(None, alias="apiVersion")
    kind: Annotated[
        str,
        v(
            lambda v: (
                v if v == "job" else raise_(reject("'job' (the only ModelArts kind relaunch runs)"))
            )
        ),
    ] = "job"
    metadata: Metadata = Metadata()
    spec: Workload


# ---------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoverySettings:
    """The recovery behaviour a job spec asks for, with every default and derivation applied.

    This is what the policy reads; it never looks at annotations or labels itself.
    """

    auto_restart: bool
    """Rescheduling for environment faults is on (job-retry-num, or MindCluster fault-scheduling)."""
    job_retry_budget: int
    """Job-level reschedules allowed (job-retry-num; capped by backoff_limit when both are set)."""
    unconditional_retry: bool
    """ModelArts job-unconditional-retry: any non-zero exit reschedules the job (R-21)."""
    fault_retry_times: int
    """MindCluster unconditional retries of software faults (R-41); 0 means none."""
    hang_retry: bool
    pod_reschedule: bool
    pod_retry_budget: int
    pod_may_fall_back_to_job: bool
    """False with `huawei.com/recover_policy_path: pod` (R-23)."""
    process_recovery: ProcessRecoverEnable
    recover_strategies: tuple[RecoverStrategy, ...]
    """Allowed process-level strategies, in R-36 priority order; empty unless process_recovery is on."""
    wait_reschedule_timeout_s: float
    fault_scheduling: FaultScheduling | None
    termination_grace_s: float
    """SIGTERM -> SIGKILL grace: `grace-over-time` if given; else 900 s with fault-scheduling
    grace (MindCluster), 0 with force, and 30 s without a fault-scheduling label (ModelArts)."""
    hang_grace_s: float
    """The grace when the processes are stopped because the job hung (R-24): a hung process
    cannot save, so at most this long (spec.hang_grace_seconds, default 5 s)."""
    volume_teardown_grace_s: float | None
    """MA_FAILOVER_TERMINATION_GRACE_PERIOD_SECONDS when > 0, else None."""
    hang_detect_s: float
    startup_s: float
    """Allowance for a (re)started rank's first sign of progress (R-25's "own, longer
    allowance"): spec.startup_seconds, default max(2 x hang window, 60 s)."""
    max_restarts: int
    monitor_interval_s: float
    framework: Framework

    @property
    def unconditional(self) -> bool:
        """Software faults are rescheduled, by either product's switch."""
        return self.unconditional_retry or self.fault_retry_times > 0

    @property
    def process_level(self) -> bool:
        return self.process_recovery is ProcessRecoverEnable.ON and bool(self.recover_strategies)


@dataclass(frozen=True)
class JobSpec:
    """A validated job: identity, workload, and the recovery it asks for."""

    name: str
    namespace: str | None
    annotations: Mapping[str, str]
    labels: Mapping[str, str]
    """Labels after defaulting; `process-recover-enable: on` is added when recover-strategy is set."""
    command: tuple[str, ...]
    replicas: int
    procs_per_pod: int
    chips_per_pod: int
    env: Mapping[str, str]
    working_dir: str | None
    recovery: RecoverySettings
    warm_spares: int = 0
    """Pre-started processes per pod (Python up, torch imported) that a process-level in-place
    restart hands the failed rank's identity to, instead of starting a process."""

    @property
    def world_size(self) -> int:
        return self.replicas * self.procs_per_pod


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

_TOP_KEYS = ("apiVersion", "kind", "metadata", "spec")


def parse_job(data: Any, *, source: str = "<job>") -> JobSpec:
    """Validate a job mapping (from YAML, JSON or the API) and derive its recovery settings.

    Raises :class:`SpecError` with one :class:`Problem` per invalid key.
    """
    if not isinstance(data, Mapping):
        raise SpecError(
            source,
            [Problem("(top level)", data, "a mapping with keys kind, metadata and spec")],
        )
    problems = _unknown_fault_tolerance_keys(data) + _string_map_problems(data)
    try:
        parsed = _File.model_validate(dict(data))
    except ValidationError as error:
        seen = {p.key for p in problems}
        problems.extend(
            p for p in problems_from(error, data, _File, _FIELD_HINTS) if p.key not in seen
        )
        raise SpecError(source, problems) from None
    if problems:
        raise SpecError(source, problems)
    problems = _cross_checks(parsed, data)
    if problems:
        raise SpecError(source, problems)
    return _build(parsed, data)


MAX_MAP_KEYS: Final = 1024
_MAP_VALUE = (
    "a string (annotation and label values are strings in both ModelArts' API and Kubernetes; "
    "a number or true/false is read as its text)"
)


def _string_map_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Annotations and labels are maps of strings to strings: a nested mapping, a list, null or
    NaN is refused here, naming the key, before anything else reads it."""
    metadata = data.get("metadata")
    problems: list[Problem] = []
    if not isinstance(metadata, Mapping):
        return problems
    for section, model in (("annotations", Annotations), ("labels", Labels)):
        known = {f.alias or name for name, f in model.model_fields.items()}
        entries = metadata.get(section)
        if entries is None or not isinstance(entries, Mapping):
            continue  # the model reports a section that is not a mapping
        where = f"metadata.{section}"
        if len(entries) > MAX_MAP_KEYS:
            problems.append(Problem(where, f"{len(entries)} keys", f"at most {MAX_MAP_KEYS} keys"))
            continue
        for key, value in entries.items():
            if key in known:
                continue  # read by its own field, which says what it allows
            if not isinstance(key, str) or not key or len(key) > 317 or "\0" in key:
                problems.append(
                    Problem(where, key, "keys that are non-empty strings of at most 317 characters")
                )
                continue
            text_ok = isinstance(value, str) and _text_ok(value)
            scalar_ok = isinstance(value, bool | int) or (
                isinstance(value, float) and math.isfinite(value)
            )
            if not (text_ok or scalar_ok):
                problems.append(Problem(f"{where}.{key}", _summary(value), _MAP_VALUE))
    return problems


def _summary(value: Any) -> Any:
    """A value fit to show in a problem: nested structures as their type, not their content."""
    if isinstance(value, Mapping):
        return f"a mapping of {len(value)} key(s)"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} item(s)"
    if isinstance(value, str) and len(value) > 80:
        return value[:77] + "..."
    return value


def _unknown_fault_tolerance_keys(data: Mapping[str, Any]) -> list[Problem]:
    metadata = data.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if not isinstance(annotations, Mapping):
        return []
    allowed = "known fault-tolerance keys are " + ", ".join(FAULT_TOLERANCE_KEYS)
    return [
        Problem(f"metadata.annotations.{key}", value, "unknown key; " + allowed)
        for key, value in annotations.items()
        if isinstance(key, str) and key.startswith(FT_PREFIX) and key not in FAULT_TOLERANCE_KEYS
    ]


_FIELD_HINTS: Final = {
    ("spec",): "a mapping with at least `command` (what each process runs)",
    ("spec", "command"): "a non-empty shell command string or a non-empty list of strings",
}


def _cross_checks(parsed: _File, data: Mapping[str, Any]) -> list[Problem]:
    """Rules across keys: R-01 dependencies, R-03, and settings that contradict each other."""
    ann = parsed.metadata.annotations
    lab = parsed.metadata.labels
    work = parsed.spec
    raw_ann = lookup(data, ("metadata", "annotations"))
    raw_lab = lookup(data, ("metadata", "labels"))
    problems: list[Problem] = []

    def ann_key(key: str) -> str:
        return f"metadata.annotations.{key}"

    def lab_key(key: str) -> str:
        return f"metadata.labels.{key}"

    if ann.job_retry_num is None:
        needs = {
            JOB_UNCONDITIONAL_RETRY: ann.job_unconditional_retry,
            HANG_RETRY: ann.hang_retry,
            POD_RETRY_NUM: ann.pod_retry_num is not None,
        }
        for key, is_set in needs.items():
            if is_set:
                problems.append(
                    Problem(
                        ann_key(key),
                        raw_ann[key],
                        f"{key} needs {JOB_RETRY_NUM} (1..{JOB_RETRY_NUM_MAX}) to be set too",
                    )
                )

    if lab.fault_scheduling is FaultScheduling.OFF:
        enabling = [
            (ann_key(JOB_RETRY_NUM), ann.job_retry_num is not None, raw_ann),
            (lab_key(POD_RESCHEDULING), lab.pod_rescheduling, raw_lab),
            (lab_key(FAULT_RETRY_TIMES), lab.fault_retry_times > 0, raw_lab),
        ]
        for key, is_set, raw in enabling:
            if is_set:
                problems.append(
                    Problem(
                        key,
                        raw[key.rsplit(".", 1)[1]],
                        f"{lab_key(FAULT_SCHEDULING)} is 'off', which disables rescheduling; "
                        "remove this key or set fault-scheduling to 'grace' or 'force'",
                    )
                )

    process_on = lab.process_recover_enable is ProcessRecoverEnable.ON or (
        lab.process_recover_enable is None and ann.recover_strategy
    )
    if process_on:
        if not ann.recover_strategy:
            problems.append(
                Problem(
                    ann_key(RECOVER_STRATEGY),
                    MISSING,
                    "process-recover-enable is 'on', so list the allowed strategies, e.g. "
                    "'retry,recover-in-place,recover,dump,exit'",
                )
            )
        if lab.fault_scheduling is not FaultScheduling.GRACE:
            problems.append(
                Problem(
                    lab_key(FAULT_SCHEDULING),
                    raw_lab.get(FAULT_SCHEDULING, MISSING)
                    if isinstance(raw_lab, Mapping)
                    else MISSING,
                    "process-level recovery (recover-strategy / process-recover-enable: on) needs "
                    "fault-scheduling: grace",
                )
            )
        if work.graceful_fault_tolerance:
            problems.append(
                Problem(
                    "spec.graceful_fault_tolerance",
                    True,
                    "process-level recovery and graceful fault tolerance cannot be combined "
                    "(R-03: MindCluster would fall back to job-level rescheduling); "
                    "turn one of them off",
                )
            )
    rescheduling = ann.job_retry_num is not None or lab.fault_scheduling in (
        FaultScheduling.GRACE,
        FaultScheduling.FORCE,
    )
    if not rescheduling and lab.fault_scheduling is not FaultScheduling.OFF:
        for key, is_set in (
            (POD_RESCHEDULING, lab.pod_rescheduling),
            (FAULT_RETRY_TIMES, lab.fault_retry_times > 0),
        ):
            if is_set:
                problems.append(
                    Problem(
                        lab_key(key),
                        raw_lab[key],
                        f"{key} needs rescheduling on: set {JOB_RETRY_NUM} or the label "
                        f"{FAULT_SCHEDULING}: grace / force",
                    )
                )
    if ann.recover_policy_path == "pod" and not lab.pod_rescheduling and ann.pod_retry_num is None:
        problems.append(
            Problem(
                ann_key(RECOVER_POLICY_PATH),
                "pod",
                "'pod' only makes sense with pod-level rescheduling on "
                f"({POD_RETRY_NUM} or the label {POD_RESCHEDULING}: on)",
            )
        )

    env_problems = _env_checks(work.env)
    problems.extend(env_problems)
    return problems


_HANG_MINUTES = integer(1, 7 * 24 * 60, "minutes")
_TEARDOWN_SECONDS = integer(-1, 86400, "seconds; -1 disables")


def _env_checks(env: Mapping[str, str]) -> list[Problem]:
    problems: list[Problem] = []
    for name, reader in (
        (ENV_HANG_DETECT_TIME, _HANG_MINUTES),
        (ENV_TERMINATION_GRACE, _TEARDOWN_SECONDS),
    ):
        if name in env:
            try:
                reader(env[name])
            except PydanticCustomError as error:
                problems.append(
                    Problem(
                        f"spec.env.{name}",
                        env[name],
                        str(error.context["allowed"] if error.context else error),
                    )
                )
    return problems


def _build(parsed: _File, data: Mapping[str, Any]) -> JobSpec:
    ann = parsed.metadata.annotations
    lab = parsed.metadata.labels
    work = parsed.spec

    modelarts_on = ann.job_retry_num is not None
    mindcluster_on = lab.fault_scheduling in (FaultScheduling.GRACE, FaultScheduling.FORCE)
    auto_restart = modelarts_on or mindcluster_on
    budgets = [b for b in (ann.job_retry_num, work.backoff_limit) if b is not None]
    # Without job-retry-num or backoff_limit, MindCluster's maxRetry default of 3 applies.
    job_budget = min(budgets) if budgets else (3 if mindcluster_on else 0)

    pod_on = auto_restart and (ann.pod_retry_num is not None or lab.pod_rescheduling)
    pod_budget = ann.pod_retry_num if ann.pod_retry_num is not None else job_budget

    labels = _string_map(lookup(data, ("metadata", "labels")))
    annotations = _string_map(lookup(data, ("metadata", "annotations")))
    process = lab.process_recover_enable
    if process is None:
        process = ProcessRecoverEnable.ON if ann.recover_strategy else ProcessRecoverEnable.OFF
        if ann.recover_strategy:
            labels[PROCESS_RECOVER_ENABLE] = ProcessRecoverEnable.ON.value  # R-07, as the operator

    if work.hang_detect_seconds is not None:
        hang_s = work.hang_detect_seconds
    else:
        hang_s = 60.0 * int(work.env.get(ENV_HANG_DETECT_TIME, "30"))
    teardown = int(work.env.get(ENV_TERMINATION_GRACE, "-1"))

    recovery = RecoverySettings(
        auto_restart=auto_restart,
        job_retry_budget=job_budget,
        unconditional_retry=ann.job_unconditional_retry,
        fault_retry_times=lab.fault_retry_times,
        hang_retry=ann.hang_retry,
        pod_reschedule=pod_on,
        pod_retry_budget=pod_budget if pod_on else 0,
        pod_may_fall_back_to_job=ann.recover_policy_path != "pod",
        process_recovery=process,
        recover_strategies=ann.recover_strategy if process is ProcessRecoverEnable.ON else (),
        wait_reschedule_timeout_s=float(ann.wait_reschedule_timeout),
        fault_scheduling=lab.fault_scheduling,
        termination_grace_s=_termination_grace(lab),
        hang_grace_s=work.hang_grace_seconds,
        volume_teardown_grace_s=float(teardown) if teardown > 0 else None,
        hang_detect_s=hang_s,
        startup_s=work.startup_seconds
        if work.startup_seconds is not None
        else max(2 * hang_s, MIN_STARTUP_S),
        max_restarts=work.max_restarts or MAX_RESTARTS_UNSET,
        monitor_interval_s=work.monitor_interval,
        framework=lab.framework,
    )
    return JobSpec(
        name=parsed.metadata.name,
        namespace=parsed.metadata.namespace,
        annotations=annotations,
        labels=labels,
        command=work.command,
        replicas=work.replicas,
        procs_per_pod=work.procs_per_pod,
        chips_per_pod=work.procs_per_pod if work.chips_per_pod is None else work.chips_per_pod,
        env=dict(work.env),
        working_dir=work.working_dir,
        recovery=recovery,
        warm_spares=work.warm_spares,
    )


def _termination_grace(lab: Labels) -> float:
    if lab.fault_scheduling is FaultScheduling.FORCE:
        return 0.0
    if lab.grace_over_time is not None:
        return float(lab.grace_over_time)
    if lab.fault_scheduling is FaultScheduling.GRACE:
        return float(MINDCLUSTER_GRACE_S)
    return float(MODELARTS_GRACE_S)


def _string_map(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, Mapping) else {}


# ---------------------------------------------------------------------------------------------
# the environment MindCluster's operator injects for process-level recovery (seed 004,
# Table 3). Several strategies merge: flags are ORed, HIGH_AVAILABILITY lists every value in
# R-36 order, MS_ENABLE_TFT lists every feature.
# ---------------------------------------------------------------------------------------------

_PYTORCH_ENV: Final[Mapping[RecoverStrategy, Mapping[str, str]]] = {
    RecoverStrategy.RECOVER: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "HIGH_AVAILABILITY": "recover",
    },
    RecoverStrategy.RETRY: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "HIGH_AVAILABILITY": "retry",
    },
    RecoverStrategy.RECOVER_IN_PLACE: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "ENABLE_RESTART_FAULT_PROCESS": "on",
        "HIGH_AVAILABILITY": "recover",
    },
    RecoverStrategy.ELASTIC_TRAINING: {
        "PROCESS_RECOVER": "on",
        "HIGH_AVAILABILITY": "elastic-training",
    },
    RecoverStrategy.DUMP: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "HIGH_AVAILABILITY": "dump",
    },
}

_MINDSPORE_TFT: Final[Mapping[RecoverStrategy, tuple[str, ...]]] = {
    RecoverStrategy.RECOVER: ("ARF",),
    RecoverStrategy.RETRY: ("UCE", "HCCE"),
    RecoverStrategy.RECOVER_IN_PLACE: ("ARF",),
    RecoverStrategy.DUMP: ("TTP",),
}


def process_recovery_env(recovery: RecoverySettings) -> dict[str, str]:
    """The variables of seed 004 Table 3 for this job's strategies and pod-rescheduling (R-07)."""
    env: dict[str, str] = {}
    strategies = recovery.recover_strategies if recovery.process_level else ()
    if recovery.framework is Framework.PYTORCH:
        ha: list[str] = []
        for strategy in strategies:
            for name, value in _PYTORCH_ENV.get(strategy, {}).items():
                if name == "HIGH_AVAILABILITY":
                    if value not in ha:
                        ha.append(value)
                else:
                    env[name] = value
        if ha:
            env["HIGH_AVAILABILITY"] = ",".join(ha)
        return env
    features: list[str] = []
    for strategy in strategies:
        if strategy in _MINDSPORE_TFT:
            env.update(
                PROCESS_RECOVER="on", ELASTIC_PROCESS_RECOVER_ENABLE="1", MINDIO_FOR_MINDSPORE="1"
            )
            if strategy is RecoverStrategy.RECOVER_IN_PLACE:
                env["ENABLE_RESTART_FAULT_PROCESS"] = "on"
            features.extend(f for f in _MINDSPORE_TFT[strategy] if f not in features)
    if recovery.pod_reschedule:
        features.append("RSC")
    if features:
        env["MS_ENABLE_TFT"] = "{" + ",".join(f"{f}:1" for f in features) + "}"
    return env
