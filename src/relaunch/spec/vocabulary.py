"""The words of a job file: the ModelArts annotations and MindCluster labels relaunch reads, their
limits and defaults, and the values some of them take. Pure."""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from relaunch.protocol.operator import OP_RETRY_ENABLE, OP_RETRY_PARAMS

__all__ = [
    "ENV_HANG_DETECT_TIME",
    "ENV_TERMINATION_GRACE",
    "FAULT_RETRY_TIMES",
    "FAULT_SCHEDULING",
    "FAULT_TOLERANCE_KEYS",
    "FRAMEWORK",
    "FT_PREFIX",
    "GRACE_OVER_TIME",
    "HANG_GRACE_S",
    "HANG_RETRY",
    "JOB_RETRY_NUM",
    "JOB_RETRY_NUM_MAX",
    "JOB_UNCONDITIONAL_RETRY",
    "MAX_RESTARTS_UNSET",
    "MINDCLUSTER_GRACE_S",
    "MIN_STARTUP_S",
    "MODELARTS_GRACE_S",
    "POD_RESCHEDULING",
    "POD_RETRY_NUM",
    "POD_RETRY_NUM_MAX",
    "PROCESS_RECOVER_ENABLE",
    "RECOVER_POLICY_PATH",
    "RECOVER_STRATEGY",
    "WAIT_RESCHEDULE_TIMEOUT",
    "FaultScheduling",
    "Framework",
    "ProcessRecoverEnable",
    "RecoverStrategy",
]

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
ENV_OP_RETRY_ENABLE: Final = OP_RETRY_ENABLE
"""MindCluster's switch of operator-level online recovery (R-29): relaunch.protocol.operator."""
ENV_OP_RETRY_PARAMS: Final = OP_RETRY_PARAMS

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
