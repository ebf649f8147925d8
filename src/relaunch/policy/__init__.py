"""The recovery policy: a pure decision function over (settings, fault, history, cluster, now).

Modelled on Ray Train's failure policy: the policy decides, the controller acts.
"""

from relaunch.policy.cluster_view import ClusterView, PodView
from relaunch.policy.decision import (
    LEVELS,
    Action,
    Budget,
    BudgetsLeft,
    Counters,
    Decision,
    Level,
    PodChange,
    Streaks,
)
from relaunch.policy.history import JobHistory, RecoveryRecord
from relaunch.policy.ladder import RUNGS, decide, plan

__all__ = [
    "LEVELS",
    "RUNGS",
    "Action",
    "Budget",
    "BudgetsLeft",
    "ClusterView",
    "Counters",
    "Decision",
    "JobHistory",
    "Level",
    "PodChange",
    "PodView",
    "RecoveryRecord",
    "Streaks",
    "decide",
    "plan",
]
