"""The cluster file: every way it can be wrong is refused naming the key, the value and what is
allowed; the settings its documentation says 0 turns off are off at 0."""

from __future__ import annotations

from typing import Any

import pytest

from relaunch.cluster.config import parse_cluster
from relaunch.errors import InputError


def test_zero_turns_off_slow_pod_detection_and_stack_capture_as_documented() -> None:
    cluster = parse_cluster({"slow_window_s": 0, "stack_capture_s": "0"})
    assert cluster.slow_window_s == 0 and cluster.stack_capture_s == 0
    assert parse_cluster({}).slow_window_s == 60 and parse_cluster({}).stack_capture_s == 5


def test_a_list_of_nodes_keeps_their_names_and_chips() -> None:
    cluster = parse_cluster({"nodes": [{"name": "a-1", "chips": 8}, {"name": "b", "chips": 0}]})
    assert [(n.name, n.chips) for n in cluster.nodes] == [("a-1", 8), ("b", 0)]
    assert [n.first_gpu for n in cluster.nodes] == [0, 8]


@pytest.mark.parametrize(
    ("data", "key", "allowed"),
    [
        ({"nodes": 0}, "nodes", "an integer from 1 to 256"),
        ({"nodes": 257}, "nodes", "an integer from 1 to 256"),
        ({"nodes": "many"}, "nodes", "an integer from 1 to 256"),
        ({"nodes": [{"name": "Node_1"}]}, "nodes", "lowercase letters"),
        ({"nodes": [{"name": "a", "chips": 65}]}, "nodes", "an integer from 0 to 64"),
        ({"nodes": [{"name": "a", "gpus": 2}]}, "nodes", "gpus"),
        ({"nodes": [{"name": "a"}, {"name": "a"}]}, "nodes", "node names must be unique"),
        ({"chips_per_node": -1}, "chips_per_node", "an integer from 0 to 64"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s", "> 0"),
        ({"heartbeat_interval_s": True}, "heartbeat_interval_s", "> 0"),
        ({"heartbeat_timeout_s": "nan"}, "heartbeat_timeout_s", "> 0"),
        (
            {"heartbeat_interval_s": 2, "heartbeat_timeout_s": 2},
            "heartbeat_timeout_s",
            "more than heartbeat_interval_s (2 s)",
        ),
        ({"adopt_grace_s": -5}, "adopt_grace_s", "<= 86400"),
        ({"root_cause_window_s": 601}, "root_cause_window_s", "<= 600"),
        ({"stack_capture_s": -1}, "stack_capture_s", "0 (off) or a number of seconds"),
        ({"stack_capture_s": 121}, "stack_capture_s", "<= 120"),
        ({"slow_window_s": -0.5}, "slow_window_s", "0 (off) or a number of seconds"),
        ({"slow_window_s": "inf"}, "slow_window_s", "<= 86400"),
        ({"slow_margin": 1}, "slow_margin", "between 0 and 1"),
        ({"slow_margin": 0}, "slow_margin", "between 0 and 1"),
        ({"pod_lease_s": 0}, "pod_lease_s", "> 0.1"),
        ({"heartbeat": 1}, "heartbeat", "heartbeat"),
    ],
)
def test_every_bad_cluster_setting_is_refused_naming_it(
    data: dict[str, Any], key: str, allowed: str
) -> None:
    with pytest.raises(InputError) as refused:
        parse_cluster(data, source="cluster.yaml")
    said = str(refused.value)
    assert said.startswith("cluster.yaml") and f"- {key}" in said and allowed in said, said


@pytest.mark.parametrize("data", [[], "nodes: 4", 4])
def test_a_cluster_file_that_is_not_a_mapping_is_refused(data: Any) -> None:
    with pytest.raises(InputError, match="a mapping of cluster settings"):
        parse_cluster(data)
