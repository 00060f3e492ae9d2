"""Functions the GPU tests run in other processes (importable by name in every child)."""

from __future__ import annotations

import os

import numpy as np


def sync() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def check_views(rank, views, expected, write_value):
    """A rank: every received view equals its host copy; write into the second; send
    back the third (shared: the same memory) and a fresh array."""
    import cupy

    from procspawn.sharing import cuda

    same = [bool((v.get() == e).all()) for v, e in zip(views, expected, strict=True)]
    layouts = [(v.shape, v.strides, v.dtype.str) for v in views]
    shared = [cuda.is_shared(v) for v in views]
    views[1][...] = write_value
    sync()
    fresh = cupy.arange(100_000, dtype=cupy.float64) * (1 + write_value)
    return same, layouts, shared, views[2], fresh


def echo_server(channel_kind, inbox, outbox):
    """A long-lived consumer: take an array, add 1 in place, sync, ack with its sum; on
    "check", answer the first element of the array it holds."""
    held = None
    while True:
        if channel_kind == "pipe":
            message = inbox.recv()
        elif channel_kind == "simple":
            message = inbox.get()  # (no timeout: the test kills this process at its deadline)
        else:
            message = inbox.get(timeout=60)
        if message is None:
            break
        if isinstance(message, str) and message == "check":
            reply = float(held.ravel()[0].get())
        else:
            held = message
            held += 1
            sync()
            reply = float(held.sum().get())
        if channel_kind == "pipe":
            outbox.send(reply)
        else:
            outbox.put(reply)


def add_and_return(array, value):
    """A pool task: add in place, sync, return a fresh (unshared, large) result."""
    import cupy

    array += value
    sync()
    return cupy.full(50_000, value, dtype=cupy.float32)


def fill_result(rank, nbytes):
    """A rank's result: a fresh 64 MiB array of its rank, then the rank exits."""
    import cupy

    return cupy.full(nbytes // 4, rank + 1, dtype=cupy.float32)


def hold_and_report(inbox, outbox):
    """Receive an array, touch it, say so, then hold it until killed."""
    array = inbox.get(timeout=60)
    array[0] = 1
    sync()
    outbox.put(("holding", os.getpid()))
    inbox.get(timeout=120)  # never comes: the test SIGKILLs this process


def make_and_exit(outbox, value, nbytes):
    """A producer that sends a shared array and exits at once."""
    from procspawn.sharing import cuda

    array = cuda.zeros(nbytes // 4)
    array += value
    sync()
    outbox.put(array)
    outbox.close()
    outbox.join_thread()


def forward(inbox, outbox):
    """Take an array, send it on as it is, exit."""
    outbox.put(inbox.get(timeout=60))
    outbox.close()
    outbox.join_thread()


def write_and_return(inbox, outbox, value):
    array = inbox.get(timeout=60)
    array[...] = value
    sync()
    outbox.put(array)
    outbox.close()
    outbox.join_thread()


def check_final(inbox, outbox):
    """Ordering: read each received array at once (no sync by the sender) and report
    whether it holds the value the sender's kernel wrote."""
    while True:
        message = inbox.get(timeout=60)
        if message is None:
            return
        array, value = message
        host = array.get()  # on this process' current stream, which waited for the sender
        outbox.put(bool((host == value).all()))


def hold_many(inbox, outbox, count):
    """Receive ``count`` arrays, holding all of them at once, then check and drop them."""
    held = [inbox.get(timeout=60) for _ in range(count)]
    import cupy

    total = float(cupy.stack([a[:1] for a in held]).sum().get())
    outbox.put((len(held), total))
    del held


def cuda_running(rank):
    import cupy  # noqa: F401  (imported, not started: the test reads the descriptors)

    from procspawn.context.launch._cuda_guard import cuda_started

    return cuda_started()


def host_value(array):
    return np.asarray(array.get())


def check_all(rank, args):
    return [check_views(rank, v, e, value) for v, e, value in args]


def touch_both(rank, large, small):
    """Whether the large array arrived shared (a copy made at the send) and the small one
    by value; their last values; then writes that the sender must not see."""
    from procspawn.sharing import cuda

    shared = cuda.is_shared(large), not cuda.is_shared(small)
    last = (float(large[-1]), float(small[-1]))
    large += 5
    small += 5
    sync()
    return (*shared, *last)


def torch_add_one(inbox, outbox):
    """A torch consumer: a CUDA tensor through procspawn's Queue (torch's own reducers)."""
    import torch

    tensor = inbox.get(timeout=60)
    tensor.add_(1)
    torch.cuda.synchronize()
    outbox.put(float(tensor.sum()))
    del tensor
    inbox.get(timeout=60)  # the producer keeps its tensor until the consumer let go


def torch_producer(rank, inbox, outbox):
    """A torch producer: send a CUDA tensor to the consumer, see its write, report."""
    import torch

    tensor = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    inbox.put(tensor)
    total = outbox.get(timeout=90)
    seen = float(tensor[7])
    inbox.put("done")
    return total, seen
