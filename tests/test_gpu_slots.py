"""The bookkeeping of cuda_ipc (who holds a block of device memory another process
allocated), which is host memory and NumPy only: tested here, without a GPU, with real
processes, a real SIGKILL and real races. The device side is tested in tests/gpu."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import procspawn
from procspawn import sharing
from procspawn.sharing.cuda import _slots
from procspawn.sharing.wire import _handles


class Memory:
    """Stands for what keeps a block's device memory (CuPy's chunk object)."""


@pytest.fixture(autouse=True)
def fresh_slots():
    """Each test starts with no blocks and no slabs of its own."""
    _slots.reset()
    yield
    _slots.reset()
    gc.collect()


def _send(allocation, memory):
    with _slots.lock():
        block = _slots.keep(allocation, memory)
        slab, index = _slots.take(block)
    return block, slab, index


def _hold_then(slab, index, then, inbox=None, outbox=None):
    """In a child: hold the slot, then free it, exit holding it, or wait to be killed."""
    _slots.hold(slab, index)
    if then == "free":
        _slots.free(slab, index)
        return os.getpid()
    if then == "exit":
        os._exit(0)
    outbox.put(os.getpid())
    inbox.get(timeout=60)  # never comes: killed


def _hold_then_free(rank, slab, index):
    return _hold_then(slab, index, "free")


def _take_many(rank, slab, count):
    return [_slots.take(7, slab)[1] for _ in range(count)]


def test_a_block_stays_while_its_slot_is_held_and_goes_once_freed():
    memory = Memory()
    gone = weakref.ref(memory)
    block, slab, index = _send("allocation-a", memory)
    del memory
    assert _slots.view(slab)[index, _slots.STATE] == _slots.SENT
    assert _slots.sweep() == 0 and gone() is not None  # in flight: kept
    pids = procspawn.spawn(_hold_then_free, args=(slab, index), nprocs=1, timeout=60)
    assert _slots.view(slab)[index, _slots.STATE] == _slots.FREE and pids
    assert _slots.sweep() == 1
    assert gone() is None  # the producer let go: its memory may be reused


def test_a_holder_sigkilled_gives_its_hold_back_at_the_next_sweep():
    memory = Memory()
    gone = weakref.ref(memory)
    block, slab, index = _send("allocation-b", memory)
    del memory
    inbox, outbox = procspawn.Queue(), procspawn.Queue()
    p = procspawn.Process(target=_hold_then, args=(slab, index, "wait", inbox, outbox))
    p.start()
    try:
        holder = outbox.get(timeout=60)
        slots = _slots.view(slab)
        assert slots[index, _slots.STATE] == _slots.HELD and slots[index, _slots.PID] == holder
        assert _slots.sweep() == 0 and gone() is not None
        os.kill(holder, signal.SIGKILL)
        p.join(timeout=30)
        assert p.exitcode == -signal.SIGKILL
        assert _slots.sweep() == 1 and gone() is None
        assert slots[index, _slots.STATE] == _slots.FREE
    finally:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def test_a_holder_that_exits_without_letting_go_gives_its_hold_back_too():
    block, slab, index = _send("allocation-c", Memory())
    p = procspawn.Process(target=_hold_then, args=(slab, index, "exit"))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0
    assert _slots.view(slab)[index, _slots.STATE] == _slots.HELD
    assert _slots.sweep() == 1


def test_a_pid_reused_by_another_process_is_not_taken_for_the_holder():
    block, slab, index = _send("allocation-d", Memory())
    slots = _slots.view(slab)
    # a live pid (this one) with another start time: the holder is dead, its pid reused
    slots[index, _slots.PID] = os.getpid()
    slots[index, _slots.TICKS] = _slots.identity()[1] + 12345
    slots[index, _slots.STATE] = _slots.HELD
    assert _slots.sweep() == 1
    # and the real holder (pid and start time) keeps it
    block, slab, index = _send("allocation-d", Memory())
    _slots.hold(slab, index)
    assert _slots.sweep() == 0
    _slots.free(slab, index)
    assert _slots.sweep() == 1


def test_processes_taking_slots_in_one_slab_at_once_never_take_the_same():
    block, slab, index = _send("allocation-e", Memory())
    taken = procspawn.spawn(_take_many, args=(slab, 300), nprocs=4, timeout=120)
    every = [i for rank in taken for i in rank] + [index]
    assert len(every) == len(set(every)) == 1201
    assert (_slots.view(slab)[:, _slots.STATE] != _slots.FREE).sum() == 1201


def test_a_full_slab_is_followed_by_another_and_a_forwarder_is_told_no():
    memory = Memory()
    with _slots.lock():
        block = _slots.keep("allocation-f", memory)
        places = [_slots.take(block) for _ in range(_slots.SLOTS + 1)]
    slabs = {id(slab) for slab, _ in places}
    assert len(slabs) == 2  # the 4097th slot is in a new slab
    assert _slots.take(block, places[0][0]) is None  # full: a forwarder copies instead
    assert _slots.counts() == {"sent": _slots.SLOTS + 1, "held": 0, "blocks": 1}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["send", "hold", "free", "sweep"]), st.integers(0, 5)),
        max_size=40,
    )
)
def test_after_any_sequence_a_block_is_kept_exactly_while_a_slot_names_it(steps):
    _slots.reset()
    memories = {n: Memory() for n in range(6)}
    refs = {n: weakref.ref(m) for n, m in memories.items()}
    slots_of: dict[int, list] = {n: [] for n in range(6)}
    for action, n in steps:
        if action == "send":
            block, slab, index = _send(f"allocation-{n}", memories[n])
            slots_of[n].append((slab, index))
        elif action == "hold" and slots_of[n]:
            _slots.hold(*slots_of[n][-1])
        elif action == "free" and slots_of[n]:
            _slots.free(*slots_of[n].pop(0))
        elif action == "sweep":
            _slots.sweep()
    memories.clear()
    _slots.sweep()
    for n in range(6):
        named = any(
            _slots.view(slab)[index, _slots.STATE] != _slots.FREE for slab, index in slots_of[n]
        )
        assert (refs[n]() is not None) == named, n


def test_a_sweeper_thread_runs_while_blocks_are_kept_and_then_ends():
    memory = Memory()
    gone = weakref.ref(memory)
    block, slab, index = _send("allocation-g", memory)
    del memory
    assert _slots._sweeper is not None and _slots._sweeper.is_alive()
    _slots.free(slab, index)
    deadline = time.monotonic() + 5
    while gone() is not None or _slots._sweeper is not None:
        assert time.monotonic() < deadline, "the sweeper did not let go within 5 s"
        time.sleep(0.05)
    assert np.count_nonzero(_slots.view(slab)[:, _slots.STATE]) == 0


class _Nesting(sharing.SharingStrategy):
    """A strategy whose handle names a second segment, as cuda_ipc's names its slot slab:
    its rebuild rebuilds that one too, inside the first's."""

    def allocate(self, nbytes):
        fd = os.memfd_create("nesting", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, 1))
        st = os.fstat(fd)
        segment = sharing.Segment.map(
            fd, nbytes, strategy=self.name, key=(st.st_dev, st.st_ino), keep_fd=True
        )
        _companions[segment.key] = _slots.new_slab()
        return segment

    def reduce(self, segment):
        companion = _companions[segment.key]
        nested = _handles.segment_handle(companion)
        return (sharing.attach_fd(segment.fd, segment), segment.size, segment.key, nested)

    def rebuild(self, handle):
        index, size, key, nested = handle
        _companions[key] = _handles.segment_from_handle(nested)
        fd = os.dup(sharing.received_fd(index))
        return sharing.Segment.map(fd, size, strategy=self.name, key=key, keep_fd=True)


_companions: dict = {}


def _read_both(rank, array):
    companion = _companions[next(iter(_companions))]
    return float(array[3]), int(_slots.view(companion)[5, _slots.BLOCK])


def test_a_handle_that_names_another_segment_is_rebuilt_without_deadlock():
    sharing.register_strategy("nesting-test", _Nesting())
    previous = procspawn.get_sharing_strategy()
    procspawn.set_sharing_strategy("nesting-test")
    try:
        array = sharing.zeros(1 << 18)
    finally:
        procspawn.set_sharing_strategy(previous)
    array[3] = 7.0
    companion = next(iter(_companions.values()))
    _slots.view(companion)[5, _slots.BLOCK] = 11
    # before the map cache's lock was reentrant, the nested rebuild waited for ever
    assert procspawn.spawn(_read_both, args=(array,), nprocs=1, timeout=60) == [(7.0, 11)]
    del array, companion
    _companions.clear()
