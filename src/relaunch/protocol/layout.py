"""Where things live in a state directory, written down once.

    STATE/
      relaunch.db              the store (jobs, pods, nodes, faults, records), 0600
      controller.json          the running controller's address, for agents and launchers
      pids.json                the embedded cluster's processes (pid and start time)
      run.lock                 held by the foreground `relaunch run` or the runner
      runner.pid, runner.log   the detached runner of queued jobs
      server-token             the API's bearer token, 0600
      logs/agent-NODE.log      each node agent's output
      jobs/ID/shared/          kept across every recovery: checkpoints, fence.json
      jobs/ID/pods/pod-I-gG/   pod I's container, generation G: launch.json, membership.json,
                               launcher.log, logs/rank-R.log, errors/rank-R.json,
                               inject/
      jobs/ID/standby/NODE/    the standby launcher's directory on NODE (warm spares)

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["FENCE_FILE", "JobDir", "PodDir", "StateDir"]

FENCE_FILE: Final = "fence.json"
"""In a job's shared directory: {"generations": {pod: oldest generation allowed to write}}."""


@dataclass(frozen=True)
class PodDir:
    """A pod container's directory (one per generation)."""

    path: Path

    @property
    def plan(self) -> Path:
        return self.path / "launch.json"

    @property
    def membership(self) -> Path:
        return self.path / "membership.json"

    @property
    def launcher_log(self) -> Path:
        return self.path / "launcher.log"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def error_file(self, rank: int) -> Path:
        """TORCHELASTIC_ERROR_FILE of the rank's current process."""
        return self.path / "errors" / f"rank-{rank}.json"

    @property
    def inject(self) -> Path:
        return self.path / "inject"


@dataclass(frozen=True)
class JobDir:
    path: Path

    @property
    def shared(self) -> Path:
        return self.path / "shared"

    @property
    def fence(self) -> Path:
        return self.shared / FENCE_FILE

    def pod(self, index: int, generation: int) -> PodDir:
        return PodDir(Path(self.pod_path(index, generation)))

    def pod_path(self, index: int, generation: int) -> str:
        """`pod(index, generation).path` as a string, without a Path made for it: a job-level
        recovery names thousands of them in one transaction."""
        return f"{self.path}/pods/pod-{index}-g{generation}"

    def standby(self, node: str) -> PodDir:
        return PodDir(self.path / "standby" / node)


@dataclass(frozen=True)
class StateDir:
    path: Path

    @property
    def db(self) -> Path:
        return self.path / "relaunch.db"

    @property
    def controller_address(self) -> Path:
        return self.path / "controller.json"

    @property
    def pids(self) -> Path:
        return self.path / "pids.json"

    @property
    def lock(self) -> Path:
        return self.path / "run.lock"

    @property
    def runner_log(self) -> Path:
        return self.path / "runner.log"

    @property
    def token(self) -> Path:
        return self.path / "server-token"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def agent_log(self, node: str) -> Path:
        return self.logs / f"agent-{node}.log"

    def job(self, job_id: int) -> JobDir:
        return JobDir(self.path / "jobs" / str(job_id))
