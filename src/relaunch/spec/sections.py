"""The job file's sections, as pydantic models. Unknown keys are rejected in `spec`; annotations
and labels are Kubernetes maps that legitimately carry other keys, except under fault-tolerance/.
Pure."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from relaunch.protocol.rollback import StepRollback
from relaunch.spec import readers as r
from relaunch.spec.vocabulary import (
    FAULT_RETRY_TIMES,
    FAULT_SCHEDULING,
    FRAMEWORK,
    GRACE_OVER_TIME,
    HANG_GRACE_S,
    HANG_RETRY,
    JOB_RETRY_NUM,
    JOB_RETRY_NUM_MAX,
    JOB_UNCONDITIONAL_RETRY,
    MAX_RESTARTS_UNSET,
    POD_RESCHEDULING,
    POD_RETRY_NUM,
    POD_RETRY_NUM_MAX,
    PROCESS_RECOVER_ENABLE,
    RECOVER_POLICY_PATH,
    RECOVER_STRATEGY,
    WAIT_RESCHEDULE_TIMEOUT,
    FaultScheduling,
    Framework,
    ProcessRecoverEnable,
    RecoverStrategy,
)
from relaunch.validation import (
    MAX_PODS,
    boolean,
    choice,
    integer,
    raise_,
    reject,
    seconds,
    v,
)

__all__ = ["Annotations", "File", "Labels", "Metadata", "Workload"]


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
    recover_strategy: Annotated[tuple[RecoverStrategy, ...], v(r.strategies)] = Field(
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

    pod_rescheduling: Annotated[bool, v(r.on_off)] = Field(False, alias=POD_RESCHEDULING)
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

    name: Annotated[str, v(r.job_name)] = "job"
    namespace: Annotated[str | None, v(r.short_text)] = None
    description: Annotated[str, v(r.long_text)] = ""
    annotations: Annotations = Annotations()
    labels: Labels = Labels()


class Workload(BaseModel):
    """`spec`: what runs, how many of it, and the in-container supervisor's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: Annotated[tuple[str, ...], v(r.command)]
    replicas: Annotated[int, v(integer(1, MAX_PODS, "pods"))] = 1
    procs_per_pod: Annotated[int, v(integer(1, 1024, "processes per pod"))] = 1
    chips_per_pod: Annotated[int | None, v(integer(0, 1024, "chips per pod"))] = None
    env: Annotated[dict[str, str], v(r.env)] = Field(default_factory=dict)
    working_dir: Annotated[str | None, v(r.path)] = None
    max_restarts: Annotated[int, v(integer(0, MAX_RESTARTS_UNSET, "0 means 32767"))] = 0
    monitor_interval: Annotated[float, v(seconds(0, 3600))] = 5.0
    hang_detect_seconds: Annotated[float | None, v(seconds(0, 7 * 86400))] = None
    hang_grace_seconds: Annotated[float, v(seconds(-1e-9, 86400))] = HANG_GRACE_S
    startup_seconds: Annotated[float | None, v(seconds(0, 7 * 86400))] = None
    backoff_limit: Annotated[int | None, v(integer(0, 1000, "total reschedules"))] = None
    graceful_fault_tolerance: Annotated[bool, v(boolean)] = False
    warm_spares: Annotated[int, v(integer(0, 16, "spare processes per pod"))] = 0
    peer_memory_mb: Annotated[
        int, v(integer(0, 1 << 30, "MiB of the job's checkpoint copies a node keeps in memory"))
    ] = 0
    local_checkpoint_dir: Annotated[str | None, v(r.absolute_path)] = None
    integrity_check_every: Annotated[
        int, v(integer(0, 1_000_000, "steps between the replicas' fingerprint checks, 0: none"))
    ] = 10
    step_rollback: Annotated[
        StepRollback,
        v(
            choice(
                StepRollback,
                extra="replica: a step keeps its random streams and buffers, a rank whose memory "
                "a fault touched takes model and optimizer from a healthy replica; snapshot: "
                "each step also copies model and optimizer (state without a replica)",
            )
        ),
    ] = StepRollback.REPLICA


class File(BaseModel):
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
