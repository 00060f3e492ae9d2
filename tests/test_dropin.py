"""`import procspawn as mp` behaves as `multiprocessing` does: the gaps CPython's own
multiprocessing tests found, one test each."""

from __future__ import annotations

import array
import gc
import multiprocessing
import socket
import threading
import weakref

import pytest

import procspawn as mp

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pipe():
    a, b = mp.Pipe()
    yield a, b
    a.close()
    b.close()


def test_recv_bytes_into_fills_a_buffer_at_an_offset(pipe):
    a, b = pipe
    buf = bytearray(10)
    a.send_bytes(b"abc")
    assert b.recv_bytes_into(buf) == 3
    assert bytes(buf) == b"abc" + bytes(7)
    a.send_bytes(b"xyz")
    assert b.recv_bytes_into(buf, 5) == 3
    assert bytes(buf) == b"abc\0\0xyz\0\0"
    ints = array.array("i", [0] * 4)  # the offset is in bytes, whatever the item size
    a.send_bytes(array.array("i", [7, 8]))
    assert b.recv_bytes_into(ints, 8) == 8
    assert ints.tolist() == [0, 0, 7, 8]


def test_recv_bytes_into_a_short_buffer_raises_buffer_too_short_with_the_message(pipe):
    a, b = pipe
    a.send_bytes(b"0123456789")
    with pytest.raises(multiprocessing.BufferTooShort) as info:
        b.recv_bytes_into(bytearray(4))
    assert info.value.args[0] == b"0123456789"
    a.send_bytes(b"next")  # the stream stayed in step
    assert b.recv_bytes() == b"next"


@pytest.mark.parametrize("offset", [-1, 11])
def test_recv_bytes_into_refuses_a_bad_offset_before_reading(pipe, offset):
    a, b = pipe
    with pytest.raises(ValueError):
        b.recv_bytes_into(bytearray(10), offset)
    a.send_bytes(b"still there")
    assert b.recv_bytes() == b"still there"


@pytest.mark.parametrize(
    "offset, size, message",
    [
        (-1, None, "offset is negative"),
        (7, None, "buffer length < offset"),
        (0, -1, "size is negative"),
        (4, 3, "buffer length < offset \\+ size"),
    ],
)
def test_send_bytes_checks_its_bounds_as_the_stdlib_does(pipe, offset, size, message):
    a, b = pipe
    with pytest.raises(ValueError, match=message):
        a.send_bytes(b"abcdef", offset, size)
    # and the stdlib raises the same for the same call
    c, d = multiprocessing.Pipe()
    with c, d, pytest.raises(ValueError, match=message):
        c.send_bytes(b"abcdef", offset, size)


def test_send_bytes_sends_the_slice_asked_for(pipe):
    a, b = pipe
    a.send_bytes(b"abcdef", 2, 3)
    a.send_bytes(b"abcdef", 4)
    a.send_bytes(array.array("i", [1, 2, 3]), 4, 4)  # bytes, not items
    assert b.recv_bytes() == b"cde"
    assert b.recv_bytes() == b"ef"
    assert b.recv_bytes() == array.array("i", [2]).tobytes()


def test_recv_bytes_refuses_a_negative_maxlength(pipe):
    a, b = pipe
    with pytest.raises(ValueError, match="negative maxlength"):
        b.recv_bytes(-1)


def test_channels_stay_blocking_under_a_default_socket_timeout():
    # network code often calls socket.setdefaulttimeout(); procspawn's own sockets must
    # still block (a recv that waits longer than the default is not a TimeoutError)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(0.05)
    try:
        a, b = mp.Pipe()
        q = mp.Queue()
        timer = threading.Timer(0.3, lambda: (a.send("late"), q.put("later")))
        timer.start()
        assert b.recv() == "late"
        assert q.get() == "later"
        timer.join()
        a.close()
        b.close()
        q.close()
        q.join_thread()
    finally:
        socket.setdefaulttimeout(previous)


class _DummyCallable:
    def __call__(self, q, c):
        assert isinstance(c, _DummyCallable)
        q.put(5)


def test_a_started_process_lets_go_of_its_target(start_method):
    # CPython's test_lose_target_ref: after start() the parent keeps no reference to the
    # target or its arguments, so they can be collected
    ctx = mp.get_context(start_method)
    c = _DummyCallable()
    wr = weakref.ref(c)
    q = ctx.Queue()
    p = ctx.Process(target=c, args=(q, c))
    del c
    p.start()
    p.join(30)
    gc.collect()
    assert wr() is None
    assert q.get(timeout=30) == 5
    assert p.exitcode == 0
    q.close()
    q.join_thread()
