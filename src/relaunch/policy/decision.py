"""What the policy returns: an action from a fixed vocabulary, and everything it costs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from relaunch.faults import Assessment

__all__ = [
    "Action",
    "Budget",
    "BudgetsLeft",
    "Counters",
    "Decision",
    "Level",
    "PodChange",
    "Streak",
    "Streaks",
]


class Action(StrEnum):
    """Recovery levels, in ladder order (policy.rungs.LEVELS). The values are stable: records,
    metrics and the API use them.

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
    HANG_RESTART = "hang-restart"
    IN_PLACE = "in-place"
    POD_RESCHEDULE = "pod-reschedule"
    ISOLATED_JOB_RESCHEDULE = "isolated-job-reschedule"
    JOB_RESCHEDULE = "job-reschedule"
    FAIL = "fail"

    @property
    def level(self) -> Level:
        """What this level is, changes and when it applies: its entry of `LEVELS`, declared
        once in ladder order beside the rungs it names (imported here when first asked: the
        rungs read `Action`)."""
        from relaunch.policy.rungs import LEVELS

        return LEVELS[self]

    @property
    def process_level(self) -> bool:
        return self.level.process_level

    @property
    def hands_over(self) -> bool:
        """After this action the next level runs at once, whether or not this one worked."""
        return self.level.hands_over

    @property
    def final(self) -> bool:
        """Nothing can follow: the fault needs nothing more, or the job is over."""
        return self.level.final

    @property
    def done_when_recorded(self) -> bool | None:
        """How its record reads the moment it is stored: an action done at once worked (ignore,
        and dump / exit, which hand over) or did not (fail); None for one that runs until
        progress proves it. The store's records and JobHistory.with_decision both follow it."""
        if self is Action.FAIL:
            return False
        return True if self.final or self.hands_over else None

    @property
    def rebuilds_all_pods(self) -> bool:
        return self.level.other_pods is PodChange.RESCHEDULED


class Streak(StrEnum):
    """A run of recoveries in a row that ends a job at the fourth (`Streaks`' fields)."""

    UNCONDITIONAL = "unconditional"
    """R-21: job reschedules of software faults."""
    HANG = "hang"
    """R-24: restarts upon suspension."""


class PodChange(StrEnum):
    """What a recovery does to one pod's container; its counters follow (R-04, R-05)."""

    KEPT = "kept"
    """The container stays and does not re-run the start command (its processes run on, or a
    rank is restarted inside it): the counters stay."""
    RESTARTED = "restarted"
    """The container re-runs the start command: MA_PROC_START_CNT counts one more."""
    RESCHEDULED = "rescheduled"
    """A new container (a new generation, on another node where its own must go):
    MA_SCHEDULE_CNT counts one more, MA_PROC_START_CNT starts over."""

    def counted(self, counters: Counters) -> Counters:
        if self is PodChange.RESCHEDULED:
            return counters.rescheduled()
        if self is PodChange.RESTARTED:
            return counters.restarted()
        return counters


@dataclass(frozen=True)
class Level:
    """What a recovery level is, declared once (policy/ladder.py's rung decides when it applies;
    controller/actions.py's class carries it out): what kind of level it is, and what it changes."""

    process_level: bool = False
    """Process-level recovery: the healthy processes live on (R-29 to R-36)."""
    hands_over: bool = False
    """dump and exit: the next level runs at once."""
    final: bool = False
    """ignore and fail: nothing follows."""
    new_attempt: bool = False
    """Every process of the job starts again (a new attempt of the job)."""
    decided_pods: PodChange = PodChange.KEPT
    """What happens to the pods the decision names."""
    other_pods: PodChange = PodChange.KEPT
    """... and to every other pod."""
    restarts_a_process: bool = False
    """It restarts a process inside its container: one of the container's max_restarts."""
    recovering: bool = False
    """The job reads Recovering while it runs (its pods are being rebuilt or joined)."""
    streak: Streak | None = None
    """The run of recoveries in a row it extends (R-21, R-24; history._streaks)."""
    rung: Callable[[Any], Any] | None = field(default=None, compare=False, repr=False)
    """When it applies: its rung of the ladder (policy.rungs; None for fail, which is what
    remains when no rung proposes itself)."""

    @property
    def reschedules(self) -> bool:
        """It puts the pods it names on other nodes or in new containers (R-43's records)."""
        return self.decided_pods is PodChange.RESCHEDULED

    def change_of(self, decided: bool) -> PodChange:
        return self.decided_pods if decided else self.other_pods


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
    targets: tuple[tuple[int, str], ...] = ()
    """(pod, node): where each pod the action rebuilds goes (LEVELS: the pods it reschedules);
    a pod without room is left out."""
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
    wants_nodes: bool = False
    """A `fail` only for want of healthy nodes (R-22 had no room): where nodes come back (a
    requeued Slurm job), the job stops to be resumed instead of failing (R-44)."""

    def summary(self) -> str:
        text = f"{self.action.value}: {self.reason}"
        if self.passed_over and self.action is not Action.FAIL:
            text += f" (passed over: {'; '.join(self.passed_over)})"
        if self.fallback is not None and not self.action.final:
            text += f"; if it fails: {self.fallback.value}"
        return text
