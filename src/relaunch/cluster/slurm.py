"""SlurmCluster: the Engine inside a Slurm allocation (`sbatch` or `salloc`).

`relaunch run --engine slurm` runs where the batch script runs (the allocation's first node): the
controller there, and one node agent per allocated node, each **its own step** (`srun --nodes=1
--ntasks=1 --nodelist=NODE --overlap`). One step per node, not one step of all nodes: a step
whose node is lost may end with it, and a step of all nodes would take every other node's agent
(and so every pod) down with it; Slurm's `--no-kill` keeps the allocation, not the step. A node's
agent starts that node's pods itself (`--hosts-pods`, cluster.hosted and cluster.podhost): as
cgroups on its node where it can make them, with torchrun's environment and MASTER_ADDR on rank
0's node's address (the address the agent reaches the controller from, Slurm's NodeAddr).

The nodes the job does not need are its standby nodes, as on every engine (the cluster's nodes
are the allocation's; the job's pods take the first ones).

A node is lost when its agent falls silent (the heartbeat, as everywhere), when its agent's step
ends (its `srun` exits: seen at once), or when Slurm says so: DOWN, DRAIN, FAIL or not responding
in `scontrol show node` (polled every `poll_s`). A node relaunch isolates is drained in Slurm
(`scontrol update NodeName=... State=DRAIN Reason="relaunch: ..."`), where the user may; where
not, the engine says why once (`isolate_node`).

The job's state directory must be on a filesystem every node sees (the pods' plans, logs and
checkpoints are there), as Slurm jobs' working directories are.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from relaunch.cluster import NOTHING_COUNTED, EngineFacts, LeftBehind, NoRehearsal, Rehearsal
from relaunch.cluster.config import ClusterConfig, NodeSpec
from relaunch.cluster.hosted import AgentsCluster
from relaunch.cluster.nvml import SIMULATE_CHIPS_ENV, gpu_count
from relaunch.errors import EngineError
from relaunch.protocol.wire import controller_address

__all__ = ["Allocation", "SlurmCluster", "SlurmNode", "node_states", "parse_nodes"]

AGENT_STEP: Final = "relaunch-agent"
"""The name of every agent's step (`squeue -s`), with its node's after a dash."""
REASON_PREFIX: Final = "relaunch: "
"""How relaunch's reason for a node it drained begins; a reason that does not is someone
else's (an administrator's), and relaunch never writes over it."""
LOST_STATES: Final = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER_DOWN", "POWERED_DOWN")
"""Slurm node states (or flags) under which relaunch takes a node for lost."""
CALL_TIMEOUT_S: Final = 10.0
STEP_WAIT_S: Final = 10.0
"""At the job's end, how long the agents' steps are waited for (then again, once cancelled)."""


@dataclass(frozen=True)
class SlurmNode:
    """A node as `scontrol show node` says it."""

    name: str
    state: str
    """Slurm's state with its flags, as it says it (IDLE, MIXED+DRAIN, DOWN*, ...)."""
    reason: str
    address: str

    @property
    def lost(self) -> bool:
        """Slurm takes the node out (down, drained or draining, failed, not responding)."""
        flags = re.split(r"[+]", self.state.rstrip("*~#!%$@^-"))
        return self.state.endswith("*") or any(flag in LOST_STATES for flag in flags)

    @property
    def drained_by_someone_else(self) -> bool:
        """Drained with a reason that is not relaunch's (`isolate_node` writes REASON_PREFIX):
        an administrator's, which relaunch never writes over."""
        return (
            "DRAIN" in self.state
            and bool(self.reason)
            and not self.reason.startswith(REASON_PREFIX)
        )

    @property
    def seen(self) -> str:
        """What Slurm says of a lost node, in words: an administrator's drain with its reason,
        or Slurm's state and reason."""
        if self.drained_by_someone_else:
            return f"drained by the administrator: {_bare(self.reason)}"
        said = f"Slurm marks it {self.state}"
        return f"{said}: {_bare(self.reason)}" if self.reason else said


def _bare(reason: str) -> str:
    """A Slurm reason without the `[user@time]` Slurm appends."""
    return re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason).strip()


def parse_nodes(text: str) -> dict[str, SlurmNode]:
    """`scontrol show node -o`'s lines, by node name (pure)."""
    found = {}
    for line in text.splitlines():
        fields = _fields(line)
        name = fields.get("NodeName")
        if name:
            found[name] = SlurmNode(
                name,
                fields.get("State", "UNKNOWN"),
                fields.get("Reason", ""),
                fields.get("NodeAddr", name),
            )
    return found


def _fields(line: str) -> dict[str, str]:
    """KEY=VALUE pairs of one line; a value runs to the next ` KEY=` (Reason has spaces)."""
    pairs = re.findall(r"(\w+)=(.*?)(?=\s+\w+=|$)", line.strip())
    return dict(pairs)


def _slurm(args: list[str], timeout: float = CALL_TIMEOUT_S) -> str:
    """A Slurm command's output; EngineError naming it where it fails."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EngineError(f"`{' '.join(args)}` did not answer: {error}") from None
    if done.returncode != 0:
        raise EngineError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def node_states(names: list[str] | None = None) -> dict[str, SlurmNode]:
    """What Slurm says of `names` (every node where None) now."""
    return parse_nodes(
        _slurm(["scontrol", "show", "node", "-o", *([",".join(names)] if names else [])])
    )


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation relaunch runs in: its job id, its nodes in order, the batch host."""

    job_id: str
    nodes: tuple[str, ...]
    batch_host: str

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Allocation:
        """The allocation of this `sbatch` script or `salloc` shell; EngineError outside one."""
        env = os.environ if environ is None else environ
        job_id, node_list = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
        if not job_id or not node_list:
            raise EngineError(
                "--engine slurm runs inside a Slurm allocation (SLURM_JOB_ID and "
                "SLURM_JOB_NODELIST are not set): run it from an sbatch script or an salloc "
                "shell, see docs/slurm.md"
            )
        if shutil.which("srun") is None or shutil.which("scontrol") is None:
            raise EngineError("--engine slurm needs Slurm's srun and scontrol on PATH")
        nodes = tuple(_slurm(["scontrol", "show", "hostnames", node_list]).split())
        batch_host = env.get("SLURMD_NODENAME") or nodes[0]
        return cls(job_id, nodes, batch_host)

    def cluster(self, stored: ClusterConfig) -> ClusterConfig:
        """The job's cluster in this allocation: its nodes, each with the chips the job's nodes
        had (a requeued job's allocation may hold other nodes than its first one's)."""
        chips = stored.nodes[0].chips if stored.nodes else 2
        return replace(stored, nodes=tuple(NodeSpec(name, chips) for name in self.nodes))


class SlurmCluster(AgentsCluster):
    """The engine inside a Slurm allocation (see the module docstring)."""

    def __init__(self, state_dir: Path, allocation: Allocation, poll_s: float = 1.0) -> None:
        known = node_states(list(allocation.nodes))
        addresses = {name: node.address for name, node in known.items()}
        # the batch host's NodeAddr: the address every node reaches the controller by
        super().__init__(addresses.get(allocation.batch_host, "0.0.0.0"), 0)
        self.state_dir = state_dir
        self.allocation = allocation
        self.slurm_addresses = addresses
        self.steps: dict[str, subprocess.Popen[bytes]] = {}
        self._lost: dict[str, str] = {
            name: "Slurm does not know it" for name in allocation.nodes if name not in known
        }
        self._isolated: set[str] = set()
        """The nodes relaunch took out (`isolate_node`): no pod of the job is left there."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.slurm_said: dict[str, SlurmNode] = known
        self.poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        gpus = gpu_count()
        self._facts = EngineFacts(
            chips=f"chips are each node's GPUs ({gpus} here on {allocation.batch_host})"
            if gpus
            else "chips are simulated (no NVIDIA GPU seen on the batch host)",
            containers=super().facts.containers,
            networks=super().facts.networks,
            chips_are_gpus=bool(gpus),
            nodes_come_back=True,  # a job requeued (`scontrol requeue`) gets healthy nodes
        )

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def rehearsal(self) -> Rehearsal:
        return _SlurmRehearsal(self)

    # -- node loss --------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Slurm's word on the allocation's nodes, every poll_s."""
        while not self._stop.wait(self.poll_s):
            try:
                said = node_states(list(self.allocation.nodes))
            except EngineError:
                continue  # slurmctld restarting: no verdict this time
            with self._lock:
                self.slurm_said = said
                for name, node in said.items():
                    if node.lost:
                        self._lost.setdefault(name, node.seen)

    def _step_ended(self, node: str, step: subprocess.Popen[bytes]) -> None:
        step.wait()
        if not self._stop.is_set() and self.steps.get(node) is step:
            with self._lock:
                self._lost.setdefault(node, "its agent's step ended")
            self.hosted.forget(node)

    def lost_nodes(self) -> dict[str, str]:
        with self._lock:
            return dict(self._lost)

    # -- the engine interface -----------------------------------------------------------------------

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        address = controller_address(self.state_dir)
        if address is None:
            raise EngineError("the controller has no address yet: agents cannot be started")
        log = self.state_dir / "logs" / f"agent-{node.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = [
            "srun", f"--jobid={self.allocation.job_id}", "--nodes=1", "--ntasks=1",
            f"--nodelist={node.name}", "--overlap", "--kill-on-bad-exit=0", "--cpu-bind=none",
            f"--job-name={AGENT_STEP}-{node.name}", "--input=none",
            sys.executable, "-m", "relaunch.cluster.agent", "--state-dir", str(self.state_dir),
            "--node", node.name, "--chips", str(node.chips), "--interval", str(interval),
            "--grace", str(grace), "--blip", str(blip_s), "--hosts-pods",
            "--controller", f"{address[0]}:{address[1]}",
            *(["--simulate-chips"] if os.environ.get(SIMULATE_CHIPS_ENV) == "1" else []),
        ]  # fmt: skip
        with open(log, "a") as out:
            step = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.steps[node.name] = step
        threading.Thread(target=self._step_ended, args=(node.name, step), daemon=True).start()
        return step.pid

    def isolate_node(self, node: str, reason: str) -> str | None:
        """Drain `node` in Slurm with relaunch's reason; why not, where Slurm refused. A node
        someone else drained already (an administrator, with a reason of theirs) keeps their
        reason: relaunch never writes over a reason it did not write."""
        with self._lock:
            said = self.slurm_said.get(node)
        try:
            if said is not None and said.drained_by_someone_else:
                return None
            _slurm(["scontrol", "update", f"NodeName={node}", "State=DRAIN",
                    f"Reason={REASON_PREFIX}{reason}"[:200]])  # fmt: skip
        except EngineError as error:
            return str(error)
        finally:
            with self._lock:
                self._isolated.add(node)
        return None

    def node_address(self, node: str) -> str:
        return self.hosted.address(node, self.slurm_addresses.get(node, node))

    def shutdown(self) -> LeftBehind:
        """The agents were told to end (they kill what their pods left); their steps are waited
        for, and any still there cancelled: no step of relaunch's outlives the job. A node
        relaunch took out (isolated or lost) has no pod of the job; its agent may not have heard
        the end (a node cut off): its step is cancelled at once and its srun not waited for, which
        would last until Slurm marks the node down (SlurmdTimeout, and its pings' timeouts). Slurm
        ends that step when it marks the node down or hears from it."""
        self._stop.set()
        with self._lock:
            out = set(self._lost) | self._isolated
        self.cancel_agent_steps(only=out)
        kept = [step for node, step in self.steps.items() if node not in out]
        _wait_all(kept, STEP_WAIT_S)
        self.cancel_agent_steps()
        _wait_all(kept, STEP_WAIT_S)
        for step in self.steps.values():
            if step.poll() is None:  # an srun waiting on a node that does not answer
                step.kill()
                step.wait()
        return NOTHING_COUNTED

    def agent_steps(self) -> dict[str, str]:
        """relaunch's agent steps in the allocation now: step id -> name (`squeue -s`)."""
        text = _slurm(["squeue", "-h", "-s", "-j", self.allocation.job_id, "-o", "%i %j"])
        steps = {}
        for line in text.splitlines():
            step_id, _, name = line.strip().partition(" ")
            if name.startswith(AGENT_STEP):
                steps[step_id] = name
        return steps

    def cancel_agent_steps(self, only: set[str] | None = None) -> None:
        """`scancel` relaunch's agent steps (of the nodes `only`, where given)."""
        if only is not None and not only:
            return
        with contextlib.suppress(EngineError):
            for step_id, name in self.agent_steps().items():
                if only is None or name.removeprefix(f"{AGENT_STEP}-") in only:
                    with contextlib.suppress(EngineError):
                        _slurm(["scancel", step_id])


class _SlurmRehearsal(NoRehearsal):
    """The fault plan's node-down: the node's agent kills its pods and exits, which ends its
    step (its srun exits: the node is lost). Where the agent is gone, its step is cancelled."""

    def __init__(self, engine: SlurmCluster) -> None:
        super().__init__("relaunch does not own these machines' links")
        self.engine = engine

    def kill_node(self, node: str) -> None:
        if not self.engine.hosted.crash(node):
            self.engine.cancel_agent_steps(only={node})


def _wait_all(steps: list[subprocess.Popen[bytes]], seconds: float) -> None:
    """Until each of `steps` exited, `seconds` in all."""
    deadline = time.monotonic() + seconds
    for step in steps:
        with contextlib.suppress(subprocess.TimeoutExpired):
            step.wait(timeout=max(0.0, deadline - time.monotonic()))
