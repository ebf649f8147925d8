"""Restores from a peer's memory against storage, and both against the raw link and disk they run
on (issue 48), on the embedded cluster's real data link between two node namespaces.

Every part is a process of its own in its node's namespace (relaunch_bench.peer_memory_worker),
as in a job: node-1's keeper (an agent's peer memory), the rank on node-0 that saves (to storage,
and its copy into node-1's memory), and for each restore a fresh rank on node-0 that loads the
step, timed from `load()` to its return: from node-1's memory (fetched over the data link,
checked against the manifest, loaded), then from node-0's own disk (relaunch.train.local's copy)
and from storage, each with the page cache dropped (the files' pages evicted, and the machine's
caches dropped where we may). On one machine the node's disk and storage are the same disk; so
storage is also read as a cluster reads it, from a file server on a node of its own over node-0's
data link (relaunch_bench.file_server: sshd, mounted by sshfs), where this machine has one.
Beside them, the link's raw speed (one process's memory into another's over the same link, plain
TCP, into memory already faulted in, taken in turn with the restore from peer memory, three pairs
a round, one in `--quick`; and, from the same transfers, the link into fresh memory as a restore
receives, and what faulting fresh memory in costs on this machine: see `receive`), the disk's
(a cold sequential read of the same size) and the shared storage's (a cold sequential read of the
step's file through the mount). And the loop's stall in an asynchronous save with and without the
copy (it is sent after the write, from a thread of its own), and, up to 1 GB, two ranks
restoring at once from node-1's keeper, as a lost node's pod does (`_together`). And the copy
into a keeper whose job's budget is full, received into the memory of the step it replaces,
beside the same copy into fresh memory (`copy-again`, to a keeper of its own with room for one
step).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from relaunch.cluster.local import kill_tree
from relaunch.cluster.network import ClusterNetwork
from relaunch_bench import file_server
from relaunch_bench.checkpoint import _drop_cache, _raw
from relaunch_bench.jobs import Progress
from relaunch_bench.peer_runs import peer_environment, peer_python

DLROVER_FLASH = Path(__file__).parent / "workloads" / "dlrover_flash.py"
SHM = Path("/dev/shm")
DLROVER_SHM = "*_ckpt_shm_*"
"""The shared memory DLRover's flash checkpoint keeps the state in, one segment a rank."""

SIZES_MB = (256, 1024, 4096)
LINK_PAIRS = 3
"""Pairs of the link's raw transfer and a restore from peer memory, a round (in turn); one in
`--quick` (each pair starts four workers, each importing torch: 8 s of the suite's bench)."""
STALL_PAIRS_PER_LINK_PAIR = 7
"""Pairs of saves the stall is measured in, for each pair of the link's measure: 21 a round, 7 in
`--quick` (each save is written back before the next: 44 of them took 7 s of the suite's bench)."""
ONE_REPEAT_FROM_MB = 4096
"""From this size on, one repeat: a round of 4 GB takes about 8 minutes on two cores."""
WRITTEN_PER_ROUND = 5
"""A round writes the state about this many times over (the step on storage, the node's copy,
the stall's saves, DLRover's checkpoint, and room to spare); each round's files go before the
next round. A disk that fills under DLRover's save left its run waiting for 30 minutes."""
TOGETHER = 2
"""Ranks of a pod that restore at once from one keeper (a lost node's pod, all its ranks fresh)."""
TOGETHER_UP_TO_MB = 1024
"""Restores at once are measured up to this size (each rank holds its model and the copy's
memory: two ranks of 4 GB and the keeper's copy are 20 GB, more than this machine's memory)."""
STALL_UP_TO_MB = 1024
"""The stall is measured up to this size (an asynchronous save keeps a host copy of the state)."""
NODES = ("node-0", "node-1")
STORAGE_NODE = "storage"
"""The node the shared storage's file server runs on (relaunch_bench.file_server)."""
WORKER = "relaunch_bench.peer_memory_worker"


def peer_memory_rows(
    sizes: tuple[int, ...], repeats: int, out: Path, say: Progress, pairs: int = LINK_PAIRS
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="relaunch-peer-memory-", dir=out) as tmp:
        network = ClusterNetwork.open(Path(tmp) / "state")
        if isinstance(network, str):
            return [{"error": f"no data link to measure on: {network}"}]
        try:
            for node in NODES:
                network.ensure_node(node)
            with _shared_storage(network, Path(tmp) / "file-server") as server:
                return [_size(network, server, Path(tmp), mb, repeats, pairs, say) for mb in sizes]
        finally:
            network.remove()


@contextlib.contextmanager
def _shared_storage(network: ClusterNetwork, scratch: Path) -> Any:
    """The storage node's file server (relaunch_bench.file_server), or why there is none."""
    why = file_server.unavailable()
    if why is not None:
        yield why
        return
    network.ensure_node(STORAGE_NODE)
    namespace = network.layout.namespace(STORAGE_NODE)
    with file_server.file_server(
        namespace, network.layout.data_address(STORAGE_NODE), scratch
    ) as server:
        yield server


def _size(
    network: ClusterNetwork,
    server: file_server.FileServer | str,
    tmp: Path,
    mb: int,
    repeats: int,
    pairs: int,
    say: Progress,
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}
    ratios: list[float] = []  # every pair's stall with the copy over without, all repeats
    link_ratios: list[float] = []  # every pair's restore speed over the link's, all repeats
    repeats = 1 if mb >= ONE_REPEAT_FROM_MB else repeats
    for repeat in range(repeats):
        free, need = shutil.disk_usage(tmp).free, WRITTEN_PER_ROUND * (mb << 20)
        if free < need:
            why = f"needs {need / 1e9:.1f} GB free under {tmp}, {free / 1e9:.1f} GB is"
            say(f"peer memory: {mb} MB not measured: it {why}")
            return {"size_mb": mb, "error": f"not measured: it {why}"}
        say(f"peer memory: {mb} MB, repeat {repeat + 1}/{repeats}")
        directory = tmp / f"r{mb}-{repeat}"
        try:
            timings = _round(network, server, directory, mb, pairs)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        ratios += timings.pop("stall_ratios", [])
        link_ratios += timings.pop("link_ratios")
        for key, value in timings.items():
            samples.setdefault(key, []).append(value)
    return _size_row(mb, repeats, samples, ratios, link_ratios, server)


def _size_row(
    mb: int,
    repeats: int,
    samples: dict[str, list[float]],
    ratios: list[float],
    link_ratios: list[float],
    server: file_server.FileServer | str,
) -> dict[str, Any]:
    """One size's row: each timing's median (seconds and MB/s) and the ratios between them."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    size = mb << 20
    row: dict[str, Any] = {"size_mb": mb, "repeats": repeats}
    for key in (
        "link", "link_fresh", "fault_in", "disk_read", "peer_restore", "peer_restore_late",
        "local_restore",
        "storage_restore", "shared_read", "shared_restore", "save", "copy", "local_copy",
        "copy_fresh", "copy_again",
    ):  # fmt: skip
        if key in med:
            row[f"{key}_s"] = round(med[key], 4)
            row[f"{key}_mb_s"] = round(size / 1e6 / med[key], 1)
    row["peer_over_link"] = round(med["link"] / med["peer_restore"], 3)
    row["late_over_link"] = round(med["link"] / med["peer_restore_late"], 3)
    row["ready_share"] = round(med["ready_share"], 3)
    row["again_over_fresh"] = round(med["copy_fresh"] / med["copy_again"], 2)  # how much faster
    if "together" in med:  # the ranks' bytes together over their wall time, against one alone
        row["together_ranks"] = TOGETHER
        row["together_s"] = round(med["together"], 4)
        row["together_mb_s"] = round(TOGETHER * size / 1e6 / med["together"], 1)
        row["together_over_alone"] = round(TOGETHER * med["peer_restore"] / med["together"], 3)
        row["together_over_link"] = round(TOGETHER * med["link"] / med["together"], 3)
    row.update(_paired("link", link_ratios))
    row["storage_over_peer"] = round(med["storage_restore"] / med["peer_restore"], 2)
    if "shared_restore" in med:
        row["shared_over_peer"] = round(med["shared_restore"] / med["peer_restore"], 2)
    else:
        row["shared_storage"] = server
    for key in ("dlrover_save_stall", "dlrover_restore"):
        if key in med:
            row[f"{key}_s"] = round(med[key], 5)
    if "stall_plain" in med:
        row["stall_plain_s"] = round(med["stall_plain"], 5)
        row["stall_copy_s"] = round(med["stall_copy"], 5)
    if ratios:
        row.update(_paired("stall", ratios))
        row["stall_copy_over_plain"] = row.pop("stall_ratio")
    return row


def _paired(name: str, ratios: list[float]) -> dict[str, Any]:
    """The pairs' count, their ratios' median and its 95 % interval (None: too few pairs)."""
    interval = median_interval(ratios)
    return {
        f"{name}_pairs": len(ratios),
        f"{name}_ratio": round(statistics.median(ratios), 3),
        f"{name}_ratio_95": [round(x, 3) for x in interval] if interval else None,
    }


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values`: the order statistics
    x(k) and x(n+1-k) for the largest k whose coverage, from the binomial distribution of how
    many values fall below the median, is at least `level`; None for too few values."""
    n, ordered = len(values), sorted(values)
    below, k = 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(at most k values below the median)
        if 1 - 2 * below < level:
            break
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def _round(
    network: ClusterNetwork,
    server: file_server.FileServer | str,
    directory: Path,
    mb: int,
    pairs: int,
) -> dict[str, Any]:
    directory.mkdir(parents=True)
    size = mb << 20
    raw = bytearray(size)
    timings: dict[str, Any] = {"disk_read": _raw(directory, raw)[1]}  # type: ignore[arg-type]
    del raw
    host = network.layout.data_address("node-1")
    with _started(network, "node-1", "keeper", host) as (_, said):
        peer = f"{host}:{said['port']}"
        stall = [f"stall={STALL_PAIRS_PER_LINK_PAIR * pairs}"] if mb <= STALL_UP_TO_MB else []
        saved = _worker(network, "node-0", "save", str(directory), str(mb), peer, *stall)
        timings.update({k.removesuffix("_s"): v for k, v in saved.items()})
        timings.update(_link_and_restore(network, directory, peer, mb, pairs))
        if mb <= TOGETHER_UP_TO_MB:
            timings.update(_together(network, directory, peer, mb))
    for tier, served in (("local", "local disk of node-0"), ("storage", "storage")):
        _drop_caches(directory)
        restored = _worker(network, "node-0", "restore", str(directory), tier, str(mb))
        assert restored["tier"] == served, restored
        timings[f"{tier}_restore"] = restored["seconds"]
    if isinstance(server, file_server.FileServer):
        timings.update(_shared(network, server, directory, mb))
    timings.update(_dlrover(directory / "dlrover", mb))
    # last: its keeper's memory, freed as it ends, is not what the restores' memory meets
    with _started(network, "node-1", "keeper", host) as (_, again):  # room for one step
        peer = f"{host}:{again['port']}"
        copied = _worker(network, "node-0", "copy-again", str(directory), str(mb), peer)
    timings.update({k.removesuffix("_s"): v for k, v in copied.items()})
    return timings


def _shared(
    network: ClusterNetwork, server: file_server.FileServer, directory: Path, mb: int
) -> dict[str, float]:
    """Node-0 reads the step from the storage node over its data link, cold on both ends: the
    file raw, then a fresh rank's restore (relaunch_bench.file_server)."""
    login = (server.address, str(server.key), str(directory))
    _drop_caches(directory)
    read = _worker(network, "node-0", "shared-read", *login)
    _drop_caches(directory)
    restored = _worker(network, "node-0", "shared-restore", *login, str(mb))
    assert restored["tier"] == "storage", restored
    return {"shared_read": read["seconds"], "shared_restore": restored["seconds"]}


def _dlrover(directory: Path, mb: int) -> dict[str, float]:
    """DLRover's flash checkpoint of the same state (workloads/dlrover_flash.py): the stall of its
    save to shared memory, and the restore from that memory after dlrover-run restarted the
    worker on the same node. Nothing where DLRover is not installed (`make peers`)."""
    python = peer_python("dlrover")
    if isinstance(python, str):
        return {}
    directory.mkdir(parents=True)
    out = directory / "out.jsonl"
    args = [
        str(python.parent / "dlrover-run"), "--standalone", "--nproc_per_node", "1",
        "--max_restarts", "1", "--monitor_interval", "0.1", str(DLROVER_FLASH),
        "--mb", str(mb), "--dir", str(directory / "ckpt"), "--out", str(out),
    ]  # fmt: skip
    shm = set(SHM.glob(DLROVER_SHM))
    with open(directory / "dlrover.log", "w") as log, _removing_new(shm):
        agent = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=peer_environment(python.parent),
            cwd=directory, start_new_session=True,
        )  # fmt: skip
        try:
            agent.wait(timeout=1800)
        finally:
            kill_tree(agent.pid)
            agent.wait()
    said: dict[str, float] = {}
    for line in out.read_text().splitlines() if out.exists() else []:
        said.update(json.loads(line))
    if "memory_restore_s" not in said:
        return {}
    return {
        "dlrover_save_stall": said["memory_save_stall_s"],
        "dlrover_restore": said["memory_restore_s"],
    }


@contextlib.contextmanager
def _removing_new(before: set[Path]) -> Any:
    """DLRover's shared memory, removed once its run ended: its agent leaves the segment in
    /dev/shm when it exits (4 GB a run of that size), and a few runs took the machine's memory
    (a later round's keeper was killed for it)."""
    try:
        yield
    finally:
        for path in set(SHM.glob(DLROVER_SHM)) - before:
            with contextlib.suppress(OSError):
                path.unlink()


def _drop_caches(directory: Path) -> None:
    """The shards' pages out of the page cache; with root, every clean page of the machine."""
    for shard in (*directory.glob("ckpt/step-*/rank-*.ckpt"), *directory.glob("local/**/*.ckpt")):
        _drop_cache(shard)
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as caches:
        caches.write("1\n")


def _link_and_restore(
    network: ClusterNetwork, directory: Path, peer: str, mb: int, pairs: int
) -> dict[str, Any]:
    """The link's raw speed and a fresh rank's restore from peer memory, taken in turn
    (`pairs` pairs, the order swapped every pair), so that both meet the machine in the
    same state: each a median, and every pair's restore speed over the link's. (Until run 11 the
    link was measured once, at the round's start: single timings of either moved 2 to 4 times
    from run to run, so that the ratio said more of when each was taken than of the restore.)"""
    links: list[dict[str, float]] = []
    restores: dict[str, list[dict[str, Any]]] = {"ready": [], "late": []}
    for pair in range(pairs):
        for kind in ("link", "ready", "late") if pair % 2 == 0 else ("late", "ready", "link"):
            if kind == "link":
                links.append(_link(network, mb << 20))
                continue
            late = ["late"] if kind == "late" else []
            restored = _worker(network, "node-0", "restore", str(directory), peer, str(mb), *late)
            assert restored["tier"] == "peer memory of node-1", restored
            restores[kind].append(restored)
    ready = [float(r["seconds"]) for r in restores["ready"]]
    return {
        "link": statistics.median(link["alone_seconds"] for link in links),
        "link_fresh": statistics.median(link["fresh_seconds"] for link in links),
        "fault_in": statistics.median(link["fault_in_seconds"] for link in links),
        "peer_restore": statistics.median(ready),
        "ready_share": statistics.median(float(r["ready_share"]) for r in restores["ready"]),
        "peer_restore_late": statistics.median(float(r["seconds"]) for r in restores["late"]),
        "link_ratios": [
            link["alone_seconds"] / restore for link, restore in zip(links, ready, strict=True)
        ],
    }


def _together(network: ClusterNetwork, directory: Path, peer: str, mb: int) -> dict[str, float]:
    """`TOGETHER` fresh ranks on node-0 restoring the step at once from node-1's keeper, as the
    ranks of a pod moved off a lost node do (here each the same copy, the keeper's memory read
    by each): each made ready as a rank alone is, then all told to load at the same moment. The
    wall time from the first load's start to the last one's end."""
    args = ("restore", str(directory), peer, str(mb), "together")
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(_started(network, "node-0", *args)) for _ in range(TOGETHER)]
        for proc, _ in ranks:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        # each rank's last line: it says which tier served it on a line of its own before it
        said = [json.loads(proc.stdout.read().strip().splitlines()[-1]) for proc, _ in ranks]
    assert all(s["tier"] == "peer memory of node-1" for s in said), said
    return {"together": max(s["ended"] for s in said) - min(s["began"] for s in said)}


def _link(network: ClusterNetwork, size: int) -> dict[str, float]:
    """The link's raw transfers (relaunch_bench.peer_memory_worker.receive): into fresh memory
    as a restore receives, then the link alone, into memory already faulted in; and the faulting
    in of fresh memory. The link alone is the link's raw speed: on this VM fresh memory faults
    in at 0.5 to 12 GB/s, by whether its host took the pages back (docs/benchmark-history.md, runs 14-15)."""
    host = network.layout.data_address("node-1")
    with _started(network, "node-1", "send", host, str(size)) as (_, said):
        received = _worker(network, "node-0", "receive", host, str(said["port"]), str(size))
    return {k: float(received[k]) for k in ("fresh_seconds", "alone_seconds", "fault_in_seconds")}


def _command(network: ClusterNetwork, node: str, *args: str) -> list[str]:
    namespace = network.layout.namespace(node)
    return ["ip", "netns", "exec", namespace, sys.executable, "-m", WORKER, *args]


def _worker(network: ClusterNetwork, node: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        _command(network, node, *args), capture_output=True, text=True, timeout=1800, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:1])} on {node} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@contextlib.contextmanager
def _started(network: ClusterNetwork, node: str, *args: str) -> Any:
    """A worker that serves until we are done with it; yields it and its first line."""
    proc = subprocess.Popen(
        _command(network, node, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[0]} on {node} ended before its first line")
        yield proc, json.loads(line)
    finally:
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
