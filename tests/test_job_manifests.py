"""Jobs as Kubernetes users write them (relaunch.spec.manifests): a Volcano Job, an Ascend
operator job and a PyTorchJob, read as relaunch's job with MindCluster's labels and annotations
where their docs put them; what cannot be run refused in one line, nothing started."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.errors import SpecError
from relaunch.spec import parse_job
from relaunch.spec.vocabulary import FaultScheduling, ProcessRecoverEnable, RecoverStrategy

ROOT = Path(__file__).resolve().parents[1]
VOLCANO = yaml.safe_load((ROOT / "examples" / "kubernetes" / "volcano-job.yaml").read_text())


def ascend_job(**labels: str) -> dict[str, Any]:
    """An AscendJob as MindCluster's docs write one: a Master and Workers of one template,
    process-level rescheduling on (its label, its annotation, the env it asks of the trainer)."""
    template = {
        "spec": {
            "containers": [
                {
                    "name": "ascend",
                    "image": "pytorch-ascend:24.0",
                    "command": ["/bin/bash", "-c", "cd /job/code; bash train_start.sh"],
                    "env": [{"name": "PROCESS_RECOVER", "value": "on"}],
                    "workingDir": "/job/code",
                    "resources": {"limits": {"huawei.com/Ascend910": 8}},
                }
            ]
        }
    }
    return {
        "apiVersion": "mindxdl.gitee.com/v1",
        "kind": "AscendJob",
        "metadata": {
            "name": "pretrain",
            "labels": {
                "framework": "pytorch",
                "process-recover-enable": "on",
                "fault-scheduling": "grace",
                "pod-rescheduling": "on",
                **labels,
            },
            "annotations": {"recover-strategy": "recover,dump"},
        },
        "spec": {
            "runPolicy": {"backoffLimit": 2, "schedulingPolicy": {"minAvailable": 4}},
            "replicaSpecs": {
                "Master": {"replicas": 1, "template": copy.deepcopy(template)},
                "Worker": {"replicas": 3, "template": copy.deepcopy(template)},
            },
        },
    }


def test_a_volcano_job_with_mindclusters_labels_is_read_with_those_settings() -> None:
    job = parse_job(VOLCANO, source="volcano-job.yaml")
    assert (job.name, job.replicas, job.procs_per_pod, job.chips_per_pod) == (
        "toy-volcano",
        2,
        1,
        2,
    )
    assert job.command == ("/bin/sh", "-c", "python examples/train_toy.py --steps 120")
    assert job.env == {"TOY_NOTE": "from a Volcano Job"}
    r = job.recovery
    assert r.pod_reschedule and r.fault_retry_times == 3
    assert r.fault_scheduling is FaultScheduling.FORCE
    assert r.job_retry_budget == 4  # job-retry-num 4, under maxRetry's 6


def test_an_ascend_operator_job_adds_up_its_roles_and_reads_process_recovery() -> None:
    job = parse_job(ascend_job(), source="ascend-job.yaml")
    assert (job.replicas, job.procs_per_pod, job.chips_per_pod) == (4, 1, 8)
    assert job.working_dir == "/job/code"
    assert job.recovery.process_recovery is ProcessRecoverEnable.ON
    assert RecoverStrategy.RECOVER in job.recovery.recover_strategies
    assert job.recovery.job_retry_budget == 2  # runPolicy.backoffLimit


def test_a_pytorchjob_maps_as_the_ascend_operators_job_does() -> None:
    document = ascend_job()
    document["apiVersion"], document["kind"] = "kubeflow.org/v1", "PyTorchJob"
    document["spec"]["pytorchReplicaSpecs"] = document["spec"].pop("replicaSpecs")
    job = parse_job(document, source="pytorchjob.yaml")
    assert (job.name, job.replicas, job.chips_per_pod) == ("pretrain", 4, 8)


def _two_containers(d: dict[str, Any]) -> None:
    containers = d["spec"]["replicaSpecs"]["Master"]["template"]["spec"]["containers"]
    containers.append({**containers[0], "name": "sidecar"})
    d["spec"]["replicaSpecs"]["Worker"]["template"] = d["spec"]["replicaSpecs"]["Master"][
        "template"
    ]


def _secret(d: dict[str, Any]) -> None:
    for role in d["spec"]["replicaSpecs"].values():
        role["template"]["spec"]["containers"][0]["env"].append(
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
        )


def _scheduler(d: dict[str, Any]) -> None:
    d["spec"]["replicaSpecs"]["Scheduler"] = d["spec"]["replicaSpecs"]["Master"]


def _different(d: dict[str, Any]) -> None:
    d["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = ["x"]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (_two_containers, "Master.template.spec.containers"),
        (_secret, "env.TOKEN.valueFrom"),
        (_scheduler, "spec.replicaSpecs.Scheduler"),
        (_different, "Worker.template"),
    ],
)
def test_what_relaunch_cannot_run_is_refused_in_one_line_naming_it(change: Any, key: str) -> None:
    document = ascend_job()
    change(document)
    with pytest.raises(SpecError) as refused:
        parse_job(document, source="ascend-job.yaml")
    assert [p.key for p in refused.value.problems] == [key]


def test_a_volcano_job_of_two_tasks_is_refused() -> None:
    document = copy.deepcopy(VOLCANO)
    document["spec"]["tasks"].append({**document["spec"]["tasks"][0], "name": "ps"})
    with pytest.raises(SpecError) as refused:
        parse_job(document, source="volcano-job.yaml")
    assert [p.key for p in refused.value.problems] == ["spec.tasks"]


def test_a_bad_mindcluster_label_on_a_volcano_job_is_relaunchs_own_error() -> None:
    document = copy.deepcopy(VOLCANO)
    document["metadata"]["labels"]["fault-scheduling"] = "sometimes"
    with pytest.raises(SpecError) as refused:
        parse_job(document, source="volcano-job.yaml")
    assert any("fault-scheduling" in p.key for p in refused.value.problems)
