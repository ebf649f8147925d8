"""The store: nodes, jobs, pods, faults and recovery records, in SQLite (WAL).

Everything a controller needs to carry on after a restart lives here: the desired state of every
pod (node, generation, counters), the job's attempt, budgets spent (derived from the records),
which planned faults already fired, and the faults still waiting for a decision. The controller
writes a job's running state; the API and the CLI add jobs, stop requests, fault-plan entries and
node cordons.

Every thread gets its own SQLite connection (a server answers requests from a thread pool): a
transaction or a row id read on one thread can never be another thread's. The database file is
created readable by its owner only (it holds every job's spec and environment).
"""

from relaunch.store.records import EventTable, RecordTable
from relaunch.store.rows import (
    JobRow,
    JobStatus,
    NodeRow,
    NodeState,
    Outcome,
    PodRow,
    RecordRow,
    fault_from_json,
    fault_to_json,
)
from relaunch.store.tables import JOB_ID, JobTable, NodeTable

__all__ = [
    "JOB_ID",
    "JobRow",
    "JobStatus",
    "NodeRow",
    "NodeState",
    "Outcome",
    "PodRow",
    "RecordRow",
    "Store",
    "fault_from_json",
    "fault_to_json",
]


class Store(NodeTable, JobTable, RecordTable, EventTable):
    """The state directory's database: nodes, jobs, pods, faults, decisions waiting, records,
    fault-plan outcomes and events (see each table's module)."""
