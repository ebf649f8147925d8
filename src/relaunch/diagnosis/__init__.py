"""Diagnosis: what a person on call needs to act on a fault. Which failure caused the others (the
root cause and its collateral), which rank a hung job waits for, and where the job's time went.
Pure: what the launchers and the store observed goes in, findings come out."""

from relaunch.diagnosis.errors import error_from_file, error_from_output
from relaunch.diagnosis.goodput import CAUSES, Goodput, Recovery, goodput
from relaunch.diagnosis.hang import (
    Frame,
    HangFinding,
    RankStack,
    StackGroup,
    culprits,
    group_stacks,
    in_rendezvous,
    ranks_text,
    waits_in_collective,
)
from relaunch.diagnosis.rootcause import (
    Group,
    caused_by_peer,
    failure_time,
    is_collateral,
    root_cause,
)
from relaunch.diagnosis.subhealth import (
    MIN_LOOKS,
    SlowLink,
    SlowPod,
    look_interval_s,
    slow_links,
    slow_pods,
)

__all__ = [
    "CAUSES",
    "MIN_LOOKS",
    "Frame",
    "Goodput",
    "Group",
    "HangFinding",
    "RankStack",
    "Recovery",
    "SlowLink",
    "SlowPod",
    "StackGroup",
    "caused_by_peer",
    "culprits",
    "error_from_file",
    "error_from_output",
    "failure_time",
    "goodput",
    "group_stacks",
    "in_rendezvous",
    "is_collateral",
    "look_interval_s",
    "ranks_text",
    "root_cause",
    "slow_links",
    "slow_pods",
    "waits_in_collective",
]
