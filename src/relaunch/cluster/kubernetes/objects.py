"""The Kubernetes objects of a relaunch job, as data: their names, labels and annotations, and
the Pod of a pod's launch plan (what both the controller and a node's agent read; pure).

One relaunch pod is one Pod: its launcher is the container's entrypoint, its plan the
container's `RELAUNCH_PLAN`, placed by the scheduler on the node relaunch chose (a required node
affinity on the node's name: the scheduler binds it, as any Pod), never restarted by the kubelet
(relaunch decides what runs again). A controller holds a Lease in the job's namespace while it
runs, its address an annotation the nodes' agents dial.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from relaunch.protocol.plans import LaunchPlan

__all__ = [
    "CONTROLLER_ADDRESS",
    "ISOLATED_TAINT",
    "JOB_LABEL",
    "PLAN_ENV",
    "ROLE_LABEL",
    "STATE_LABEL",
    "Container",
    "container_of",
    "controller_lease",
    "pod_manifest",
    "pod_name",
    "state_label",
    "taint_value",
]

JOB_LABEL: Final = "relaunch.io/job"
POD_LABEL: Final = "relaunch.io/pod"
GENERATION_LABEL: Final = "relaunch.io/generation"
STATE_LABEL: Final = "relaunch.io/state"
"""Which controller's objects (its state directory, hashed): two runs never touch each other's."""
ROLE_LABEL: Final = "relaunch.io/role"
CONTROLLER_ADDRESS: Final = "relaunch.io/controller-address"
ISOLATED_TAINT: Final = "relaunch.io/isolated"
ISOLATED_REASON: Final = "relaunch.io/isolated-reason"
PLAN_ENV: Final = "RELAUNCH_PLAN"
NODE_LABEL: Final = "relaunch.io/node"
"""On a Node that a relaunch agent runs: its chips are the job's to use."""
SIMULATED_CHIP: Final = "relaunch.io/chip"
GPU: Final = "nvidia.com/gpu"


def state_label(state_dir: Path) -> str:
    return hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:12]


def _dns(text: str) -> str:
    """`text` as a DNS label: lower case, letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40] or "job"


def label_value(text: str) -> str:
    """`text` as a label (or taint) value: 63 characters of letters, digits, `-_.`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:63]


taint_value = label_value


def pod_name(plan: LaunchPlan) -> str:
    job = _dns(plan.job_name or f"job-{plan.job}")
    which = "standby" if plan.standby else f"pod-{plan.pod}"
    return f"{job}-{plan.job}-{which}-g{plan.generation}-{_dns(plan.node)}"


def pod_manifest(plan: LaunchPlan, state: str, python: str) -> dict[str, Any]:
    """The Pod of `plan`, on `plan.node` (see the module docstring)."""
    labels = {
        JOB_LABEL: label_value(plan.job_name or str(plan.job)),
        POD_LABEL: "standby" if plan.standby else str(plan.pod),
        GENERATION_LABEL: str(plan.generation),
        STATE_LABEL: state,
    }
    node_is = {"key": "metadata.name", "operator": "In", "values": [plan.node]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name(plan), "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": int(plan.termination_grace_s) + 5,
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchFields": [node_is]}]
                    }
                }
            },
            "containers": [
                {
                    "name": "launcher",
                    "image": "relaunch",
                    "command": [python, "-m", "relaunch.launcher"],
                    "env": [{"name": PLAN_ENV, "value": plan.to_json()}],
                }
            ],
        },
    }


def plan_of(pod: Any) -> LaunchPlan | None:
    """The launch plan a Pod (the kubernetes client's V1Pod) carries; None: not relaunch's."""
    for container in pod.spec.containers or []:
        for variable in container.env or []:
            if variable.name == PLAN_ENV and variable.value:
                return LaunchPlan.from_json(variable.value)
    return None


def controller_lease(
    name: str, state: str, address: str, holder: str, lease_s: int
) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "labels": {ROLE_LABEL: "controller", STATE_LABEL: state},
            "annotations": {CONTROLLER_ADDRESS: address},
        },
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": lease_s},
    }


@dataclass(frozen=True)
class Container:
    """What a node's agent runs of a Pod that is not relaunch's (a Kubernetes Job's, a user's):
    its one container's command, as a process of the node (there is no image to run it in)."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    workdir: str | None


_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def _field(pod: Any, path: str, node: str, address: str) -> str | None:
    """The downward API's value of `path` for `pod` (None: not one this kubelet gives)."""
    meta = pod.metadata
    plain = {"metadata.name": meta.name, "metadata.namespace": meta.namespace,
             "metadata.uid": meta.uid, "spec.nodeName": node, "spec.serviceAccountName":
             pod.spec.service_account_name or "default", "status.podIP": address,
             "status.hostIP": address}  # fmt: skip
    if path in plain:
        return str(plain[path])
    keyed = _FIELD.fullmatch(path)
    if keyed is None:
        return None
    table = (meta.labels if keyed.group(1) == "labels" else meta.annotations) or {}
    return str(table.get(keyed.group(2), ""))


def container_of(pod: Any, node: str, address: str) -> Container | str:
    """The container of `pod` (the kubernetes client's V1Pod) as this node's agent runs it:
    its command and args, its env's values and the downward API's fields (`fieldRef`: the Job
    controller gives an Indexed Job's pods their index so); or why not, in a line."""
    containers = pod.spec.containers or []
    if len(containers) != 1 or pod.spec.init_containers:
        return f"relaunch's agent runs a Pod of one container: {pod.metadata.name} has more"
    container = containers[0]
    argv = tuple([*(container.command or []), *(container.args or [])])
    if not argv:
        return (
            f"container {container.name} has no command: relaunch's agent runs a container's "
            "command on its node (no image is pulled or run)"
        )
    env: dict[str, str] = {}
    for variable in container.env or []:
        source = variable.value_from
        if source is None:
            env[variable.name] = _expand(variable.value or "", env)
            continue
        value = (
            None
            if source.field_ref is None
            else _field(pod, source.field_ref.field_path, node, address)
        )
        if value is None:
            return f"env {variable.name}: only values and the downward API's fields are given here"
        env[variable.name] = value
    argv = tuple(_expand(arg, env) for arg in argv)  # as Kubernetes expands command and args
    return Container(container.name, argv, env, container.working_dir)


def _expand(value: str, env: dict[str, str]) -> str:
    """`$(NAME)` of a variable defined before, as Kubernetes expands it (`$$` escapes)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )
