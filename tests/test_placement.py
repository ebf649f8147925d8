"""Where pods go (policy.placement, pure): in the cluster's order, with chips for them."""

from __future__ import annotations

from relaunch.faults import Fault, FaultKind
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


def test_the_decision_names_where_each_rebuilt_pod_goes() -> None:
    """The policy returns the target nodes (issue 31): a lost node's pod to a standby node
    (pod-level), every pod anywhere but the isolated node (job-level), no target for a level
    that rebuilds no container, nor a job that fails for want of a node."""
    from relaunch.policy import Action, decide
    from tests.builders import MODELARTS_ALL, cluster, history, node_lost, settings

    view = cluster(2, standby=2, nodes=tuple(NODES), chips_per_pod=2)
    pod_level = decide(settings(MODELARTS_ALL), node_lost("node-1"), history(), view, 0.0)
    assert pod_level.action is Action.POD_RESCHEDULE
    assert pod_level.targets == ((1, "node-2"),)
    job_level = decide(
        settings({"fault-tolerance/job-retry-num": "3"}), node_lost("node-1"), history(), view, 0.0
    )
    assert job_level.action is Action.ISOLATED_JOB_RESCHEDULE
    assert job_level.targets == ((0, "node-0"), (1, "node-2"))
    full = cluster(2, standby=0, nodes=tuple(NODES[:2]), chips_per_pod=2)
    no_room = decide(settings(MODELARTS_ALL), node_lost("node-1"), history(), full, 0.0)
    assert no_room.action is Action.FAIL and no_room.targets == ()
    hang_level = decide(settings(MODELARTS_ALL), Fault(FaultKind.HANG, 0.0), history(), view, 0.0)
    assert hang_level.action is Action.HANG_RESTART and hang_level.targets == ()
