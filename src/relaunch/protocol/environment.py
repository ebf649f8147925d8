"""The environment relaunch gives a job's processes, and the names of every variable it reads.

Defined once: the controller builds a pod's environment here, the launcher adds the per-process
part, and the training SDK reads the same names. Standard library only (the SDK imports it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["AttemptEnvironment", "Env", "PodEnvironment", "mindspore_environment"]


class Env:
    """Names of the variables relaunch sets or reads."""

    # torchrun's contract
    RANK: Final = "RANK"
    LOCAL_RANK: Final = "LOCAL_RANK"
    WORLD_SIZE: Final = "WORLD_SIZE"
    LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
    GROUP_RANK: Final = "GROUP_RANK"
    MASTER_ADDR: Final = "MASTER_ADDR"
    MASTER_PORT: Final = "MASTER_PORT"
    RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"
    ERROR_FILE: Final = "TORCHELASTIC_ERROR_FILE"
    """Per rank: where torch's `errors.record` writes the exception that ended the rank."""
    RUN_ID: Final = "TORCHELASTIC_RUN_ID"
    """Its presence is what `torch.distributed.is_torchelastic_launched()` checks (Lightning,
    Accelerate and others then trust the launcher's variables)."""
    GROUP_WORLD_SIZE: Final = "GROUP_WORLD_SIZE"
    ROLE_NAME: Final = "ROLE_NAME"
    ROLE_RANK: Final = "ROLE_RANK"
    ROLE_WORLD_SIZE: Final = "ROLE_WORLD_SIZE"
    MAX_RESTARTS: Final = "TORCHELASTIC_MAX_RESTARTS"
    USE_AGENT_STORE: Final = "TORCHELASTIC_USE_AGENT_STORE"
    """"False": rank 0 hosts the rendezvous store, as with torchrun's static rendezvous (there
    is no agent store to join)."""
    NCCL_ASYNC_ERROR_HANDLING: Final = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    NCCL_BLOCKING_WAIT: Final = "TORCH_NCCL_BLOCKING_WAIT"
    """A NCCL collective's wait blocks the host and raises when the collective failed, timed out
    or was aborted; without it the wait only orders the GPU's streams, and a value read after an
    aborted collective (the keeper's commit flag) is whatever the GPU held."""
    NCCL_HOSTID: Final = "NCCL_HOSTID"
    """What NCCL takes for the host's identity: a pod's node (each node of the embedded cluster
    is a host of its own, though they share one machine and its GPUs)."""
    SIGNALS_TO_HANDLE: Final = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    # MindSpore's contract (msrun's variables: the scheduler and the workers of dynamic networking)
    MS_ROLE: Final = "MS_ROLE"
    MS_NODE_ID: Final = "MS_NODE_ID"
    MS_WORKER_NUM: Final = "MS_WORKER_NUM"
    MS_SCHED_HOST: Final = "MS_SCHED_HOST"
    MS_SCHED_PORT: Final = "MS_SCHED_PORT"
    MS_TOPO_TIMEOUT: Final = "MS_TOPO_TIMEOUT"
    """Seconds the scheduler and workers wait for the cluster to form (msrun's
    --cluster_time_out)."""
    MS_RANK_ID: Final = "RANK_ID"
    MS_RANK_SIZE: Final = "RANK_SIZE"
    MS_DEVICE_ID: Final = "DEVICE_ID"
    # ModelArts' counters (R-04, R-05)
    SCHEDULE_CNT: Final = "MA_SCHEDULE_CNT"
    PROC_START_CNT: Final = "MA_PROC_START_CNT"
    # the job and the pod
    JOB: Final = "RELAUNCH_JOB"
    JOB_ID: Final = "RELAUNCH_JOB_ID"
    POD: Final = "RELAUNCH_POD"
    NODE: Final = "RELAUNCH_NODE"
    ATTEMPT: Final = "RELAUNCH_ATTEMPT"
    GENERATION: Final = "RELAUNCH_GENERATION"
    SHARED_DIR: Final = "RELAUNCH_SHARED_DIR"
    WORKDIR: Final = "RELAUNCH_WORKDIR"
    # process-level recovery (train.group)
    MEMBERSHIP: Final = "RELAUNCH_MEMBERSHIP"
    POD_GENERATION: Final = "RELAUNCH_POD_GENERATION"
    RECOVERY_WAIT: Final = "RELAUNCH_RECOVERY_WAIT"
    COLLECTIVE_TIMEOUT: Final = "RELAUNCH_COLLECTIVE_TIMEOUT"
    ELASTIC_EVERY: Final = "RELAUNCH_ELASTIC_EVERY"
    STEP_ROLLBACK: Final = "RELAUNCH_STEP_ROLLBACK"
    """`StepRollback`'s value (the spec's `step_rollback`)."""
    HIGH_AVAILABILITY: Final = "HIGH_AVAILABILITY"
    """R-07: the job's process-level strategies (seed 004 Table 3), "elastic-training" among them
    when the world may shrink."""
    # the launcher's side channels
    PROGRESS_SOCKET: Final = "RELAUNCH_PROGRESS_SOCKET"
    """Routine step reports: the launcher reads them every progress interval."""
    URGENT_SOCKET: Final = "RELAUNCH_URGENT_SOCKET"
    """A rank's first step and its phases: the launcher wakes for them."""
    PROGRESS_EVERY: Final = "RELAUNCH_PROGRESS_EVERY_S"
    """Steps are reported at most this often (seconds); the launcher forwards no more often."""
    INJECT_DIR: Final = "RELAUNCH_INJECT_DIR"
    SPARE_PRELOAD: Final = "RELAUNCH_SPARE_PRELOAD"
    SPARE_CUDA: Final = "RELAUNCH_SPARE_CUDA"
    """A warm spare starts CUDA while it waits where its pod's chips are GPUs; 1: also where the
    pods share the machine's GPUs (simulated chips); 0: never."""
    RANK_TEMPLATE: Final = "RELAUNCH_RANK_TEMPLATE"
    """0: every rank starts as a new Python process, none is forked from the pod's rank
    template (relaunch._template)."""
    GASP_WAIT_S: Final = "RELAUNCH_GASP_WAIT_S"
    INTEGRITY_EVERY: Final = "RELAUNCH_INTEGRITY_EVERY"
    """Steps between the replicas' fingerprint checks (spec.integrity_check_every; 0: none)."""
    STORE_WAIT: Final = "RELAUNCH_STORE_WAIT_S"
    """How long a rank other than 0 that relaunch starts waits for rank 0's store before its
    script runs (relaunch._rendezvous; 0: not at all)."""
    # peer memory (train.peer, cluster.keeper)
    PEER_MEMORY: Final = "RELAUNCH_PEER_MEMORY"
    """The nodes' peer memories a rank copies its checkpoints to and restores them from:
    ``node=host:port,...`` (unset: none)."""
    PEER_MEMORY_BYTES: Final = "RELAUNCH_PEER_MEMORY_BYTES"
    """How many bytes of the job's copies one node keeps at most (the spec's `peer_memory_mb`)."""
    LOCAL_CHECKPOINTS: Final = "RELAUNCH_LOCAL_CHECKPOINTS"
    """A directory on each node's own disk where a rank also keeps copies of its checkpoints
    (the spec's `local_checkpoint_dir`; train.local); unset: none."""
    # relaunch's own processes
    FAILPOINT: Final = "RELAUNCH_FAILPOINT"
    STATE_DIR: Final = "RELAUNCH_STATE_DIR"
    SERVER: Final = "RELAUNCH_SERVER"
    TOKEN: Final = "RELAUNCH_TOKEN"


@dataclass(frozen=True)
class AttemptEnvironment:
    """What every process of every pod of one attempt sees alike: built once an attempt, not
    once a pod (a restart of thousands of pods starts each with it)."""

    job_name: str
    job_id: int
    attempt: int
    world_size: int
    procs_per_pod: int
    master_addr: str
    master_port: int
    shared_dir: str
    process_recovery: Mapping[str, str]
    """R-07's variables for the job's strategies (spec.process_recovery_env)."""
    recovery_wait_s: float | None = None
    """With process-level recovery: how long a rank waits for its group's replacements."""
    step_rollback: str | None = None
    """With process-level recovery: what each step keeps to run again (`StepRollback`)."""
    run_id: str = "none"
    """TORCHELASTIC_RUN_ID (torchrun's --rdzv-id, whose default is "none")."""
    max_restarts: int = 0
    """TORCHELASTIC_MAX_RESTARTS: the job-level restarts the job may use."""

    def variables(self) -> dict[str, str]:
        env = {
            Env.RUN_ID: self.run_id,
            Env.GROUP_WORLD_SIZE: str(max(1, self.world_size // max(1, self.procs_per_pod))),
            Env.ROLE_NAME: "default",
            Env.ROLE_WORLD_SIZE: str(self.world_size),
            Env.MAX_RESTARTS: str(self.max_restarts),
            Env.USE_AGENT_STORE: "False",
            Env.WORLD_SIZE: str(self.world_size),
            Env.LOCAL_WORLD_SIZE: str(self.procs_per_pod),
            Env.MASTER_ADDR: self.master_addr,
            Env.MASTER_PORT: str(self.master_port),
            Env.RESTART_COUNT: str(self.attempt - 1),
            Env.JOB: self.job_name,
            Env.JOB_ID: str(self.job_id),
            Env.ATTEMPT: str(self.attempt),
            Env.SHARED_DIR: self.shared_dir,
        }
        env.update(self.process_recovery)
        if self.recovery_wait_s is not None:
            env[Env.RECOVERY_WAIT] = str(self.recovery_wait_s)
        if self.step_rollback is not None:
            env[Env.STEP_ROLLBACK] = self.step_rollback
        return env


@dataclass(frozen=True)
class PodEnvironment:
    """What every process of one pod sees (RANK and LOCAL_RANK are added per process): its
    attempt's variables, and its own."""

    pod: int
    node: str
    generation: int
    schedule_cnt: int
    proc_start_cnt: int
    membership_file: str | None = None
    """With process-level recovery: where the launcher writes the membership."""
    peer_memory: str = ""
    """The nodes' peer memories (``node=host:port,...``) where the job keeps checkpoint copies
    in memory; "" : it keeps none."""
    peer_memory_bytes: int = 0
    local_checkpoints: str = ""
    """Where on each node's own disk ranks keep checkpoint copies; "": they keep none."""
    integrity_every: int = 10
    """Steps between the replicas' fingerprint checks (0: none; R-45)."""

    def variables(self, attempt: Mapping[str, str]) -> dict[str, str]:
        """`attempt`: the attempt's variables (`AttemptEnvironment.variables`)."""
        env = {
            **attempt,
            Env.GROUP_RANK: str(self.pod),
            Env.SCHEDULE_CNT: str(self.schedule_cnt),
            Env.PROC_START_CNT: str(self.proc_start_cnt),
            Env.POD: str(self.pod),
            Env.NODE: self.node,
            Env.GENERATION: str(self.generation),
            Env.INTEGRITY_EVERY: str(self.integrity_every),
        }
        if self.peer_memory and self.peer_memory_bytes > 0:
            env[Env.PEER_MEMORY] = self.peer_memory
            env[Env.PEER_MEMORY_BYTES] = str(self.peer_memory_bytes)
        if self.local_checkpoints:
            env[Env.LOCAL_CHECKPOINTS] = self.local_checkpoints
        if self.membership_file is not None:
            env[Env.MEMBERSHIP] = self.membership_file
            env[Env.POD_GENERATION] = str(self.generation)
        return env


MS_SCHEDULER: Final = "MS_SCHED"
MS_WORKER: Final = "MS_WORKER"
MS_TOPO_TIMEOUT_S: Final = 600
"""msrun's --cluster_time_out default."""


def mindspore_environment(
    rank: int | None, local_rank: int, world_size: int, scheduler: tuple[str, int], timeout_s: int
) -> dict[str, str]:
    """The variables msrun gives a process of a MindSpore job: the scheduler's (`rank` None)
    or worker `rank`'s, `local_rank` on its node, the scheduler at `scheduler` (an address,
    msrun's --master_addr resolved, and a port). Where msrun leaves a worker's rank to the
    cluster (several nodes, no --node_rank), relaunch knows it and sets it, as msrun does with
    --node_rank."""
    env = {
        Env.MS_RANK_SIZE: str(world_size),
        Env.MS_WORKER_NUM: str(world_size),
        Env.MS_SCHED_HOST: scheduler[0],
        Env.MS_SCHED_PORT: str(scheduler[1]),
        Env.MS_TOPO_TIMEOUT: str(timeout_s),
    }
    if rank is None:
        return {**env, Env.MS_RANK_ID: "0", Env.MS_ROLE: MS_SCHEDULER}
    return {
        **env,
        Env.MS_DEVICE_ID: str(local_rank),
        Env.MS_RANK_ID: str(rank),
        Env.MS_NODE_ID: str(rank),
        Env.MS_ROLE: MS_WORKER,
    }
