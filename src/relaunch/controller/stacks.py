"""A hang's stacks: before a hang is decided (and its processes stopped), every rank's Python
stack is captured by its launcher, the rank the others wait for is named (diagnosis.hang), and
the stacks are stored with the fault.

    hang detected ──CaptureStacks to each launcher──> capturing
    capturing ──every launcher answered, or stack_capture_s passed──> the hang fault, naming the
        culprit, with the stacks (HangFound: the caller stores and decides it); dropped if
        another fault came meanwhile; no hang if every rank was read in its rendezvous while
        one of them had ended its startup allowance (a line printed while it waited for peers
        still starting): they are back in that allowance (R-25)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from relaunch.controller.detectors import Capture, Detected
from relaunch.diagnosis import culprits, group_stacks
from relaunch.events import EventKind
from relaunch.faults import Fault
from relaunch.protocol.messages import CaptureStacks, Stacks

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext
    from relaunch.controller.peers import LauncherLink

__all__ = ["HangFound", "begin", "finish", "received"]


def begin(c: ControllerContext, found: Detected, now: float) -> bool:
    """Ask every launcher with running ranks for their stacks; False if there is nothing to ask
    (capture off, or no launcher), and the hang is decided at once."""
    timeout = c.cluster.stack_capture_s
    links = [
        p.link
        for p in c.pods.values()
        if p.link is not None
        and not p.link.peer.closed
        and any(r.running and r.attempt == c.job.attempt for r in p.link.ranks.values())
    ]
    if timeout <= 0 or not links:
        return False
    captures = c.capture
    captures.requests += 1
    ask = CaptureStacks(captures.requests, timeout)  # one message for all, encoded once
    for link in links:
        link.peer.send(ask)
    captures.current = Capture(
        captures.requests,
        found,
        c.job.attempt,
        now,
        now + timeout + 1.0,  # each rank's py-spy has `timeout`; its answer a moment more
        {link.pod for link in links},
    )
    c.event(EventKind.HANG_CAPTURING, pods=len(links))
    return True


def received(c: ControllerContext, link: LauncherLink, message: Stacks) -> None:
    capture = c.capture.current
    if capture is None or message.request != capture.request:
        return
    # a group names at least one rank, each with its pid (a launcher's malformed answer is
    # dropped, not the controller)
    capture.stacks.extend(g for g in message.stacks if g.ranks and len(g.ranks) == len(g.pids))
    capture.waiting.discard(link.pod)
    if not capture.waiting:
        c.hurry()


@dataclass(frozen=True)
class HangFound:
    """A hang with its stacks, for the recovery to store and decide."""

    fault: Fault
    source: str
    evidence: dict[str, Any]
    detected_at: float
    """When the silence was found (its stacks were read since: diagnosis, not detection)."""


def finish(c: ControllerContext, now: float) -> HangFound | None:
    """Once every launcher answered (or the capture's deadline passed): the hang fault, naming
    the culprit and carrying every stack (alike ones once, with their ranks); None while it
    waits, or when another fault came."""
    capture = c.capture.current
    if capture is None or (capture.waiting and now < capture.deadline):
        return None
    c.capture.current = None
    if c.job.attempt != capture.attempt or c.recoveries.waiting or c.job.status.ended:
        c.event(EventKind.HANG_DROPPED)
        return None
    groups = group_stacks(capture.stacks)
    finding = culprits(groups)
    if finding.forming and _back_to_startup(c, [r for g in groups for r in g.ranks]):
        c.event(EventKind.HANG_FORMING, reason=finding.reason)
        return None
    fault = capture.found.fault
    if finding.culprits:
        rank = finding.culprits[0]
        fault = replace(fault, rank=rank, pod=rank // c.spec.procs_per_pod)
    fault = replace(
        fault, detail=f"{fault.detail}; {finding.reason}" if fault.detail else finding.reason
    )
    evidence: dict[str, Any] = {
        "finding": finding.reason,
        "culprits": list(finding.culprits),
        "capture_s": round(now - capture.began, 3),
        "missing_pods": sorted(capture.waiting),
        "stacks": [
            {
                "ranks": list(g.ranks),
                "pids": list(g.pids),
                "state": g.state,
                "stack": g.text,
                "error": g.error,
            }
            for g in groups
        ],
    }
    ranks = sum(len(g.ranks) for g in groups)
    c.event(
        EventKind.HANG_FOUND,
        reason=finding.reason,
        culprits=list(finding.culprits),
        ranks=ranks,
        unlike=len(groups),
        took_s=now - capture.began,
    )
    return HangFound(fault, capture.found.source, evidence, capture.began)


def _back_to_startup(c: ControllerContext, ranks: list[int]) -> bool:
    """The ranks, read in their rendezvous, are in their startup allowance again, if one of them
    had ended it (a line printed as it waited, a c10d warning: the hang window applied); False
    if none had (the allowance itself ran out: a rendezvous that never completes is a hang)."""
    observed = [
        rank
        for pod in c.pods.values()
        if pod.link is not None
        for index, rank in pod.link.ranks.items()
        if index in ranks and rank.attempt == c.job.attempt
    ]
    if not any(rank.progressed for rank in observed):
        return False
    for rank in observed:
        rank.progressed = False
    c.hang_watch.stale()
    return True
