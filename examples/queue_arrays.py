"""A producer/consumer pipeline: arrays cross a Queue as shared-memory handles.

Run: python examples/queue_arrays.py
"""

import numpy as np

import procspawn as mp
from procspawn import sharing


def producer(queue, n):
    for i in range(n):
        batch = np.full((512, 512), i, dtype=np.float32)  # 1 MiB, copied once into shm
        queue.put((i, batch))
    queue.put(None)


def consumer(queue, totals):
    while (item := queue.get()) is not None:
        i, batch = item
        totals[i] = batch.sum()


def main():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue(maxsize=8)
    totals = sharing.zeros(16)
    procs = [
        ctx.Process(target=producer, args=(queue, 16)),
        ctx.Process(target=consumer, args=(queue, totals)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print("totals seen by the consumer, written into shared memory:", totals)
    assert np.allclose(totals, np.arange(16) * 512 * 512)
    queue.close()
    queue.join_thread()


if __name__ == "__main__":
    main()
