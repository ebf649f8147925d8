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

from relaunch.spec.environment import process_recovery_env
from relaunch.spec.parse import parse_job
from relaunch.spec.settings import JobSpec, RecoverySettings
from relaunch.spec.vocabulary import (
    JOB_RETRY_NUM_MAX,
    FaultScheduling,
    Framework,
    ProcessRecoverEnable,
    RecoverStrategy,
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
