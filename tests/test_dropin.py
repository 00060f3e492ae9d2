"""`import procspawn as mp` behaves as `multiprocessing` does: the gaps CPython's own
multiprocessing tests found, one test each."""

from __future__ import annotations

import array
import gc
import multiprocessing
import os
import socket
import struct
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


# -- issue 10: method by method against the stdlib ---------------------------------------


@pytest.mark.parametrize("lib", [multiprocessing, mp], ids=["stdlib", "procspawn"])
def test_recv_bytes_checks_the_end_before_maxlength(lib):
    # a closed or write-only end is refused before the maxlength is looked at
    a, b = lib.Pipe(duplex=False)
    with a, b:
        with pytest.raises(OSError, match="connection is write-only"):
            b.recv_bytes(-1)
        a.close()
        with pytest.raises(OSError, match="handle is closed"):
            a.recv_bytes(-1)


@pytest.mark.parametrize("lib", [multiprocessing, mp], ids=["stdlib", "procspawn"])
def test_a_message_over_maxlength_leaves_the_end_unreadable(lib):
    a, b = lib.Pipe()
    with a, b:
        a.send_bytes(b"hello")
        with pytest.raises(OSError, match="bad message length"):
            b.recv_bytes(4)
        assert (b.closed, b.readable, b.writable) == (False, False, True)
        with pytest.raises(OSError, match="connection is write-only"):
            b.poll()
        b.send("still writable")
        assert a.recv() == "still writable"
    reader, writer = lib.Pipe(duplex=False)
    with reader, writer:
        writer.send_bytes(b"hello")
        with pytest.raises(OSError, match="bad message length"):
            reader.recv_bytes(4)
        assert reader.closed  # a read-only end has nothing left: it is closed


@pytest.mark.parametrize("lib", [multiprocessing, mp], ids=["stdlib", "procspawn"])
def test_end_of_file_in_the_middle_of_a_message_is_an_oserror(lib):
    # a writer that died mid-message: OSError, not the EOFError of a clean end
    a, b = lib.Pipe()
    with a, b:
        if lib is mp:
            a._sock.sendall(struct.pack("<4sQI", b"PSPN", 100, 0) + b"xx")
        else:
            os.write(a.fileno(), struct.pack("!i", 100) + b"xx")
        a.close()
        with pytest.raises(OSError, match="got end of file during message"):
            b.recv()
    c, d = lib.Pipe()
    with c, d:
        c.close()
        with pytest.raises(EOFError):
            d.recv()


def test_a_connection_has_the_stdlib_public_names(pipe):
    a, _ = pipe
    c, d = multiprocessing.Pipe()
    with c, d:
        assert {n for n in dir(a) if not n.startswith("_")} == {
            n for n in dir(c) if not n.startswith("_")
        }


def test_simple_queue_is_generic_as_the_stdlib_one():
    from multiprocessing.queues import SimpleQueue as StdSimpleQueue

    from procspawn.sharing.channels._queues import SimpleQueue

    assert SimpleQueue[int].__origin__ is SimpleQueue
    assert StdSimpleQueue[int].__origin__ is StdSimpleQueue


def _run_reads_args(self):
    # run() of a subclass that reads multiprocessing's private _args and _kwargs, as
    # some code does
    q, arr = self._args
    q.put((type(arr).__name__, sum(arr), self._kwargs))


# one such subclass per library and start method, at module level so a child finds it
_RUN_READS_ARGS = {}
for _lib in (multiprocessing, mp):
    for _method in multiprocessing.get_all_start_methods():
        _name = f"_RunReadsArgs_{_lib.__name__}_{_method}"
        _RUN_READS_ARGS[_lib, _method] = globals()[_name] = type(
            _name, (_lib.get_context(_method).Process,), {"run": _run_reads_args}
        )


@pytest.mark.parametrize("lib", [multiprocessing, mp], ids=["stdlib", "procspawn"])
def test_process_keeps_target_args_and_kwargs_as_the_stdlib_does(lib, start_method):
    ctx = lib.get_context(start_method)
    p = ctx.Process(target=_DummyCallable, args=[1, 2], kwargs={"k": 3})
    assert (p._target, p._args, p._kwargs) == (_DummyCallable, (1, 2), {"k": 3})
    with pytest.raises(TypeError):  # kwargs must be a mapping: None is refused
        ctx.Process(target=_DummyCallable, kwargs=None)
    # a subclass that overrides run() sees the same _args and _kwargs in the child
    q = ctx.Queue()
    p = _RUN_READS_ARGS[lib, start_method](args=(q, array.array("d", [1.0, 2.0])), kwargs={"k": 3})
    p.start()
    assert q.get(timeout=30) == ("array", 3.0, {"k": 3})
    p.join(30)
    assert p.exitcode == 0
    q.close()
    q.join_thread()


# -- issue 39: the start method a child reports -------------------------------------------


def _report_start_method(conn):
    conn.send(mp.get_start_method())
    try:
        mp.set_start_method("spawn")  # set in the child already, as the stdlib's is
    except RuntimeError:
        conn.send("set")
    else:
        conn.send("not set")
    conn.close()


def _child_reports(process_factory, pipe_factory):
    r, w = pipe_factory(duplex=False)
    p = process_factory(target=_report_start_method, args=(w,))
    p.start()
    w.close()
    try:
        assert r.poll(30), "the child sent nothing in 30 s"
        reported = r.recv()
        assert r.poll(30)
        return reported, r.recv()
    finally:
        r.close()
        p.join(30)
        assert p.exitcode == 0


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_child_reports_the_start_method_of_its_context(method):
    # CPython's TestStartMethod.test_context: the context's method, not the default
    ctx = mp.get_context(method)
    assert _child_reports(ctx.Process, ctx.Pipe) == (method, "set")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_default_process_reports_the_method_set_in_its_parent(method):
    # CPython's TestStartMethod.test_set_get: set_start_method(method, force=True), then
    # the default Process's child reports it
    before = mp.get_start_method()
    mp.set_start_method(method, force=True)
    try:
        assert _child_reports(mp.Process, mp.Pipe) == (method, "set")
    finally:
        mp.set_start_method(None, force=True)
    assert mp.get_start_method() == before
