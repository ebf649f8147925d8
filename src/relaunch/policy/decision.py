"""What the policy returns: an action from a fixed vocabulary, and everything it costs."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from relaunch.faults import Assessment

__all__ = ["Action", "Budget", "BudgetsLeft", "Counters", "Decision", "Streaks"]


class Action(StrEnum):
    """Recovery levels, finest first. The values are stable: records, metrics and the API use them.

    ``dump`` and ``exit`` end process-level recovery and hand the fault over to the next level
    (:attr:`hands_over`); ``fail`` ends the job.
    """

    IGNORE = "ignore"
    OPERATOR_RETRY = "operator-retry"
    PROCESS_RETRY = "process-retry"
    PROCESS_IN_PLACE = "process-in-place"
    PROCESS_RESCHEDULE = "process-reschedule"
    SCALE_IN = "scale-in"
    DUMP = "dump"
    EXIT = "exit"
    IN_PLACE = "in-place"
    HANG_RESTART = "hang-restart"
    POD_RESCHEDULE = "pod-reschedule"
    ISOLATED_JOB_RESCHEDULE = "isolated-job-reschedule"
    JOB_RESCHEDULE = "job-reschedule"
    FAIL = "fail"

    @property
    def process_level(self) -> bool:
        return self in _PROCESS_LEVEL

    @property
    def hands_over(self) -> bool:
        """After this action the next level runs at once, whether or not this one worked."""
        return self in (Action.DUMP, Action.EXIT)

    @property
    def final(self) -> bool:
        """Nothing can follow: the fault needs nothing more, or the job is over."""
        return self in (Action.IGNORE, Action.FAIL)

    @property
    def rebuilds_all_pods(self) -> bool:
        return self in (Action.ISOLATED_JOB_RESCHEDULE, Action.JOB_RESCHEDULE)


_PROCESS_LEVEL = frozenset(
    {
        Action.OPERATOR_RETRY,
        Action.PROCESS_RETRY,
        Action.PROCESS_IN_PLACE,
        Action.PROCESS_RESCHEDULE,
        Action.SCALE_IN,
        Action.DUMP,
        Action.EXIT,
    }
)


class Budget(StrEnum):
    """The limited resources a recovery can spend, named by the setting that sets each."""

    JOB = "job-retry-num"
    """Job-level reschedules (isolated or unconditional); also bounded by backoff_limit."""
    POD = "pod-retry-num"
    FAULT_RETRY = "fault-retry-times"
    """MindCluster software-fault reschedules; spent only when the reschedule succeeds (R-41)."""
    PROCESS_RESTARTS = "max_restarts"
    """Process restarts inside one container."""


@dataclass(frozen=True)
class Counters:
    """The per-pod counters given to the user's processes (R-04, R-05)."""

    schedule_cnt: int = 1
    """MA_SCHEDULE_CNT: times this pod has been scheduled."""
    proc_start_cnt: int = 1
    """MA_PROC_START_CNT: times the start command ran in this container."""

    def rescheduled(self) -> Counters:
        return Counters(self.schedule_cnt + 1, 1)

    def restarted(self) -> Counters:
        return Counters(self.schedule_cnt, self.proc_start_cnt + 1)


@dataclass(frozen=True)
class Streaks:
    """Consecutive recoveries of one kind, which end a job at the fourth (R-21, R-24)."""

    unconditional: int = 0
    hang: int = 0


@dataclass(frozen=True)
class BudgetsLeft:
    job: int
    pod: int
    fault_retry: int


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one fault. The controller carries it out; the policy never acts."""

    action: Action
    reason: str
    assessment: Assessment
    isolate_nodes: tuple[str, ...] = ()
    pods: tuple[int, ...] = ()
    """The pods whose processes or containers the action touches."""
    consumes: frozenset[Budget] = frozenset()
    counters: tuple[Counters, ...] = ()
    """Every pod's counters once the action is done, indexed by pod."""
    budgets_left: BudgetsLeft | None = None
    """Budgets after the action, assuming it succeeds."""
    streaks: Streaks = Streaks()
    """Streaks after the action."""
    wait_s: float | None = None
    """How long the action may wait for a replacement (R-32), if it waits."""
    fallback: Action | None = None
    """What the policy would choose if this action fails (or, for dump / exit, what follows)."""
    passed_over: tuple[str, ...] = ()
    """Why the finer levels that would have applied did not run (a spent budget, R-37, R-31)."""

    def summary(self) -> str:
        text = f"{self.action.value}: {self.reason}"
        if self.passed_over and self.action is not Action.FAIL:
            text += f" (passed over: {'; '.join(self.passed_over)})"
        if self.fallback is not None and not self.action.final:
            text += f"; if it fails: {self.fallback.value}"
        return text
