"""What every rung of the ladder reads (`Context`: one fault in context) and how it answers
(`Proposal`, `Blocked`, or None: it does not apply). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from relaunch.faults import Assessment, Cause, EscalationRules, Fault
from relaunch.policy.cluster_view import ClusterView
from relaunch.policy.decision import Action, Budget
from relaunch.policy.history import JobHistory
from relaunch.spec import RecoverStrategy, RecoverySettings

__all__ = ["Answer", "Blocked", "Context", "Proposal"]


@dataclass(frozen=True)
class Proposal:
    reason: str
    pods: tuple[int, ...] = ()
    isolate: tuple[str, ...] = ()
    consumes: frozenset[Budget] = frozenset()
    wait_s: float | None = None


@dataclass(frozen=True)
class Blocked:
    reason: str
    wants_nodes: bool = False
    """Blocked only for want of healthy nodes: more nodes would let it run."""


Answer = Proposal | Blocked | None


@dataclass(frozen=True)
class Context:
    """One fault in context: what every rung reads."""

    settings: RecoverySettings
    a: Assessment
    history: JobHistory
    cluster: ClusterView
    now: float
    rules: EscalationRules
    tried: frozenset[Action]
    pods: tuple[int, ...] = field(default=())

    @property
    def fault(self) -> Fault:
        return self.a.fault

    @property
    def node(self) -> str | None:
        return self.fault.node

    @property
    def node_must_go(self) -> bool:
        """The fault's node cannot keep running the job: a hardware fault that does not heal in
        place, an escalated one (R-10), or one whose healing failed (R-20). Never for a fault the
        user's input caused (R-11)."""
        return (
            self.a.cause is Cause.ENVIRONMENT
            and self.node is not None
            and not self.a.user_induced
            and (not self.a.self_healable or self.a.escalated or Action.IN_PLACE in self.tried)
        )

    @property
    def user_degraded(self) -> bool:
        """R-20's third bullet: a user-induced fault that escalated or did not heal -> reschedule
        the job without isolating anything."""
        return (
            self.a.cause is Cause.ENVIRONMENT
            and self.a.user_induced
            and (not self.a.self_healable or self.a.escalated or Action.IN_PLACE in self.tried)
        )

    @property
    def touches_rank0(self) -> bool:
        rank0 = self.cluster.rank0_pod
        return rank0 is not None and rank0 in self.pods

    def left(self, budget: Budget) -> int:
        total = {
            Budget.JOB: self.settings.job_retry_budget,
            Budget.POD: self.settings.pod_retry_budget,
            Budget.FAULT_RETRY: self.settings.fault_retry_times,
        }[budget]
        return total - self.history.used(budget)

    def job_budget_blocker(self) -> Blocked | None:
        if self.left(Budget.JOB) > 0:
            return None
        used = self.history.used(Budget.JOB)
        return Blocked(
            f"restart budget spent: {used} of {self.settings.job_retry_budget} job-level "
            "reschedules used (R-26)"
        )

    def allows(self, strategy: RecoverStrategy) -> bool:
        return strategy in self.settings.recover_strategies
