"""A node's peer memory used again: a copy on its way is received into the memory of the oldest
step it replaces (pages already faulted in), the job's copies stay within its budget while they
arrive, and no memory ever holds two copies at once, nor one being read and one arriving.
The keeper itself (relaunch.cluster.keeper); real sockets where a transfer is part of the
promise."""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaunch.cluster.keeper import PeerMemory, PeerMemoryServer, StoredCopy
from relaunch.protocol.peer_memory import read_header, receive_into, send_header

JOB = "7"
PAGE = mmap.PAGESIZE
SIZE = 3 * PAGE + 5
"""A copy's size: not a whole number of pages, as a shard's never is."""


def arrive(
    memory: PeerMemory, step: int, rank: int = 0, size: int = SIZE, budget: int = 4 * SIZE
) -> tuple[memoryview, str | None]:
    """A copy received as the keeper receives one: its memory, then kept (or refused)."""
    data = memory.memory_for(JOB, step, size, budget)
    data[:] = bytes([step % 256]) * size
    manifest = {"files": {f"rank-{rank}.ckpt": {"size": size, "xxh3_128": f"h{step}"}}}
    error = memory.put(StoredCopy(JOB, rank, step, manifest, data), budget)
    if error is not None:
        memory.give_back(data, budget)
    return data, error


def held(memory: PeerMemory) -> list[tuple[int, int]]:
    return [(rank, step) for rank, step, _, _ in memory.index(JOB)]


def pages_of(data: Any) -> int:
    """Which memory `data` lies in (the same for two views of one mapping)."""
    return id(data.obj if isinstance(data, memoryview) else data)


def test_a_copy_on_its_way_is_received_into_the_memory_of_the_oldest_step_it_replaces() -> None:
    """Two ranks' copies of two steps fill the job's budget; each rank's copy of the next step
    drops the oldest step as it starts and lands in that step's memory: the dropped step is gone
    before the new one has arrived, the job's bytes here never pass the budget, and each rank's
    copy gets memory of its own."""
    memory = PeerMemory()
    first = {rank: pages_of(arrive(memory, 10, rank)[0]) for rank in (0, 1)}
    for rank in (0, 1):
        assert arrive(memory, 20, rank)[1] is None
    on_its_way = memory.memory_for(JOB, 30, SIZE, 4 * SIZE)
    assert held(memory) == [(0, 20), (1, 20)]  # step 10 went as the copy began to arrive
    assert pages_of(on_its_way) in first.values()
    assert memory.used(JOB) == 4 * SIZE  # the other copy of step 10 kept as a spare
    memory.give_back(on_its_way, 4 * SIZE)
    again = {rank: pages_of(arrive(memory, 30, rank)[0]) for rank in (0, 1)}
    assert sorted(again.values()) == sorted(first.values())
    assert held(memory) == [(0, 20), (0, 30), (1, 20), (1, 30)]
    assert memory.used(JOB) == 4 * SIZE
    for rank, step in held(memory):
        found = memory.get(JOB, rank, step)
        assert found is not None and bytes(found.data) == bytes([step]) * SIZE


def test_a_copy_a_few_bytes_longer_fits_the_pages_and_one_a_page_longer_gets_fresh_memory() -> None:
    memory = PeerMemory()
    budget = 2 * (SIZE + PAGE)
    first = pages_of(arrive(memory, 10, size=SIZE, budget=budget)[0])
    arrive(memory, 20, size=SIZE, budget=budget)
    longer, _ = arrive(memory, 30, size=SIZE + 3, budget=budget)  # a step count one digit longer
    assert pages_of(longer) == first and len(longer) == SIZE + 3
    page_longer, _ = arrive(memory, 40, size=SIZE + PAGE, budget=budget)
    assert pages_of(page_longer) not in (first, pages_of(longer))
    assert held(memory) == [(0, 30), (0, 40)]
    assert memory.used(JOB) <= budget


def test_a_copy_being_read_is_never_received_into() -> None:
    """A restore reading step 10 while step 30 arrives: step 10 is dropped from the index, but
    its memory is not given to the arriving copy, and the reader's bytes stay step 10's."""
    memory = PeerMemory()
    arrive(memory, 10)
    read = memory.get(JOB, 0, 10)
    assert read is not None
    with memory.lent(JOB, 0, 10) as lent:
        assert lent is read
        arrive(memory, 20, budget=2 * SIZE)
        arriving, error = arrive(memory, 30, budget=2 * SIZE)
        assert error is None and pages_of(arriving) != pages_of(lent.data)
        assert bytes(lent.data) == bytes([10]) * SIZE
    assert held(memory) == [(0, 20), (0, 30)]
    fourth, _ = arrive(memory, 40, budget=2 * SIZE)  # step 20's memory, nobody reading it
    assert pages_of(fourth) not in (pages_of(read.data), pages_of(arriving))


def test_memory_of_a_copy_torn_on_its_way_is_a_spare_and_never_served() -> None:
    memory = PeerMemory()
    arrive(memory, 10, budget=2 * SIZE)
    arrive(memory, 20, budget=2 * SIZE)
    torn = memory.memory_for(JOB, 30, SIZE, 2 * SIZE)  # step 10 dropped for it
    torn[: SIZE // 2] = bytes([99]) * (SIZE // 2)  # half arrived, then the sender was lost
    memory.give_back(torn, 2 * SIZE)
    assert held(memory) == [(0, 20)] and memory.used(JOB) == 2 * SIZE
    again, error = arrive(memory, 30, budget=2 * SIZE)
    assert error is None and pages_of(again) == pages_of(torn)
    found = memory.get(JOB, 0, 30)
    assert found is not None and bytes(found.data) == bytes([30]) * SIZE


OPS = st.lists(
    st.tuples(
        st.sampled_from(["begin", "begin", "arrive", "arrive", "tear", "read", "done"]),
        st.integers(0, 1),  # rank
        st.integers(1, 5),  # step
        st.integers(0, 1),  # pages more than the base size (an uneven shard)
    ),
    min_size=4,
    max_size=40,
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(ops=OPS)
def test_no_memory_ever_holds_two_copies_and_the_kept_copies_stay_whole(
    ops: list[tuple[str, int, int, int]],
) -> None:
    """Copies of any ranks, steps and sizes beginning to arrive (several on their way at once,
    as a pod's ranks send them), arriving whole or torn, read and done being read, in any
    order: every kept copy's bytes are its own, no two copies kept, read or on their way share
    memory, a copy's bytes on their way are not written under, and the job's copies stay within
    its budget, its spare memory too whenever none is on its way."""
    memory = PeerMemory()
    budget = 3 * SIZE
    coming: list[tuple[StoredCopy, bytes]] = []
    reading: list[Any] = []
    expected: dict[tuple[int, int], bytes] = {}
    for op, rank, step, more in ops:
        size = SIZE + more * PAGE
        if op == "begin" or (op in ("arrive", "tear") and not coming):
            data = memory.memory_for(JOB, step, size, budget)
            content = os.urandom(size)
            data[:] = content
            manifest = {"files": {"r": {"size": size, "xxh3_128": ""}}}
            coming.append((StoredCopy(JOB, rank, step, manifest, data), content))
        if op in ("arrive", "tear"):
            copy, content = coming.pop(0)
            assert bytes(copy.data) == content  # nothing was received into it meanwhile
            if op == "tear" or memory.put(copy, budget) is not None:
                memory.give_back(copy.data, budget)  # type: ignore[arg-type]
            else:
                expected[(copy.rank, copy.step)] = content
        elif op == "read":
            lent = memory.lent(JOB, rank, step)
            found = lent.__enter__()
            if found is not None:
                reading.append((lent, found, bytes(found.data)))
        elif op == "done" and reading:
            lent, found, content = reading.pop(0)
            assert bytes(found.data) == content  # nothing arrived into it while it was read
            lent.__exit__(None, None, None)
        kept = [memory.get(JOB, r, s) for r, s in held(memory)]
        assert all(c is not None and bytes(c.data) == expected[(c.rank, c.step)] for c in kept)
        live = [pages_of(c.data) for c in kept if c is not None]
        read = {id(f): f for _, f, _ in reading if all(f is not c for c in kept)}  # one a copy
        live += [pages_of(f.data) for f in read.values()]
        live += [pages_of(c.data) for c, _ in coming]
        assert len(live) == len(set(live)), "two copies in one memory"
        assert sum(len(c.data) for c in kept if c is not None) <= budget
        if not coming:
            assert memory.used(JOB) <= budget  # its copies and its spare memory
    for copy, content in coming:
        assert bytes(copy.data) == content
    for _, found, content in reading:
        assert bytes(found.data) == content


@pytest.fixture
def keeper() -> Iterator[PeerMemoryServer]:
    server = PeerMemoryServer("127.0.0.1").start()
    yield server
    server.shutdown()
    server.server_close()


def put(server: PeerMemoryServer, step: int, data: bytes, budget: int) -> dict[str, Any]:
    with socket.create_connection(server.address) as sock:
        manifest = {"files": {"rank-0.ckpt": {"size": len(data), "xxh3_128": ""}}}
        header = {"op": "put", "job": JOB, "rank": 0, "step": step, "manifest": manifest}
        send_header(sock, {**header, "size": len(data), "budget": budget})
        sock.sendall(data)
        return read_header(sock)


def test_a_restore_reading_slowly_gets_its_step_whole_while_newer_copies_replace_it(
    keeper: PeerMemoryServer,
) -> None:
    """Over real sockets: a restore takes the first bytes of step 10's copy and stops reading,
    the keeper's send waiting on it, while steps 20 and 30 arrive with room for two steps (step
    10 is dropped for step 30). The restore then reads on, and gets step 10's bytes, every one
    (they were not received into); a restore of step 30 gets step 30's."""
    size = 16 << 20  # more than the sockets' buffers hold: the keeper is mid-send
    steps = {step: os.urandom(size) for step in (10, 20, 30)}
    assert put(keeper, 10, steps[10], 2 * size) == {"ok": True, "error": None}
    with socket.create_connection(keeper.address) as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        send_header(reader, {"op": "get", "job": JOB, "rank": 0, "step": 10})
        assert read_header(reader)["size"] == size
        first = bytearray(1 << 20)
        receive_into(reader, first)
        for step in (20, 30):
            assert put(keeper, step, steps[step], 2 * size) == {"ok": True, "error": None}
        assert [s for _, s, _, _ in keeper.memory.index(JOB)] == [20, 30]
        rest = bytearray(size - len(first))
        receive_into(reader, rest)
    assert hashlib.sha256(first + rest).digest() == hashlib.sha256(steps[10]).digest()
    with socket.create_connection(keeper.address) as sock:
        send_header(sock, {"op": "get", "job": JOB, "rank": 0, "step": 30})
        assert read_header(sock)["size"] == size
        got = bytearray(size)
        receive_into(sock, got)
    assert got == steps[30]


def test_copies_arriving_in_a_full_budget_land_in_the_dropped_steps_memory(
    keeper: PeerMemoryServer,
) -> None:
    """Over real sockets: with room for two steps, each copy after the second is received
    into the memory of the step it replaces, and each is kept whole."""
    size = 1 << 20
    memories = []
    for step in range(1, 6):
        data = os.urandom(size)
        assert put(keeper, step, data, 2 * size) == {"ok": True, "error": None}
        found = keeper.memory.get(JOB, 0, step)
        assert found is not None and bytes(found.data) == data
        memories.append(pages_of(found.data))
    assert len(set(memories)) == 2, memories  # steps 3, 4, 5 in steps 1, 2, 3's memory
    assert [s for _, s, _, _ in keeper.memory.index(JOB)] == [4, 5]


def test_a_keeper_serving_one_copy_to_many_readers_at_once_keeps_it_until_the_last_is_done(
    keeper: PeerMemoryServer,
) -> None:
    """Four restores of step 1 at once, each paused mid-copy, while steps 2 and 3 replace it:
    each gets step 1 whole."""
    size = 8 << 20
    one = os.urandom(size)
    assert put(keeper, 1, one, 2 * size)["ok"]
    readers = []
    for _ in range(4):
        reader = socket.create_connection(keeper.address)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        send_header(reader, {"op": "get", "job": JOB, "rank": 0, "step": 1})
        assert read_header(reader)["size"] == size
        readers.append(reader)
    for step in (2, 3):
        assert put(keeper, step, os.urandom(size), 2 * size)["ok"]
    got: dict[int, bytes] = {}

    def read(i: int, reader: socket.socket) -> None:
        with reader:
            data = bytearray(size)
            receive_into(reader, data)
            got[i] = bytes(data)

    threads = [threading.Thread(target=read, args=pair) for pair in enumerate(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(got) == [0, 1, 2, 3] and all(data == one for data in got.values())
