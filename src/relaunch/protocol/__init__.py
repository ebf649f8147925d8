"""The contracts between relaunch's processes, each defined once: the wire messages, the launch
plan and the membership, the environment a job's processes get, the state-directory layout.
Imported by the controller, the launcher, the node agent and the training SDK; standard library
only, so that it costs a training process nothing to import."""

from relaunch.protocol.environment import Env, PodEnvironment
from relaunch.protocol.layout import FENCE_FILE, JobDir, PodDir, StateDir
from relaunch.protocol.plans import LaunchPlan, Membership, read_membership, write_atomically

__all__ = [
    "FENCE_FILE",
    "Env",
    "JobDir",
    "LaunchPlan",
    "Membership",
    "PodDir",
    "PodEnvironment",
    "StateDir",
    "read_membership",
    "write_atomically",
]
