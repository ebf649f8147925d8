"""What a validated job file means: the job, and the recovery behaviour it asks for. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from relaunch.protocol.operator import OperatorRetry
from relaunch.protocol.rollback import StepRollback
from relaunch.spec.vocabulary import (
    FaultScheduling,
    Framework,
    ProcessRecoverEnable,
    RecoverStrategy,
)

__all__ = ["JobSpec", "RecoverySettings"]


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
    operator_retry: OperatorRetry | None = None
    """R-29, operator-level online recovery: on (HCCL_OP_RETRY_ENABLE with L1:1 in the job's
    environment), with its HCCL_OP_RETRY_PARAMS; None: off."""
    step_rollback: StepRollback = StepRollback.REPLICA
    """What process-level recovery keeps of each step to run it again (spec.step_rollback)."""

    @property
    def unconditional(self) -> bool:
        """Software faults are rescheduled, by either product's switch."""
        return self.unconditional_retry or self.fault_retry_times > 0

    @property
    def process_level_asked(self) -> bool:
        """The job asks for process-level recovery: R-07's variables are set for it."""
        return self.process_recovery is ProcessRecoverEnable.ON and bool(self.recover_strategies)

    @property
    def process_level(self) -> bool:
        """relaunch carries process-level recovery out: asked, for a PyTorch job. Its keeper
        re-forms torch.distributed's groups; a MindSpore job's communicator is MindIO's to
        rebuild (Ascend), so its faults go to the next level down (R-46)."""
        return self.process_level_asked and self.framework is Framework.PYTORCH


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
    peer_memory_mb: int = 0
    """Each rank's checkpoint is also copied into another node's memory, and a node keeps at
    most this many MiB of the job's copies (0: no copies; relaunch.cluster.keeper)."""
    local_checkpoint_dir: str | None = None
    """Each rank's checkpoint is also copied to this directory on its node's own disk, and a
    rank that restarts on that node reads it from there (relaunch.train.local)."""
    integrity_check_every: int = 10
    """Every that many steps the replicas compare their parameters' fingerprints, where the
    script checks them (relaunch.train.integrity; 0: never): a chip that computes wrong is
    found within that many steps (R-45)."""

    @property
    def world_size(self) -> int:
        return self.replicas * self.procs_per_pod
