"""CuPy arrays between processes, on a real GPU (skipped where there is none).

Each test has a deadline on every wait; the conftest's leak check looks from outside
(children, /dev/shm, descriptors, and device memory through cudaMemGetInfo) after each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _gpu_report import FIGURES

import procspawn
from procspawn.context.launch._cuda_guard import cuda_started

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy")
import _gpu_workers as w  # noqa: E402  (needs CuPy)

from procspawn.sharing import cuda  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _free() -> int:
    cupy.get_default_memory_pool().free_all_blocks()
    return cupy.cuda.runtime.memGetInfo()[0]


def _stop(*procs):
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
        assert p.exitcode is not None


def test_cuda_start_is_seen_and_the_fork_server_never_starts_it():
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            "import cupy, procspawn\n"
            "from procspawn.context.launch._cuda_guard import cuda_started\n"
            "before = cuda_started()\n"
            "cupy.zeros(1)\n"
            "print(before, cuda_started())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh.stdout.split() == ["False", "True"], fresh.stderr
    assert cuda_started()  # this process is the producer
    # a rank forked by procspawn's server starts without CUDA, though its parent runs it
    assert procspawn.spawn(w.cuda_running, nprocs=2, timeout=60) == [False, False]


def test_fork_after_cuda_started_is_refused_at_once_naming_the_way_out():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="forkserver"):
        procspawn.spawn(w.cuda_running, nprocs=2, start_method="fork", timeout=30)
    with pytest.raises(RuntimeError, match="start_method='fork'"):
        procspawn.Pool(2, context="fork")
    p = procspawn.get_context("fork").Process(target=w.sync)
    with pytest.raises(RuntimeError, match="spawn"):
        p.start()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_views_of_every_dtype_arrive_as_the_same_memory_and_writes_go_both_ways(start_method):
    dtypes = ["float32", "float64", "float16", "int8", "uint16", "int64", "complex64", "bool"]
    bases, views, expected = [], [], []
    for dtype in dtypes:
        base = cuda.zeros((40, 24), dtype)
        base[...] = cupy.arange(base.size).reshape(base.shape).astype(dtype)
        bases.append(base)
        # whole, strided at an offset, reversed (negative strides), Fortran-ordered
        views.append((base, base[3:, 5::2], base[::-1, ::-3], base.T))
        expected.append(tuple(v.get() for v in views[-1]))
        assert cuda.is_shared(base[3:, 5::2]) and not cuda.is_shared(cupy.zeros(3))
    w.sync()
    args = [(v, e, i + 1) for i, (v, e) in enumerate(zip(views, expected, strict=True))]
    results = procspawn.spawn(
        w.check_all, args=(args,), nprocs=1, start_method=start_method, timeout=90
    )[0]
    for i, (same, layouts, shared, back, fresh) in enumerate(results):
        dtype = dtypes[i]
        assert same == [True] * 4, dtype
        assert layouts == [(v.shape, v.strides, v.dtype.str) for v in views[i]], dtype
        assert shared == [True] * 4
        # the rank's write into the strided view is in the parent's memory
        host = bases[i].get()
        want = expected[i][0].copy()
        want[3:, 5::2] = np.asarray(i + 1).astype(dtype)
        assert (host == want).all(), dtype
        # the view sent back is the parent's own memory again, at the same place
        assert back.data.ptr == views[i][2].data.ptr and back.strides == views[i][2].strides
        assert fresh.device.id == bases[i].device.id
        assert float(fresh[-1]) == 99_999 * (2 + i)
    FIGURES[f"round_trip_{start_method}"] = "ok"


def _channels(kind):
    """(the child's inbox, its outbox, send, receive with a deadline) for one kind."""
    if kind == "pipe":
        mine, theirs = procspawn.Pipe()

        def recv():
            assert mine.poll(60), "no answer within 60 s"
            return mine.recv()

        return theirs, theirs, mine.send, recv
    if kind == "queue":
        inbox, outbox = procspawn.Queue(), procspawn.Queue()
        return inbox, outbox, inbox.put, lambda: outbox.get(timeout=60)
    inbox, outbox = procspawn.SimpleQueue(), procspawn.SimpleQueue()

    def recv_simple():
        deadline = time.monotonic() + 60
        while outbox.empty():
            assert time.monotonic() < deadline, "no answer within 60 s"
            time.sleep(0.005)
        return outbox.get()

    return inbox, outbox, inbox.put, recv_simple


@pytest.mark.parametrize("channel_kind", ["queue", "simple", "pipe"])
def test_a_consumer_s_in_place_writes_are_seen_and_the_producer_s_too(channel_kind):
    child_in, child_out, send, recv = _channels(channel_kind)
    p = procspawn.Process(target=w.echo_server, args=(channel_kind, child_in, child_out))
    p.start()
    try:
        array = cuda.zeros(1 << 20)  # 4 MiB
        array[...] = 2
        w.sync()
        send(array)
        assert recv() == 3.0 * (1 << 20)
        assert float(array[123]) == 3.0  # the consumer's write, in the producer's memory
        array[0] = 41
        w.sync()
        send("check")
        assert recv() == 41.0  # the producer's write, in the consumer's mapping
        send(None)
    finally:
        _stop(p)


def test_pool_and_executor_arguments_and_results():
    shared = cuda.zeros(8 * 1024)
    w.sync()
    parts = [shared[i * 1024 : (i + 1) * 1024] for i in range(8)]
    with procspawn.Pool(2) as pool:
        results = pool.starmap(w.add_and_return, [(part, i) for i, part in enumerate(parts)])
    assert all(float(r[-1]) == i for i, r in enumerate(results))
    assert all(isinstance(r, cupy.ndarray) and cuda.is_shared(r) for r in results)
    assert (shared.reshape(8, 1024).get() == np.arange(8)[:, None]).all()
    with procspawn.ProcessPoolExecutor(2) as executor:
        result = executor.submit(w.add_and_return, shared, 10).result(timeout=60)
    assert float(result[0]) == 10 and float(shared[1024]) == 11
    del results, result


def test_results_of_ranks_that_exited_stay_valid():
    nbytes = 64 << 20
    started = time.monotonic()
    results = procspawn.spawn(w.fill_result, args=(nbytes,), nprocs=8, timeout=120)
    FIGURES["eight_ranks_64MiB_results_s"] = round(time.monotonic() - started, 3)
    for rank, array in enumerate(results):
        assert array.nbytes == nbytes and cuda.is_shared(array)
        assert float(array.min()) == float(array.max()) == rank + 1
    results[3] += 1  # still writable after its maker exited
    assert float(results[3][-1]) == 5
    del results, array


def _kill_a_holder_of_1_gib(make, figure):
    """A consumer holds 1 GiB the producer made (and then dropped) and is SIGKILLed: the
    device memory must be back within 2 s, seen by cudaMemGetInfo here."""
    free_before = _free()
    inbox, outbox = procspawn.Queue(), procspawn.Queue()
    p = procspawn.Process(target=w.hold_and_report, args=(inbox, outbox))
    p.start()
    try:
        array = make(1 << 28)  # 1 GiB of float32
        inbox.put(array)
        assert outbox.get(timeout=60)[0] == "holding"
        assert float(array[0]) == 1  # the consumer's write
        del array  # the producer lets go first: the consumer alone holds it
        assert _free() < free_before - (900 << 20)  # still held, by the consumer
        os.kill(p.pid, signal.SIGKILL)
        killed = time.monotonic()
        while _free() < free_before - (64 << 20):
            assert time.monotonic() - killed < 2.0, "device memory not back within 2 s"
            time.sleep(0.01)
        FIGURES[figure] = round(time.monotonic() - killed, 3)
    finally:
        _stop(p)


def test_a_consumer_sigkilled_while_holding_1_gib_gives_it_back_within_2_s():
    _kill_a_holder_of_1_gib(cuda.zeros, "sigkill_1GiB_back_s")


def test_memory_a_producer_sent_stays_valid_after_it_exited():
    outbox = procspawn.Queue()
    p = procspawn.Process(target=w.make_and_exit, args=(outbox, 7, 64 << 20))
    p.start()
    array = outbox.get(timeout=60)
    _stop(p)
    assert p.exitcode == 0
    assert float(array.min()) == float(array.max()) == 7
    array += 1
    assert float(array[-1]) == 8
    del array


def _forward_and_come_home(make):
    """P -> A -> B -> P: A sends on what it got, B writes 9 and sends it back; the array
    that comes home is the producer's own memory, with B's writes."""
    q1, q2, q3 = procspawn.Queue(), procspawn.Queue(), procspawn.Queue()
    a = procspawn.Process(target=w.forward, args=(q1, q2))
    b = procspawn.Process(target=w.write_and_return, args=(q2, q3, 9.0))
    a.start()
    b.start()
    try:
        original = make(3 << 20)
        w.sync()
        q1.put(original[1:])
        back = q3.get(timeout=60)
        assert back.data.ptr == original[1:].data.ptr  # the producer's own memory
        assert float(original[0]) == 0 and float(original[1]) == 9 and float(original[-1]) == 9
    finally:
        _stop(a, b)


def test_forwarding_producer_to_a_to_b_and_back():
    _forward_and_come_home(cuda.zeros)


_SPIN = r"""
extern "C" __global__ void spin_write(float* out, long long n, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""


def test_a_kernel_s_writes_queued_before_the_send_are_seen_without_a_sync():
    kernel = cupy.RawKernel(_SPIN, "spin_write")
    clock_khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
    cycles = int(0.05 * clock_khz * 1000)  # about 50 ms
    inbox, outbox = procspawn.Queue(), procspawn.Queue()
    p = procspawn.Process(target=w.check_final, args=(inbox, outbox))
    p.start()
    try:
        array = cuda.zeros(1 << 16)
        w.sync()
        seen = []
        started = time.monotonic()
        for i in range(100):
            kernel(
                (256,), (256,), (array, np.int64(array.size), np.float32(i + 1), np.int64(cycles))
            )
            inbox.put((array, float(i + 1)))  # no sync: the send's event orders it
            seen.append(outbox.get(timeout=30))
        FIGURES["ordering_100_sends_s"] = round(time.monotonic() - started, 3)
        assert seen == [True] * 100
        inbox.put(None)
    finally:
        _stop(p)
    del array


def _many_in_flight(count, make, figure):
    """``count`` arrays from ``make(i)`` (holding ``i`` first) sent to one consumer that
    holds them all at once; then the device memory must be back within 5 s."""
    free_before = _free()
    inbox, outbox = procspawn.Queue(), procspawn.Queue()
    p = procspawn.Process(target=w.hold_many, args=(inbox, outbox, count))
    p.start()
    try:
        started = time.monotonic()
        for i in range(count):
            inbox.put(make(i))
        n, total = outbox.get(timeout=90)
        FIGURES[figure] = round(time.monotonic() - started, 3)
        assert n == count and total == sum(range(count))
    finally:
        _stop(p)
    deadline = time.monotonic() + 5
    while _free() < free_before - (64 << 20):  # (cuda_ipc: the producer's sweep, each second)
        assert time.monotonic() < deadline, f"device memory not back after {count} arrays"
        time.sleep(0.05)


def _slab_array(i):
    array = cuda.zeros(256)  # 1 KiB, carved out of a slab
    array[0] = i
    return array


def test_ten_thousand_arrays_in_flight_then_nothing_left():
    _many_in_flight(10_000, _slab_array, "ten_thousand_in_flight_s")


@pytest.fixture
def ipc_on():
    """cuda_ipc on for this test (it is off by default)."""
    cuda.set_ipc(True)
    yield
    cuda.set_ipc(False)


def test_cupy_pool_arrays_go_by_ipc_handle_small_ones_by_value_and_copies_when_asked(ipc_on):
    large = cupy.arange(1 << 20, dtype=cupy.float32)  # CuPy's pool: shared by IPC handle
    small = cupy.arange(100, dtype=cupy.float32)
    assert cuda.is_shared(large) and not cuda.is_shared(small)
    out = procspawn.spawn(w.touch_both, args=(large, small), nprocs=1, timeout=60)[0]
    assert out == (True, True, 1.0 * ((1 << 20) - 1), 99.0)
    assert float(large[0]) == 5 and float(small[0]) == 0  # shared; the small one a copy
    cuda.set_ipc(False)
    assert not cuda.is_shared(large)
    out = procspawn.spawn(w.touch_both, args=(large, small), nprocs=1, timeout=60)[0]
    assert out == (True, True, 5.0 + ((1 << 20) - 1), 99.0)  # a cuda_fd copy arrived
    assert float(large[0]) == 5  # the copy's writes are not the sender's
    del large, small


def test_a_consumer_sigkilled_holding_1_gib_of_cupy_s_pool_gives_it_back_within_2_s(ipc_on):
    # CuPy's own pool: the block waits in the producer's limbo; its sweep (every second)
    # sees the holder gone
    _kill_a_holder_of_1_gib(lambda n: cupy.zeros(n, dtype=cupy.float32), "ipc_sigkill_1GiB_back_s")


def test_cupy_pool_arrays_forwarded_come_home_and_many_in_flight_are_all_given_back(
    monkeypatch, ipc_on
):
    from procspawn import _settings

    _forward_and_come_home(lambda n: cupy.zeros(n, dtype=cupy.float32))
    monkeypatch.setenv("PROCSPAWN_GPU_INLINE_BYTES", "1k")
    _settings.reload("PROCSPAWN_GPU_INLINE_BYTES")
    _many_in_flight(  # 4 KiB each, fresh from CuPy's pool, each by IPC handle
        5_000, lambda i: cupy.full(1024, i, dtype=cupy.float32), "ipc_5000_in_flight_s"
    )


def test_a_torch_cuda_tensor_still_goes_by_torch_s_own_sharing():
    pytest.importorskip("torch", reason="the torch check needs torch")
    # producer and consumer are both children: this process keeps out of torch's CUDA
    inbox, outbox = procspawn.Queue(), procspawn.Queue()
    p = procspawn.Process(target=w.torch_add_one, args=(inbox, outbox))
    p.start()
    try:
        total, seen = procspawn.spawn(w.torch_producer, args=(inbox, outbox), nprocs=1, timeout=90)[
            0
        ]
    finally:
        _stop(p)
    assert total == float(1 << 20)
    assert seen == 1.0  # the consumer's write, in the producer's tensor: shared, not copied
