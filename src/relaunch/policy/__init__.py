"""The recovery policy: a pure decision function over (settings, fault, history, cluster, now).

Modelled on Ray Train's failure policy: the policy decides, the controller acts.
"""

from relaunch.policy.cluster_view import ClusterView, PodView
from relaunch.policy.decision import (
    Action,
    Budget,
    BudgetsLeft,
    Counters,
    Decision,
    Level,
    PodChange,
    Streak,
    Streaks,
)
from relaunch.policy.history import JobHistory, RecoveryRecord
from relaunch.policy.ladder import decide, plan
from relaunch.policy.rungs import LEVELS, RUNGS

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
    "Streak",
    "Streaks",
    "decide",
    "plan",
]
