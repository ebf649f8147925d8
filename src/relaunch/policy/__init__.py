"""The recovery policy: a pure decision function over (settings, fault, history, cluster, now).

Modelled on Ray Train's failure policy: the policy decides, the controller acts.
"""

from relaunch.policy.cluster_view import ClusterView, PodView
from relaunch.policy.decision import Action, Budget, BudgetsLeft, Counters, Decision, Streaks
from relaunch.policy.history import JobHistory, RecoveryRecord
from relaunch.policy.ladder import RUNGS, decide, plan

__all__ = [
    "RUNGS",
    "Action",
    "Budget",
    "BudgetsLeft",
    "ClusterView",
    "Counters",
    "Decision",
    "JobHistory",
    "PodView",
    "RecoveryRecord",
    "Streaks",
    "decide",
    "plan",
]
