"""Benchmark: a long stream of fresh arrays, watched from outside for growth.

Run::

    python benchmarks/bench_soak.py [--minutes 10] [--strategy file_descriptor]
                                    [--sample-seconds 10] [--json out.json]

A producer process and a consumer process, started with procspawn's spawn context, are
joined by a ``procspawn`` Queue of at most 8 items. For ``--minutes`` the producer puts, in
turn: a fresh unshared 64 MiB array (copied at the put: the producer-side pool's case), a
fresh unshared 1 MiB array, a list of 100 small shared arrays (``sharing.zeros(64,
float32)``: slabs), and a fresh shared 4 MiB array (``sharing.zeros``). Each item carries
its sequence number in its bytes; the consumer checks every item, keeps the last 32
(so some live for a while) and drops the older ones.

Every ``--sample-seconds`` the parent reads, from outside (``/proc``), for the producer and
the consumer: resident memory (VmRSS), open descriptors, and procspawn shared mappings
(memfds and /dev/shm files in ``/proc/<pid>/maps``); and for the machine: bytes of
``/dev/shm/procspawn_*`` files and the kernel's ``Shmem`` (all shared memory, memfds
included). The table gives the first sample after a 30 s warm-up, the last, and the
largest; flat means the stream leaks nothing. ``--minutes 0.5`` is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

import procspawn
from procspawn import sharing

WINDOW = 32
MIB = 1 << 20


def produce(q: Any, stop: Any) -> None:
    seq = 0
    while not stop.is_set():
        kind = seq % 4
        if kind == 0:
            item: Any = np.full(64 * MIB, seq % 256, np.uint8)
        elif kind == 1:
            item = np.full(MIB, seq % 256, np.uint8)
        elif kind == 2:
            item = [sharing.zeros(64, np.float32) for _ in range(100)]
            for a in item:
                a[0] = seq
        else:
            item = sharing.zeros(4 * MIB, np.uint8)
            item[0] = item[-1] = seq % 256
        while not stop.is_set():
            try:
                q.put((seq, item), timeout=0.5)
                break
            except Exception:  # queue.Full
                continue
        del item
        seq += 1
    q.put(None)


def consume(q: Any, counter: Any) -> None:
    kept: list[Any] = []
    while True:
        got = q.get()
        if got is None:
            break
        seq, item = got
        if isinstance(item, list):
            assert all(int(a[0]) == seq for a in item), f"item {seq} was overwritten"
        else:
            assert item[0] == seq % 256 and item[-1] == seq % 256, f"item {seq} overwritten"
        kept.append(got)
        if len(kept) > WINDOW:
            kept.pop(0)
        with counter.get_lock():
            counter.value += 1
    kept.clear()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def process_sample(pid: int) -> dict[str, int]:
    rss = 0
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = -1
    maps = sum(
        1
        for line in _read(f"/proc/{pid}/maps").splitlines()
        if "/memfd:procspawn" in line or "/dev/shm/procspawn" in line
    )
    return {"rss": rss, "fds": fds, "maps": maps}


def machine_sample() -> dict[str, int]:
    shm = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith("procspawn"):
            try:
                shm += os.stat(os.path.join("/dev/shm", name)).st_size
            except OSError:
                pass
    shmem = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("Shmem:"):
            shmem = int(line.split()[1]) * 1024
    return {"dev_shm": shm, "shmem": shmem}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--strategy", default="file_descriptor")
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    procspawn.set_sharing_strategy(args.strategy)
    ctx = procspawn.get_context("spawn")
    q, stop, counter = ctx.Queue(maxsize=8), ctx.Event(), ctx.Value("q", 0)
    producer = ctx.Process(target=produce, args=(q, stop), name="producer")
    consumer = ctx.Process(target=consume, args=(q, counter), name="consumer")
    consumer.start()
    producer.start()
    warmup = min(30.0, args.minutes * 60 / 4)
    start = time.monotonic()
    end = start + args.minutes * 60
    samples = []
    next_sample = start + warmup
    try:
        while time.monotonic() < end:
            time.sleep(max(0.0, min(next_sample, end) - time.monotonic()))
            if not (producer.is_alive() and consumer.is_alive()):
                raise SystemExit(f"a worker died: {producer.exitcode=} {consumer.exitcode=}")
            now = time.monotonic()
            samples.append(
                {
                    "t": round(now - start, 1),
                    "items": counter.value,
                    "producer": process_sample(producer.pid),
                    "consumer": process_sample(consumer.pid),
                    **machine_sample(),
                }
            )
            print(json.dumps(samples[-1]), file=sys.stderr)
            next_sample = now + args.sample_seconds
    finally:
        stop.set()
        consumer.join(60)
        producer.join(60)
        for p in (producer, consumer):
            if p.is_alive():
                p.kill()
                p.join()
    if consumer.exitcode != 0 or producer.exitcode != 0:
        raise SystemExit(f"a worker failed: {producer.exitcode=} {consumer.exitcode=}")
    print_table(samples, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": args.strategy, "samples": samples}, f, indent=1)


def print_table(samples: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if not samples:
        print("no samples (too short a run)")
        return
    first, last = samples[0], samples[-1]
    rate = (last["items"] - first["items"]) / max(last["t"] - first["t"], 1e-9)
    print(
        f"## soak: {args.minutes:g} min, strategy {args.strategy}, "
        f"{last['items']:,} items ({rate:.1f}/s after warm-up)\n"
    )
    print(
        "| measure | first (t={:.0f} s) | last (t={:.0f} s) | max |".format(first["t"], last["t"])
    )
    print("|---|---|---|---|")

    def row(label: str, get: Any, unit: str = "") -> None:
        values = [get(s) for s in samples]
        scale = MIB if unit == "MiB" else 1
        cells = [f"{v / scale:,.1f}" if unit else f"{v:,}" for v in (values[0], values[-1])]
        top = max(values)
        print(f"| {label} | {cells[0]} | {cells[1]} | {top / scale:,.1f} |")

    for who in ("producer", "consumer"):
        row(f"{who} RSS (MiB)", lambda s, w=who: s[w]["rss"], "MiB")
        row(f"{who} open fds", lambda s, w=who: s[w]["fds"])
        row(f"{who} shared mappings", lambda s, w=who: s[w]["maps"])
    row("/dev/shm procspawn files (MiB)", lambda s: s["dev_shm"], "MiB")
    row("machine Shmem (MiB)", lambda s: s["shmem"], "MiB")


if __name__ == "__main__":
    main()
