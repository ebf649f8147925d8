"""The job's record of what happened, as data: each event is a kind and its fields, stored as
such (`Store.event`); the sentence a person reads is rendered from them, never read back.

Each kind is declared once, here, with its template: the fields it carries are the names its
template uses (`Event.of` refuses an event without them), and what reads the record (the
restores, the metrics, `relaunch describe`, the tests) reads the kind and the fields. Pure: no
I/O, no clock.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import msgspec

from relaunch.faults import Fault

__all__ = ["Event", "EventKind", "Recorded", "fault_fields"]


class EventKind(StrEnum):
    """What an event says. Each member's template names the fields its events carry."""

    template: str

    def __new__(cls, value: str, template: str) -> EventKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.template = template
        return member

    # -- faults and decisions ----------------------------------------------------------------------
    FAULT = "fault", "fault: {fault_text}"
    FAULT_ABSORBED = "fault-absorbed", "{action}: {fault_text}"
    COLLATERAL = "collateral", "collateral of {first_text}: {fault_text}"
    ROOT_CAUSE = "root-cause", "root cause: {fault_text}{error_text}"
    FAULT_AFTER_END = "fault-after-end", "{fault_text}: not decided, the job had ended"
    NODE_LOST = "node-lost", "node {node} lost: {why} (last heartbeat {silent_s:.1f} s ago)"
    DECISION = "decision", "decision: {summary}"
    RECOVERY_FELL_BACK = "recovery-fell-back", "{action} did not recover {fault_text}"
    RECOVERY_FAILED = "recovery-failed", "{action}: {why}"
    RECOVERED = "recovered", "{action} worked: progress resumed {after_s:.2f} s after the fault"
    HANG_CAPTURING = (
        "hang-capturing",
        "hang detected: capturing the stacks of {pods} pod(s) before deciding",
    )
    HANG_DROPPED = (
        "hang-dropped",
        "hang: dropped, another fault came while its stacks were captured",
    )
    HANG_FORMING = (
        "hang-forming",
        "hang: none, {reason}: their startup allowance applies",
    )
    HANG_FOUND = (
        "hang-found",
        "hang: {reason} (stacks of {ranks} rank(s), {unlike} unlike, in {took_s:.2f} s)",
    )
    CORRUPTION_FOUND = (
        "corruption-found",
        "silent corruption: the replicas' parameters differ at step {step} (last agreed at step "
        "{clean_step}), culprits {culprits}: rolled back to a checkpoint of step {clean_step} or "
        "before (R-45)",
    )
    COLLECTIVE_UNLINKED = (
        "collective-unlinked",
        "pod {pod} rank {rank}: a collective of step {step} failed ({why}); no data link is "
        "down: its cause is decided where it is seen",
    )
    # -- the recovery's actions --------------------------------------------------------------------
    STOPPING = (
        "stopping",
        "stopping the processes of {pods} pod(s) ({containers}): SIGTERM, SIGKILL after "
        "{grace_s:g} s{why_text}",
    )
    RETRY_HELD = (
        "operator-retry-held",
        "operator retry {attempt} of {max_count} not issued: the data link of {nodes} is still "
        "down",
    )
    GROUP_FORMED = (
        "group-formed",
        "process group generation {generation}: {what}, world size {world_size}",
    )
    SCALED_OUT = "scaled-out", "scale-out: pod {pod} back on {node}"
    SCALE_OUT_TRAINING = "scale-out-training", "scale-out: the joining ranks are training"
    RESTORED = "restored", "pod {pod} rank {rank} restored step {step} from {source}"
    # -- pods, launchers and nodes -----------------------------------------------------------------
    LAUNCHER_FAILED = (
        "launcher-failed",
        "could not start the launcher of pod {pod} on {node}: {error}",
    )
    FENCE_WAIT = (
        "fence-wait",
        "{node} is silent, not known dead: new launchers start in {wait_s:.1f} s, once its "
        "pods' lease ({lease_s:g} s) and grace are over (R-14)",
    )
    STANDBY_STARTED = "standby-started", "standby launcher on {node}: {spares} warm spare(s)"
    STANDBY_TAKEN = (
        "standby-taken",
        "pod {pod} takes the standby launcher on {node} and its warm spares",
    )
    STANDBYS_TAKEN = (
        "standbys-taken",
        "{count} pods take the standby launchers on their nodes and their warm spares "
        "(pod {first} on {node} to pod {last})",
    )
    ISOLATED_BY_RELAUNCH_ONLY = (
        "isolated-by-relaunch-only",
        "node {node} is taken out by relaunch only; the engine could not: {why}",
    )
    LEFT_BEHIND = (
        "left-behind",
        "the pods left {count} process(es) behind in their cgroups, killed{named}",
    )
    # -- the job -----------------------------------------------------------------------------------
    CONTROLLER_RESUMED = (
        "controller-resumed",
        "controller resumed job {job} (attempt {attempt}) after {away_s:.1f} s away; "
        "re-adopting pods",
    )
    RESTARTED_FROM_CHECKPOINTS = "restarted-from-checkpoints", "{why}"
    SETTING_UNUSABLE = "setting-unusable", "{why}"
    STOPPING_JOB = "stopping-job", "stopping the job: {why}"
    SUCCEEDED = "succeeded", "job {job} succeeded"
    # -- the fault plan ----------------------------------------------------------------------------
    PLAN_RELOADED = "plan-reloaded", "fault plan now has {entries} entr(ies)"
    PLAN_FIRED = "plan-fired", "fault plan: {entry_text}"
    PLAN_WAITING = (
        "plan-waiting",
        "fault plan: {entries} entr(ies) wait for a step (at_step), and the job has reported "
        "none in {elapsed_s:.0f} s: at_step needs the script to call "
        "relaunch.train.report_progress(step); use after_s otherwise",
    )
    PLAN_SIMULATED = "plan-simulated", "fault plan: the link fault is simulated: {why}"
    PLAN_NOT_FIRED = "plan-not-fired", "fault plan: {what}: not fired: {why}"

    @property
    def fields(self) -> frozenset[str]:
        """The names of the fields this kind's events carry (its template's)."""
        return frozenset(
            name.split(".")[0].split("[")[0]
            for _, name, _, _ in string.Formatter().parse(self.template)
            if name
        )


class Event(msgspec.Struct, frozen=True):
    """One thing that happened to a job: its kind and its fields (JSON values)."""

    kind: EventKind
    fields: dict[str, Any] = {}

    @classmethod
    def of(cls, kind: EventKind, **fields: Any) -> Event:
        """An event of `kind`; every field its template names must be given."""
        missing = kind.fields - fields.keys()
        if missing:
            raise ValueError(f"a {kind.value} event needs {', '.join(sorted(missing))}")
        return cls(kind, fields)

    @property
    def text(self) -> str:
        """The sentence a person reads."""
        return self.kind.template.format_map(self.fields)

    @property
    def subject(self) -> str:
        """What it is about: a pod, a node, or the job."""
        for key in ("pod", "fault_pod"):
            if self.fields.get(key) is not None:
                return f"pod {self.fields[key]}"
        for key in ("node", "fault_node"):
            if self.fields.get(key):
                return f"node {self.fields[key]}"
        return "job"


class Recorded(msgspec.Struct, frozen=True):
    """An event as the store holds it: when, its kind (None for an event an older relaunch wrote
    as a sentence only), its fields and its sentence."""

    at: float
    kind: EventKind | None
    fields: Mapping[str, Any]
    text: str


def fault_fields(fault: Fault, prefix: str = "fault") -> dict[str, Any]:
    """A fault as an event's fields: its kind, where it struck, and its description."""
    where = {"node": fault.node, "pod": fault.pod, "rank": fault.rank, "chip": fault.chip}
    return {
        prefix: fault.kind.value,
        **{f"{prefix}_{key}": value for key, value in where.items() if value is not None},
        f"{prefix}_text": fault.describe(),
    }
