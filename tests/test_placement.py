"""Where pods go (policy.placement, pure): in the cluster's order, with chips for them."""

from __future__ import annotations

from relaunch.policy.placement import NodeCapacity, free_nodes, initial_placement, move

NODES = [NodeCapacity(f"node-{i}", 2) for i in range(4)]


def test_a_new_job_takes_the_first_nodes_with_room_in_order() -> None:
    assert initial_placement(NODES, 2, 2) == ["node-0", "node-1"]
    assert initial_placement(NODES, 4, 1) == ["node-0", "node-0", "node-1", "node-1"]
    assert initial_placement(NODES, 5, 2) is None
    cordoned = [NodeCapacity("node-0", 2, schedulable=False), *NODES[1:]]
    assert initial_placement(cordoned, 2, 2) == ["node-1", "node-2"]


def test_a_partial_move_goes_to_standby_nodes_never_back_to_its_own() -> None:
    pods = {0: "node-0", 1: "node-1"}
    assert move(NODES, pods, [1], isolating=["node-1"], chips_per_pod=2) == {1: "node-2"}
    # a migration: its node is not isolated, and still not reused
    assert move(NODES, pods, [1], isolating=[], chips_per_pod=2) == {1: "node-2"}


def test_a_whole_job_rebuild_uses_every_node_but_the_isolated_one() -> None:
    pods = {0: "node-0", 1: "node-1"}
    assert move(NODES, pods, [0, 1], isolating=["node-1"], chips_per_pod=2) == {
        0: "node-0",
        1: "node-2",
    }


def test_pods_that_find_no_room_are_left_out() -> None:
    pods = {0: "node-0", 1: "node-1", 2: "node-2", 3: "node-3"}
    assert move(NODES, pods, [3], isolating=["node-3"], chips_per_pod=2) == {}


def test_standby_nodes_are_free_schedulable_nodes_with_chips() -> None:
    nodes = [*NODES, NodeCapacity("small", 1), NodeCapacity("cordoned", 2, schedulable=False)]
    assert free_nodes(nodes, {"node-0", "node-1"}, 2) == ["node-2", "node-3"]
