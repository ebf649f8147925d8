"""Every message between the controller, the node agents and the pod launchers.

One frozen dataclass per message; `encode` and `decode` are the only places they meet JSON (a
line on the wire is `{"t": KIND, ...fields}`, its kind first). Who sends what:

    agent -> controller      AgentHello, Heartbeat, Healed, Injected
    controller -> agent      InjectChipFault, InjectNetworkFault, InjectCopyCorruption, Heal,
                             ForgetCopies, Shutdown, and to an agent that hosts its node's
                             pods: StartPod, Crash
    launcher -> controller   LauncherHello, Started, Output, ProgressBatch, Exited, Stopped,
                             Usage, Injected, Stacks, CollectiveFailed, Restored,
                             CorruptionFound
    controller -> launcher   Start, Stop, Shutdown, InjectProcessFault, MembershipUpdate, Assume,
                             CaptureStacks, Lease

The training SDK's datagrams to its launcher are in `datagrams.py`.

msgspec encodes and decodes the lines, straight between JSON and the dataclasses at C speed: a
job-level restart of thousands of pods is tens of thousands of messages through the controller's
one thread, and building each by its type hints in Python (`codec`) was a third of its time. A
line msgspec refuses goes the careful way (`codec`, which converts what it can); both read
every line either writes alike (tests/test_event_driven.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import ClassVar, Final

import msgspec

from relaunch.diagnosis.hang import StackGroup
from relaunch.faults.kinds import ErrorReport
from relaunch.protocol.codec import from_data
from relaunch.protocol.plans import LaunchPlan, Membership

__all__ = [
    "AgentHello", "Assume", "CaptureStacks", "ChipReport", "CollectiveFailed", "CorruptionFound",
    "Crash", "Exited",
    "ForgetCopies", "Heal", "Healed", "Heartbeat", "InjectChipFault", "InjectCopyCorruption",
    "InjectNetworkFault", "InjectProcessFault", "Injected", "LauncherHello", "Lease", "LinkReport",
    "MembershipUpdate", "Message", "Output", "ProcReport", "Progress", "ProgressBatch",
    "RankPhase", "Restored", "Shutdown", "Stacks", "Start", "StartPod", "Started", "Stop",
    "Stopped", "Usage", "decode", "encode", "encode_line",
]  # fmt: skip


class Message:
    """Base of every wire message; KIND is its `t` on the wire. ROUTINE: what a peer sends to the
    controller all the time (heartbeats, progress, output, usage), read at the controller's pace
    while the job trains undisturbed; every other message rings the controller's doorbell so it
    is read at once (protocol.wire)."""

    KIND: ClassVar[str] = ""
    ROUTINE: ClassVar[bool] = False


# -- node agent -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentHello(Message):
    KIND = "agent-hello"
    node: str
    chips: int
    hosts_pods: bool = False
    """The agent starts its node's pods when the controller sends it their plans (`StartPod`):
    an agent on a machine of its own (Slurm's steps, `relaunch agent` by hand). False: the
    engine starts them (the embedded cluster, Ray's node hosts)."""
    address: str = ""
    """The node's address for its peers (MASTER_ADDR where rank 0 runs); "": the engine's."""
    free_port: int = 0
    """A TCP port free on the node when the agent said so (MASTER_PORT; refreshed in every
    heartbeat)."""
    peer_memory: str = ""
    """HOST:PORT where the node keeps copies of other nodes' checkpoints in memory, on its data
    link (relaunch.cluster.keeper); "" : it keeps none."""


@dataclass(frozen=True)
class ChipReport:
    """A chip the agent reports faulty: since `at`, with `code`; `seq` tells reports apart."""

    seq: int
    chip: int
    code: str
    heals: bool
    kind: str
    """"chip" or "memory-uce"."""
    at: float


@dataclass(frozen=True)
class LinkReport:
    seq: int
    at: float
    duration_s: float | None
    """How long the link was down, once it is back; None while it is still down."""
    cause: str = ""
    """What the agent saw (a real link): "carrier lost", or its peers not answering."""


@dataclass(frozen=True)
class Heartbeat(Message):
    KIND = "heartbeat"
    ROUTINE = True
    node: str
    at: float
    chips: tuple[ChipReport, ...] = ()
    link: LinkReport | None = None
    link_down: bool = False
    """The node's data link is down now (said at once, before R-12 makes it a fault: ranks
    that wait for the network meanwhile are not hung)."""
    data_rtt_ms: float | None = None
    """The node's data-link round trip as its agent's probes of its neighbours find it (the median
    of each one's 90th percentile; None: no real link): a degraded link queues them."""
    free_port: int = 0
    """An agent that hosts its node's pods: a TCP port free on the node now (0: none said)."""


@dataclass(frozen=True)
class Healed(Message):
    KIND = "healed"
    request: int
    node: str
    ok: bool


@dataclass(frozen=True)
class InjectChipFault(Message):
    KIND = "inject-chip-fault"
    index: int
    chip: int
    code: str
    heals: bool
    kind: str


@dataclass(frozen=True)
class InjectNetworkFault(Message):
    KIND = "inject-network-fault"
    index: int
    duration_s: float | None
    heals: bool


@dataclass(frozen=True)
class InjectCopyCorruption(Message):
    """The fault plan's `peer-copy-corrupt`: the node's peer memory goes bad for job `job`."""

    KIND = "inject-copy-corruption"
    index: int
    job: str


@dataclass(frozen=True)
class Heal(Message):
    KIND = "heal"
    request: int


@dataclass(frozen=True)
class Injected(Message):
    """A fault-plan entry was (ok) or could not be (why) injected."""

    KIND = "injected"
    index: int
    ok: bool
    why: str = ""
    at: float = 0.0


@dataclass(frozen=True)
class Shutdown(Message):
    """End: an agent exits; a launcher stops its processes (SIGTERM, SIGKILL after `grace`)."""

    KIND = "shutdown"
    grace: float = 0.0


@dataclass(frozen=True)
class ForgetCopies(Message):
    """Jobs that ended for good, as (`local_checkpoint_dir`, job): the agent removes its node's
    copies of each (relaunch.train.local.forget_job), before it exits at a Shutdown. Sent at the
    job's end, and as an agent joins, for ended jobs whose agents may never have heard it."""

    KIND = "forget-copies"
    copies: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class StartPod(Message):
    """To an agent that hosts its node's pods: start the launcher `plan` describes (a pod's,
    or a standby launcher), in the pod's cgroup where the node has them."""

    KIND = "start-pod"
    plan: LaunchPlan


@dataclass(frozen=True)
class Crash(Message):
    """To an agent that hosts its node's pods: the fault plan's node-down. Every process of
    the node's pods is killed and the agent exits at once, as a node that dies does."""

    KIND = "crash"


# -- pod launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcReport:
    attempt: int
    pid: int
    running: bool
    code: int | None
    progressed: bool = False
    """It reported a step or printed since it started: a controller that adopts it (a resume)
    gives it the hang window, not the startup allowance."""


@dataclass(frozen=True)
class LauncherHello(Message):
    KIND = "launcher-hello"
    job: int
    pod: int
    generation: int
    pid: int
    attempt: int
    node: str
    standby: bool = False
    procs: dict[int, ProcReport] = field(default_factory=dict)


@dataclass(frozen=True)
class Started(Message):
    """The ranks one Start started, with their pids, in one message (not one a rank: a restart
    of thousands of pods is thousands of messages, not tens of thousands)."""

    KIND = "started"
    attempt: int
    at: float
    pids: dict[int, int]


@dataclass(frozen=True)
class Output(Message):
    KIND = "output"
    ROUTINE = True
    rank: int
    attempt: int
    line: str


@dataclass(frozen=True)
class Progress:
    rank: int
    step: int
    attempt: int
    at: float


@dataclass(frozen=True)
class RankPhase:
    rank: int
    attempt: int
    phase: str
    at: float


@dataclass(frozen=True)
class ProgressBatch(Message):
    """The newest step of each rank that reported one, and phase changes, since the last batch."""

    KIND = "progress"
    ROUTINE = True  # but a rank's first step and phases go urgently (the launcher says so)
    reports: tuple[Progress, ...] = ()
    phases: tuple[RankPhase, ...] = ()
    busy: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per running rank, since its process started: (looks that found its main thread not
    sleeping, looks). A rank slower than its peers is the one that rarely waits for them."""


@dataclass(frozen=True)
class Exited(Message):
    """A rank exited that no Stop or Shutdown asked to (a failure, or the end of its work): the
    ranks a stop ends are told in its `Stopped`."""

    KIND = "exited"
    rank: int
    attempt: int
    code: int | None
    signal: int | None
    at: float
    detail: str = ""
    """Why the command could not be started, if it could not."""
    error: ErrorReport | None = None
    """What a rank that failed said of its failure (its error file, or its last lines)."""


@dataclass(frozen=True)
class Stopped(Message):
    """A Stop was carried out. (A Shutdown has no `Stopped`: the launcher's close answers it,
    and the controller waits for that before a pod's next launcher may start.)"""

    KIND = "stopped"
    attempt: int
    at: float
    exited: dict[int, tuple[int, int | None, int | None]] = field(default_factory=dict)
    """The ranks the stop ended: rank -> (its attempt, exit code, signal). A rank that failed
    before it was asked to stop is an `Exited` of its own (its failure is a fault)."""


@dataclass(frozen=True)
class Usage(Message):
    """Each running rank's process-tree CPU seconds and I/O bytes, when they changed; and how
    many looks since the last sample found its main thread running or in disk I/O."""

    KIND = "usage"
    ROUTINE = True
    attempt: int
    at: float
    ranks: dict[int, tuple[float, int]] = field(default_factory=dict)
    working: dict[int, int] = field(default_factory=dict)
    stopped: dict[int, int] = field(default_factory=dict)
    """Per rank, how many looks since the last sample found it stopped (SIGSTOP, a debugger)."""


@dataclass(frozen=True)
class CaptureStacks(Message):
    """A hang: read every running rank's Python stack, each within `timeout_s`."""

    KIND = "capture-stacks"
    request: int
    timeout_s: float


@dataclass(frozen=True)
class Stacks(Message):
    KIND = "stacks"
    request: int
    attempt: int
    stacks: tuple[StackGroup, ...] = ()
    """The launcher's ranks' stacks, alike ones once (a hung pod's wait in one collective)."""


@dataclass(frozen=True)
class Start(Message):
    KIND = "start"
    attempt: int
    env: dict[str, str]
    ranks: tuple[int, ...] | None = None
    """Only these ranks (a process-level restart); None: every rank not running."""


@dataclass(frozen=True)
class Stop(Message):
    KIND = "stop"
    grace: float
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class InjectProcessFault(Message):
    KIND = "inject-process-fault"
    index: int
    kind: str
    """"exit" (it exits `exit_code`), "hang" (SIGSTOP), "slow" (the pod runs 1/`factor` of the
    time, `duration_s` or to its end), "corrupt" (its SDK flips what `corruption` says)."""
    rank: int
    exit_code: int = 1
    factor: float = 1.0
    duration_s: float | None = None
    corruption: str = ""  # protocol.integrity.Corruption, as JSON


@dataclass(frozen=True)
class MembershipUpdate(Message):
    KIND = "membership"
    membership: Membership


@dataclass(frozen=True)
class Assume(Message):
    """A standby launcher becomes the launcher of the pod `plan` describes."""

    KIND = "assume"
    plan: LaunchPlan


@dataclass(frozen=True)
class CollectiveFailed(Message):
    """A collective the training SDK issued failed on its transport (R-29): which, in which
    generation of the group, and why. Every rank whose collective failed says so."""

    KIND = "collective-failed"
    rank: int
    attempt: int
    step: int
    collective: int
    generation: int
    why: str
    at: float


@dataclass(frozen=True)
class CorruptionFound(Message):
    """A rank found the replicas' parameters apart at `step` (R-45): the ranks the majority
    names (none where it names none), the last step they agreed (None: none), what was seen."""

    KIND = "corruption-found"
    rank: int
    attempt: int
    step: int
    clean_step: int | None
    culprits: tuple[int, ...]
    fingerprints: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class Restored(Message):
    """A rank restored a checkpoint's step; `tier` says which tier served its bytes (a peer's
    memory, the node's disk, storage, a healthy replica: `relaunch.restores.RestoreTier`) and
    `holder` the node or rank that held them: for the job's record."""

    KIND = "restored"
    rank: int
    attempt: int
    step: int
    tier: str
    holder: str
    at: float


@dataclass(frozen=True)
class Lease(Message):
    """The controller still hears the pod: its lease runs on (R-14). A launcher that hears nothing
    from its controller for the plan's `lease_s` takes its pod for abandoned and stops its
    processes: a node cut off from the controller never trains beside its pods' replacements."""

    KIND = "lease"


_KINDS: Final[dict[str, type[Message]]] = {
    cls.KIND: cls
    for cls in (
        AgentHello, Heartbeat, Healed, InjectChipFault, InjectNetworkFault, InjectCopyCorruption,
        Heal, Injected,
        Shutdown, ForgetCopies, LauncherHello, Started, Output, ProgressBatch, Exited, Stopped,
        Usage, Start, Stop, InjectProcessFault, MembershipUpdate, Assume, CaptureStacks, Stacks,
        Lease, CollectiveFailed, StartPod, Crash, Restored, CorruptionFound,
    )
}  # fmt: skip


_ENCODER: Final = msgspec.json.Encoder()


@functools.cache
def _head(kind: str) -> bytes:
    return b'{"t":' + msgspec.json.encode(kind)


def encode_line(message: Message) -> bytes:
    """One line of JSON, as bytes, its kind first (`decode` reads the kind without parsing the
    rest twice)."""
    body = _ENCODER.encode(message)
    head = _head(message.KIND)
    return head + b"}" if body == b"{}" else head + b"," + body[1:]


def encode(message: Message) -> str:
    """One line of JSON."""
    return encode_line(message).decode()


_DECODERS: Final[dict[str, msgspec.json.Decoder[Message]]] = {
    name: msgspec.json.Decoder(kind) for name, kind in _KINDS.items()
}


def decode(line: str | bytes) -> Message | None:
    """The message a line carries; None for a line that is not one (ignored, not fatal)."""
    try:
        data = line.encode() if isinstance(line, str) else line
        if data.startswith(b'{"t":"'):  # as `encode` writes it: the kind, then the fields
            decoder = _DECODERS.get(data[6 : data.find(b'"', 6)].decode("utf-8", "replace"))
            if decoder is not None:
                try:  # not contextlib.suppress: a context object a message, thousands a second
                    return decoder.decode(data)
                except (msgspec.MsgspecError, ValueError):
                    pass  # the careful way below says what it is
        parsed = json.loads(data)
        kind = _KINDS[parsed.pop("t")]
        return from_data(kind, parsed)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
