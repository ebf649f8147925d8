"""The checks a job file passes besides each key's own: the maps of strings, unknown
fault-tolerance keys, and the rules across keys (R-01's dependencies, R-03, contradictions).
Each returns the problems it finds, naming the key. Pure."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pydantic_core import PydanticCustomError

from relaunch.errors import MISSING, Problem
from relaunch.spec.readers import op_retry_enable, op_retry_params, text_ok
from relaunch.spec.sections import Annotations, File, Labels
from relaunch.spec.vocabulary import (
    ENV_HANG_DETECT_TIME,
    ENV_OP_RETRY_ENABLE,
    ENV_OP_RETRY_PARAMS,
    ENV_TERMINATION_GRACE,
    FAULT_RETRY_TIMES,
    FAULT_SCHEDULING,
    FAULT_TOLERANCE_KEYS,
    FT_PREFIX,
    HANG_RETRY,
    JOB_RETRY_NUM,
    JOB_RETRY_NUM_MAX,
    JOB_UNCONDITIONAL_RETRY,
    POD_RESCHEDULING,
    POD_RETRY_NUM,
    PROCESS_RECOVER_ENABLE,
    RECOVER_POLICY_PATH,
    RECOVER_STRATEGY,
    FaultScheduling,
    ProcessRecoverEnable,
)
from relaunch.validation import integer, lookup

__all__ = ["CROSS_RULES", "cross_checks", "string_map_problems", "unknown_fault_tolerance_keys"]

MAX_MAP_KEYS: Final = 1024
_MAP_VALUE: Final = (
    "a string (annotation and label values are strings in both ModelArts' API and Kubernetes; "
    "a number or true/false is read as its text)"
)


def string_map_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Annotations and labels are maps of strings to strings: a nested mapping, a list, null or
    NaN is refused here, naming the key, before anything else reads it."""
    metadata = data.get("metadata")
    if not isinstance(metadata, Mapping):
        return []
    problems: list[Problem] = []
    for section, model in (("annotations", Annotations), ("labels", Labels)):
        entries = metadata.get(section)
        if isinstance(entries, Mapping):
            known = {f.alias or name for name, f in model.model_fields.items()}
            problems += _map_problems(f"metadata.{section}", entries, known)
    return problems


def _map_problems(where: str, entries: Mapping[Any, Any], known: set[str]) -> list[Problem]:
    if len(entries) > MAX_MAP_KEYS:
        return [Problem(where, f"{len(entries)} keys", f"at most {MAX_MAP_KEYS} keys")]
    problems = []
    for key, value in entries.items():
        if key in known:
            continue  # read by its own field, which says what it allows
        if not isinstance(key, str) or not key or len(key) > 317 or "\0" in key:
            problems.append(
                Problem(where, key, "keys that are non-empty strings of at most 317 characters")
            )
            continue
        scalar = isinstance(value, bool | int) or (
            isinstance(value, float) and math.isfinite(value)
        )
        if not ((isinstance(value, str) and text_ok(value)) or scalar):
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


def unknown_fault_tolerance_keys(data: Mapping[str, Any]) -> list[Problem]:
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


# -- rules across keys ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """A parsed file and the raw maps the problems quote values from."""

    parsed: File
    raw_annotations: Any
    raw_labels: Any

    @property
    def ann(self) -> Annotations:
        return self.parsed.metadata.annotations

    @property
    def lab(self) -> Labels:
        return self.parsed.metadata.labels

    def annotation(self, key: str) -> tuple[str, Any]:
        raw = self.raw_annotations
        return f"metadata.annotations.{key}", raw.get(key, MISSING) if isinstance(
            raw, Mapping
        ) else MISSING

    def label(self, key: str) -> tuple[str, Any]:
        raw = self.raw_labels
        return f"metadata.labels.{key}", raw.get(key, MISSING) if isinstance(
            raw, Mapping
        ) else MISSING


def _r01_needs_job_retry_num(j: _Job) -> list[Problem]:
    """R-01: unconditional retry, hang retry and pod retries need job-retry-num."""
    if j.ann.job_retry_num is not None:
        return []
    needs = {
        JOB_UNCONDITIONAL_RETRY: j.ann.job_unconditional_retry,
        HANG_RETRY: j.ann.hang_retry,
        POD_RETRY_NUM: j.ann.pod_retry_num is not None,
    }
    allowed = "{} needs " + f"{JOB_RETRY_NUM} (1..{JOB_RETRY_NUM_MAX}) to be set too"
    return [Problem(*j.annotation(key), allowed.format(key)) for key, on in needs.items() if on]


def _scheduling_off_but_rescheduling_asked(j: _Job) -> list[Problem]:
    if j.lab.fault_scheduling is not FaultScheduling.OFF:
        return []
    asked = [
        (j.annotation(JOB_RETRY_NUM), j.ann.job_retry_num is not None),
        (j.label(POD_RESCHEDULING), j.lab.pod_rescheduling),
        (j.label(FAULT_RETRY_TIMES), j.lab.fault_retry_times > 0),
    ]
    allowed = (
        f"metadata.labels.{FAULT_SCHEDULING} is 'off', which disables rescheduling; "
        "remove this key or set fault-scheduling to 'grace' or 'force'"
    )
    return [Problem(key, value, allowed) for (key, value), on in asked if on]


def _process_recovery_needs(j: _Job) -> list[Problem]:
    """Process-level recovery needs its strategies and fault-scheduling: grace; R-03 forbids
    graceful fault tolerance beside it."""
    process_on = j.lab.process_recover_enable is ProcessRecoverEnable.ON or (
        j.lab.process_recover_enable is None and j.ann.recover_strategy
    )
    if not process_on:
        return []
    problems = []
    if not j.ann.recover_strategy:
        problems.append(
            Problem(
                f"metadata.annotations.{RECOVER_STRATEGY}",
                MISSING,
                "process-recover-enable is 'on', so list the allowed strategies, e.g. "
                "'retry,recover-in-place,recover,dump,exit'",
            )
        )
    if j.lab.fault_scheduling is not FaultScheduling.GRACE:
        problems.append(
            Problem(
                *j.label(FAULT_SCHEDULING),
                "process-level recovery (recover-strategy / process-recover-enable: on) needs "
                "fault-scheduling: grace",
            )
        )
    if j.parsed.spec.graceful_fault_tolerance:
        problems.append(
            Problem(
                "spec.graceful_fault_tolerance",
                True,
                "process-level recovery and graceful fault tolerance cannot be combined "
                "(R-03: MindCluster would fall back to job-level rescheduling); "
                "turn one of them off",
            )
        )
    return problems


def _labels_need_rescheduling(j: _Job) -> list[Problem]:
    rescheduling = j.ann.job_retry_num is not None or j.lab.fault_scheduling in (
        FaultScheduling.GRACE,
        FaultScheduling.FORCE,
    )
    if rescheduling or j.lab.fault_scheduling is FaultScheduling.OFF:
        return []
    asked = (
        (POD_RESCHEDULING, j.lab.pod_rescheduling),
        (FAULT_RETRY_TIMES, j.lab.fault_retry_times > 0),
    )
    return [
        Problem(
            *j.label(key),
            f"{key} needs rescheduling on: set {JOB_RETRY_NUM} or the label "
            f"{FAULT_SCHEDULING}: grace / force",
        )
        for key, on in asked
        if on
    ]


def _pod_path_needs_pod_level(j: _Job) -> list[Problem]:
    if j.ann.recover_policy_path != "pod" or j.lab.pod_rescheduling or j.ann.pod_retry_num:
        return []
    return [
        Problem(
            f"metadata.annotations.{RECOVER_POLICY_PATH}",
            "pod",
            "'pod' only makes sense with pod-level rescheduling on "
            f"({POD_RETRY_NUM} or the label {POD_RESCHEDULING}: on)",
        )
    ]


_HANG_MINUTES = integer(1, 7 * 24 * 60, "minutes")
_TEARDOWN_SECONDS = integer(-1, 86400, "seconds; -1 disables")


def _environment_settings(j: _Job) -> list[Problem]:
    """The settings a job gives through its environment (ModelArts reads them there)."""
    env = j.parsed.spec.env
    problems: list[Problem] = []
    for name, reader in (
        (ENV_HANG_DETECT_TIME, _HANG_MINUTES),
        (ENV_TERMINATION_GRACE, _TEARDOWN_SECONDS),
        (ENV_OP_RETRY_ENABLE, op_retry_enable),
        (ENV_OP_RETRY_PARAMS, op_retry_params),
    ):
        if name not in env:
            continue
        try:
            reader(env[name])
        except PydanticCustomError as error:
            allowed = str(error.context["allowed"] if error.context else error)
            problems.append(Problem(f"spec.env.{name}", env[name], allowed))
    return problems


def _operator_retry_needs_process_level(j: _Job) -> list[Problem]:
    """R-29 is carried out by the SDK's keeper (it re-forms the group and issues the collective
    again), which only process-level recovery runs; and it falls back to process-retry (R-30)."""
    env = j.parsed.spec.env
    try:
        on = op_retry_enable(env.get(ENV_OP_RETRY_ENABLE, "L1:0"))
    except PydanticCustomError:
        return []  # said by _environment_settings
    labels = j.parsed.metadata.labels
    strategies = j.parsed.metadata.annotations.recover_strategy
    process = labels.process_recover_enable
    if not on or (strategies and process in (None, ProcessRecoverEnable.ON)):
        return []
    return [
        Problem(
            f"spec.env.{ENV_OP_RETRY_ENABLE}",
            env[ENV_OP_RETRY_ENABLE],
            "operator-level online recovery (R-29) only with process-level recovery: a "
            f"{RECOVER_STRATEGY} annotation (and {PROCESS_RECOVER_ENABLE} not off); relaunch's "
            "SDK keeper issues the failed collective again, and falls back to process-retry",
        )
    ]


CROSS_RULES: Final[tuple[Callable[[_Job], list[Problem]], ...]] = (
    _r01_needs_job_retry_num,
    _scheduling_off_but_rescheduling_asked,
    _process_recovery_needs,
    _labels_need_rescheduling,
    _pod_path_needs_pod_level,
    _environment_settings,
    _operator_retry_needs_process_level,
)
"""Rules across keys, in the order their problems are listed."""


def cross_checks(parsed: File, data: Mapping[str, Any]) -> list[Problem]:
    job = _Job(
        parsed, lookup(data, ("metadata", "annotations")), lookup(data, ("metadata", "labels"))
    )
    return [problem for rule in CROSS_RULES for problem in rule(job)]
