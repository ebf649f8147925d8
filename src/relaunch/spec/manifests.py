"""Jobs as Kubernetes users write them, read as relaunch's job document (pure).

- a **Volcano Job** (`batch.volcano.sh/v1alpha1`, `Job`): its one task's `replicas` and pod
  template; `spec.maxRetry` is the job's `backoff_limit` (Volcano's retries before Failed);
- an **Ascend operator job** (`mindxdl.gitee.com/v1`, `AscendJob`) and a **PyTorchJob**
  (`kubeflow.org/v1`): their `Master` and `Worker` replicas, one pod template between them,
  the replicas added up; `runPolicy.backoffLimit` is the `backoff_limit`.

What is read: `metadata.name`, `metadata.labels` and `metadata.annotations` as they are (where
MindCluster and ModelArts put `fault-scheduling`, `pod-rescheduling`, `process-recover-enable`,
`fault-retry-times`, `recover-strategy` and the `fault-tolerance/` annotations: relaunch's
parser reads them from there, with their own errors); the template's one container: `command`
and `args` (the pod's one process: `procs_per_pod` 1, as Kubernetes runs it), `env` (values),
`workingDir`, and its chips from `resources` (`huawei.com/Ascend910*`, `nvidia.com/gpu`: the
limit, else the request).
What is refused, in one line each, before anything starts: a second container, an environment
variable from a secret or field (`valueFrom`), roles whose templates differ, a MindSpore
`Scheduler` role. Everything else is ignored (:data:`IGNORED` says what, for `relaunch
validate`): the image, volumes, the scheduler's settings (`schedulerName`, `queue`,
`minAvailable`, `priorityClassName`), Volcano's `policies` and `plugins` (relaunch's ladder
is the policy), node selectors, tolerations and `terminationGracePeriodSeconds` (relaunch's
Pods take the job's own grace).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any, Final, NoReturn

from relaunch.errors import Problem, SpecError

__all__ = ["IGNORED", "KINDS", "job_document"]

KINDS: Final = {
    ("batch.volcano.sh/v1alpha1", "Job"): "Volcano Job",
    ("mindxdl.gitee.com/v1", "AscendJob"): "Ascend operator job",
    ("kubeflow.org/v1", "PyTorchJob"): "PyTorchJob",
}
CHIPS: Final = ("huawei.com/Ascend910", "huawei.com/Ascend310", "nvidia.com/gpu")
IGNORED: Final = (
    "image", "volumes", "schedulerName", "queue", "minAvailable", "priorityClassName",
    "policies", "plugins", "nodeSelector", "tolerations", "namespace",
    "terminationGracePeriodSeconds",
)  # fmt: skip
ROLES: Final = ("Master", "Worker")


def job_document(data: Any, source: str) -> Any:
    """`data` as relaunch's job document where it is one of :data:`KINDS` (else as it is)."""
    if not isinstance(data, Mapping):
        return data
    kind = KINDS.get((str(data.get("apiVersion")), str(data.get("kind"))))
    if kind is None:
        return data
    given = data.get("spec")
    spec: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    if kind == "Volcano Job":
        tasks = spec.get("tasks") or []
        if not isinstance(tasks, list) or len(tasks) != 1 or not isinstance(tasks[0], Mapping):
            _refuse(
                source, "spec.tasks", tasks, "one task: relaunch runs one role of identical pods"
            )
        roles = {"tasks[0]": tasks[0]}
        retries = spec.get("maxRetry")
    else:
        replica_specs = spec.get(
            "replicaSpecs" if kind == "Ascend operator job" else "pytorchReplicaSpecs"
        )
        if not isinstance(replica_specs, Mapping) or not replica_specs:
            _refuse(source, "spec.replicaSpecs", replica_specs, "Master and Worker replicas")
        if "Scheduler" in replica_specs:
            _refuse(source, "spec.replicaSpecs.Scheduler", "Scheduler",
                    "MindSpore's scheduler role is not run by relaunch yet")  # fmt: skip
        other = sorted(set(replica_specs) - set(ROLES))
        if other:
            _refuse(source, f"spec.replicaSpecs.{other[0]}", other[0], "a role of Master, Worker")
        roles = {role: replica_specs[role] for role in ROLES if role in replica_specs}
        retries = (spec.get("runPolicy") or {}).get("backoffLimit")
    return _document(data, kind, roles, retries, source)


def _document(
    data: Mapping[str, Any], kind: str, roles: Mapping[str, Any], retries: Any, source: str
) -> dict[str, Any]:
    templates = {role: (r or {}).get("template") or {} for role, r in roles.items()}
    first_role, template = next(iter(templates.items()))
    for role, other in templates.items():
        if other != template:
            _refuse(source, f"{role}.template", role, f"the same pod template as {first_role}")
    pod = template.get("spec") or {}
    containers = pod.get("containers") or []
    if len(containers) != 1:
        _refuse(source, f"{first_role}.template.spec.containers", len(containers), "one container")
    container = containers[0]
    workload: dict[str, Any] = {
        "replicas": sum(int((r or {}).get("replicas", 1)) for r in roles.values()),
        "procs_per_pod": 1,
        "command": _command(container, source),
        "env": _environment(container, source),
    }
    chips = _chips(container)
    if chips is not None:
        workload["chips_per_pod"] = chips
    if container.get("workingDir"):
        workload["working_dir"] = container["workingDir"]
    if retries is not None:
        workload["backoff_limit"] = retries
    metadata = data.get("metadata") or {}
    return {
        "kind": "job",
        "metadata": {k: metadata[k] for k in ("name", "labels", "annotations") if k in metadata},
        "spec": workload,
    }


def _command(container: Mapping[str, Any], source: str) -> str:
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    if not words or not all(isinstance(w, str) for w in words):
        _refuse(source, "containers[0].command", words, "the container's command and args")
    return shlex.join(words)


def _environment(container: Mapping[str, Any], source: str) -> dict[str, str]:
    env = {}
    for variable in container.get("env") or []:
        if "valueFrom" in variable:
            _refuse(source, f"env.{variable.get('name')}.valueFrom", "valueFrom",
                    "a value (relaunch does not read secrets or fields)")  # fmt: skip
        env[str(variable.get("name"))] = str(variable.get("value", ""))
    return env


def _chips(container: Mapping[str, Any]) -> int | None:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        for name, count in (resources.get(section) or {}).items():
            if str(name).startswith(CHIPS):
                return int(count)
    return None


def _refuse(source: str, key: str, value: Any, expected: str) -> NoReturn:
    raise SpecError(source, [Problem(key, value, expected)])
