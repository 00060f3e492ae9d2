"""A pipeline of processes, producers -> workers -> consumer, that reuses its shared buffers.

Each producer allocates a fixed pool of shared arrays once (``sharing.zeros``), fills a
free one and puts it on the work queue; a worker transforms it in place and passes it on;
the consumer checks every result and sends the buffer back to its producer on that
producer's "free buffers" queue. Only handles cross the queues: an item of 1 MiB is never
copied, and no new shared segment is made per item. This is the advice of
torch.multiprocessing's "reuse buffers passed through a Queue": an array that is not in
shared memory yet is copied into a new segment every time it is sent, and a buffer sent
back costs next to nothing.

The ownership protocol is the free list: a producer writes into a buffer only when it is
its own again (never sent, or returned by the consumer), so no two processes ever write
one buffer at the same time. A worker that made new arrays instead of working in place
would keep a pool of its own the same way.

What it prints: throughput (items/s, MB/s of array data through the pipeline), how many
buffers each producer allocated (fixed, whatever the number of items) and how many shared
segments every process maps at the end (the producers their pool; workers and consumer,
which hold nothing between items, none).

Run:

    python examples/queue_pipeline.py            # 2 x 1000 items of 1 MiB
    python examples/queue_pipeline.py --quick    # 2 x 50 items
    python examples/queue_pipeline.py --strategy file_system
"""

from __future__ import annotations

import argparse
import functools
import queue
import time

import numpy as np

import procspawn as mp
from procspawn import sharing

SHAPE = (256, 512)  # float64: 1 MiB per item
BUFFERS_PER_PRODUCER = 4
N_PRODUCERS = 2
N_WORKERS = 2


@functools.cache
def ramp() -> np.ndarray:
    # whole numbers: every sum below is exact in float64
    return (np.arange(np.prod(SHAPE), dtype=np.float64) % 1000).reshape(SHAPE)


def fill(out: np.ndarray, producer: int, seq: int) -> None:
    """What producer ``producer`` puts in its item number ``seq``."""
    np.add(ramp(), 1000 * producer + seq, out=out)


def transform(x: np.ndarray) -> None:
    """What a worker does to an item, in place."""
    x *= 2
    x += 1


def expected_sum(producer: int, n_items: int) -> float:
    """The sum of every finished item of a producer, in closed form."""
    size = np.prod(SHAPE)
    seqs = 1000 * producer * n_items + n_items * (n_items - 1) // 2
    return float(2 * (ramp().sum() * n_items + size * seqs) + size * n_items)


def segments_mapped() -> int:
    """How many procspawn segments this process maps now (one mapping each: memfds under
    file_descriptor, /dev/shm names under file_system), read from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        return sum("/memfd:procspawn" in line or "/dev/shm/procspawn_" in line for line in maps)


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


# --- the processes ------------------------------------------------------------------------


def producer(me, n_items, work, free, reports, start) -> None:
    buffers = [sharing.zeros(SHAPE) for _ in range(BUFFERS_PER_PRODUCER)]  # once, for good
    addresses = [address(b) for b in buffers]
    idle = list(range(len(buffers)))  # indices of the buffers that are ours to write
    not_same_memory = 0

    def take_back() -> None:
        nonlocal not_same_memory
        index, returned = free.get()
        # The buffer that came back is the one we made: this process maps its segment
        # already, so the handle gives back the same memory (nothing new is mapped).
        not_same_memory += address(returned) != addresses[index]
        idle.append(index)

    start.wait()
    for seq in range(n_items):
        if not idle:
            take_back()  # blocks until the consumer is done with one of ours
        index = idle.pop()
        fill(buffers[index], me, seq)
        work.put((me, seq, index, buffers[index]))  # a handle: no copy, no new segment
    while len(idle) < len(buffers):  # every buffer back: every item of ours is done
        take_back()
    reports.put(
        (
            "producer",
            me,
            {
                "allocated": len(buffers),
                "sent": n_items,
                "not_same_memory": not_same_memory,
                "segments_mapped": segments_mapped(),
            },
        )
    )


def worker(me, work, done, reports, start) -> None:
    start.wait()
    items = 0
    while (item := work.get()) is not None:
        producer_id, seq, index, x = item
        transform(x)  # in place: the producer's memory
        done.put((producer_id, seq, index, x))
        del item, x  # hold nothing between items
        items += 1
    done.put(None)  # one sentinel per worker: the consumer counts them
    reports.put(("worker", me, {"items": items, "segments_mapped": segments_mapped()}))


def consumer(n_workers, done, free_queues, reports, start) -> None:
    expected = np.empty(SHAPE)  # scratch, reused
    sums = [0.0] * len(free_queues)
    seen: set[tuple[int, int]] = set()
    wrong = duplicates = 0
    start.wait()
    t0 = last = time.perf_counter()
    finished = 0
    while finished < n_workers:
        item = done.get()
        if item is None:
            finished += 1
            continue
        producer_id, seq, index, x = item
        fill(expected, producer_id, seq)
        transform(expected)
        wrong += not np.array_equal(x, expected)  # every item checked, element by element
        duplicates += (producer_id, seq) in seen
        seen.add((producer_id, seq))
        sums[producer_id] += float(x.sum())
        free_queues[producer_id].put((index, x))  # back to its producer, for reuse
        del item, x
        last = time.perf_counter()
    reports.put(
        (
            "consumer",
            0,
            {
                "items": len(seen),
                "wrong": wrong,
                "duplicates": duplicates,
                "sums": sums,
                "seconds": last - t0,
                "segments_mapped": segments_mapped(),
            },
        )
    )


# --- the parent ---------------------------------------------------------------------------


def collect(reports, role: str, count: int, processes, got: dict) -> None:
    """Wait for ``count`` reports of ``role``; fail at once if a process died."""
    while sum(1 for r, _ in got if r == role) < count:
        try:
            r, me, report = reports.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}")
            continue
        got[(r, me)] = report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 items per producer")
    parser.add_argument("--items", type=int, help="items per producer (default 1000)")
    parser.add_argument("--strategy", choices=sorted(mp.get_all_sharing_strategies()))
    args = parser.parse_args()
    n_items = args.items or (50 if args.quick else 1000)
    if args.strategy:
        mp.set_sharing_strategy(args.strategy)  # the children inherit it

    ctx = mp.get_context("spawn")
    work = ctx.Queue(maxsize=N_PRODUCERS * BUFFERS_PER_PRODUCER)
    done = ctx.Queue()
    free_queues = [ctx.Queue() for _ in range(N_PRODUCERS)]
    reports = ctx.Queue()
    start = ctx.Barrier(N_PRODUCERS + N_WORKERS + 2)  # every process and this one
    producers = [
        ctx.Process(
            target=producer,
            args=(i, n_items, work, free_queues[i], reports, start),
            name=f"producer-{i}",
        )
        for i in range(N_PRODUCERS)
    ]
    workers = [
        ctx.Process(target=worker, args=(i, work, done, reports, start), name=f"worker-{i}")
        for i in range(N_WORKERS)
    ]
    sink = ctx.Process(
        target=consumer, args=(N_WORKERS, done, free_queues, reports, start), name="consumer"
    )
    processes = [*producers, *workers, sink]
    got: dict = {}
    try:
        for p in processes:
            p.start()
        start.wait(timeout=60)  # everyone started: the clock starts now
        t0 = time.perf_counter()
        collect(reports, "producer", N_PRODUCERS, processes, got)  # all items consumed
        for _ in workers:
            work.put(None)  # one sentinel per worker
        collect(reports, "worker", N_WORKERS, processes, got)
        collect(reports, "consumer", 1, processes, got)
        wall = time.perf_counter() - t0
        for p in processes:
            p.join(timeout=30)
            assert p.exitcode == 0, f"{p.name} exited with code {p.exitcode}"
    finally:
        for p in processes:
            if p.is_alive():  # only after a failure
                p.terminate()
                p.join()
        for q in (work, done, reports, *free_queues):
            q.close()
            q.join_thread()

    total = N_PRODUCERS * n_items
    mib = np.prod(SHAPE) * 8 / 2**20
    c = got[("consumer", 0)]
    print(
        f"{N_PRODUCERS} producers -> {N_WORKERS} workers -> 1 consumer, "
        f"strategy {mp.get_sharing_strategy()!r}, items of {mib:g} MiB"
    )
    print(
        f"  {total} items in {c['seconds']:.2f} s: {total / c['seconds']:.0f} items/s, "
        f"{total * mib * 2**20 / 1e6 / c['seconds']:.0f} MB/s through the pipeline "
        f"(wall {wall:.2f} s)"
    )
    assert c["items"] == total and c["duplicates"] == 0, f"items seen: {c['items']}/{total}"
    assert c["wrong"] == 0, f"{c['wrong']} items had a wrong result"
    for i in range(N_PRODUCERS):
        assert c["sums"][i] == expected_sum(i, n_items), f"producer {i}: wrong sum"
    print(f"  every item checked element by element: {total} right, sums exact")
    for i in range(N_PRODUCERS):
        r = got[("producer", i)]
        print(
            f"  producer {i}: sent {r['sent']} items through {r['allocated']} buffers "
            f"allocated once; maps {r['segments_mapped']} segments at the end"
        )
        assert r["allocated"] == BUFFERS_PER_PRODUCER and r["not_same_memory"] == 0
        assert r["segments_mapped"] == BUFFERS_PER_PRODUCER, "a segment was made per item"
    for i in range(N_WORKERS):
        r = got[("worker", i)]
        print(f"  worker {i}: {r['items']} items; maps {r['segments_mapped']} segments at exit")
        assert r["segments_mapped"] == 0
    print(f"  consumer: maps {c['segments_mapped']} segments at exit")
    assert c["segments_mapped"] == 0
    assert sum(got[("worker", i)]["items"] for i in range(N_WORKERS)) == total


if __name__ == "__main__":
    main()
