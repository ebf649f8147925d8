"""From a job mapping to a JobSpec: validate every key, then derive the recovery settings. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

from relaunch.errors import Problem, SpecError
from relaunch.protocol.operator import from_environment
from relaunch.spec.checks import cross_checks, string_map_problems, unknown_fault_tolerance_keys
from relaunch.spec.manifests import job_document
from relaunch.spec.sections import Annotations, File, Labels, Workload
from relaunch.spec.settings import JobSpec, RecoverySettings
from relaunch.spec.vocabulary import (
    ENV_HANG_DETECT_TIME,
    ENV_TERMINATION_GRACE,
    MAX_RESTARTS_UNSET,
    MIN_STARTUP_S,
    MINDCLUSTER_GRACE_S,
    MODELARTS_GRACE_S,
    PROCESS_RECOVER_ENABLE,
    FaultScheduling,
    ProcessRecoverEnable,
)
from relaunch.validation import lookup, problems_from

__all__ = ["parse_job"]

_FIELD_HINTS: Final = {
    ("spec",): "a mapping with at least `command` (what each process runs)",
    ("spec", "command"): "a non-empty shell command string or a non-empty list of strings",
}


def parse_job(data: Any, *, source: str = "<job>") -> JobSpec:
    """Validate a job mapping (from YAML, JSON or the API) and derive its recovery settings.

    Raises :class:`SpecError` with one :class:`Problem` per invalid key. A Volcano Job, an
    Ascend operator job or a PyTorchJob is read as its relaunch job (spec.manifests).
    """
    data = job_document(data, source)
    if not isinstance(data, Mapping):
        raise SpecError(
            source,
            [Problem("(top level)", data, "a mapping with keys kind, metadata and spec")],
        )
    problems = unknown_fault_tolerance_keys(data) + string_map_problems(data)
    try:
        parsed = File.model_validate(dict(data))
    except ValidationError as error:
        seen = {p.key for p in problems}
        problems.extend(
            p for p in problems_from(error, data, File, _FIELD_HINTS) if p.key not in seen
        )
        raise SpecError(source, problems) from None
    if problems:
        raise SpecError(source, problems)
    problems = cross_checks(parsed, data)
    if problems:
        raise SpecError(source, problems)
    return _build(parsed, data)


def _build(parsed: File, data: Mapping[str, Any]) -> JobSpec:
    work = parsed.spec
    labels = _string_map(lookup(data, ("metadata", "labels")))
    annotations = _string_map(lookup(data, ("metadata", "annotations")))
    if (
        parsed.metadata.labels.process_recover_enable is None
        and parsed.metadata.annotations.recover_strategy
    ):
        labels[PROCESS_RECOVER_ENABLE] = ProcessRecoverEnable.ON.value  # R-07, as the operator
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
        recovery=recovery_settings(parsed.metadata.annotations, parsed.metadata.labels, work),
        warm_spares=work.warm_spares,
        peer_memory_mb=work.peer_memory_mb,
        local_checkpoint_dir=work.local_checkpoint_dir,
        integrity_check_every=work.integrity_check_every,
    )


def recovery_settings(ann: Annotations, lab: Labels, work: Workload) -> RecoverySettings:
    """Every default and derivation applied: what the policy reads."""
    modelarts_on = ann.job_retry_num is not None
    mindcluster_on = lab.fault_scheduling in (FaultScheduling.GRACE, FaultScheduling.FORCE)
    auto_restart = modelarts_on or mindcluster_on
    budgets = [b for b in (ann.job_retry_num, work.backoff_limit) if b is not None]
    # Without job-retry-num or backoff_limit, MindCluster's maxRetry default of 3 applies.
    job_budget = min(budgets) if budgets else (3 if mindcluster_on else 0)
    pod_on = auto_restart and (ann.pod_retry_num is not None or lab.pod_rescheduling)
    pod_budget = ann.pod_retry_num if ann.pod_retry_num is not None else job_budget
    process = lab.process_recover_enable
    if process is None:
        process = ProcessRecoverEnable.ON if ann.recover_strategy else ProcessRecoverEnable.OFF
    hang_s = work.hang_detect_seconds
    if hang_s is None:
        hang_s = 60.0 * int(work.env.get(ENV_HANG_DETECT_TIME, "30"))
    teardown = int(work.env.get(ENV_TERMINATION_GRACE, "-1"))
    startup = work.startup_seconds
    return RecoverySettings(
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
        startup_s=startup if startup is not None else max(2 * hang_s, MIN_STARTUP_S),
        max_restarts=work.max_restarts or MAX_RESTARTS_UNSET,
        monitor_interval_s=work.monitor_interval,
        framework=lab.framework,
        operator_retry=from_environment(work.env),
        step_rollback=work.step_rollback,
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
