"""Benchmark: moving arrays between processes through a Queue, and holding many of them.

Run::

    python benchmarks/bench_transfer.py [--repeats N] [--quick] [--json out.json]
                                        [--only {all,throughput,paced,fresh,live}]

Per-item latency. A producer process puts N arrays of one size (4 KiB, 1 MiB, 64 MiB,
512 MiB of uint8; N = 200, 50, 10, 3) into a Queue and a consumer process gets them. The
time of one round runs from the producer's first put to the consumer's last get (each
reports its ``time.time()`` to the parent through a stdlib Pipe), divided by N. The
first round is an untimed warm-up; the table gives the median of ``--repeats`` more
rounds, run by the same two processes. Rows:

* ``memcpy``: ``np.copyto`` between two arrays in one process, the copy reference;
* ``stdlib Queue``: ``multiprocessing.get_context("spawn").Queue``, the array pickled by
  value through the pipe;
* ``SharedMemory by hand``: a ``multiprocessing.shared_memory`` block made once; each
  item is its name, the consumer attaches on the first one (the zero-copy floor);
* ``procspawn <strategy>``: ``procspawn.get_context("spawn").Queue`` after
  ``procspawn.set_sharing_strategy(<strategy>)`` in the parent (the children check that
  they inherited it);
* ``torch <strategy>``: a ``torch.multiprocessing`` Queue of uint8 tensors under
  ``torch.multiprocessing.set_sharing_strategy(<strategy>)``, when torch imports.

"shared" rows put the same shared array every time (``procspawn.sharing.zeros``,
``tensor.share_memory_()``): only a handle moves. "unshared" rows put a fresh plain copy
every time (``ndarray.copy()``, ``tensor.clone()``; that copy is timed and costs about
one memcpy row): the transport must move the bytes. procspawn pickles arrays under
64 KiB (``PROCSPAWN_INLINE_BYTES``) by value, so its 4 KiB "unshared" rows are a pickle.
Columns: ms per item; GB/s = size / time per item (for "shared" rows the rate at which
handles to that many bytes arrive, not bytes copied); "x torch fd" = time / the torch
file_descriptor row of the same mode ("unshared" for memcpy and the stdlib Queue,
"shared" for SharedMemory); "x small msg" = time / one tiny int through a stdlib Queue.
Below 1 is faster.

One item at a time. The rows above keep the Queue full: they time throughput, and a
transport that moves items in parallel with its Python work (the stdlib's feeder thread)
looks as cheap as its slowest stage. ``paced`` rows put one shared item, wait until the
consumer has it (an acknowledgement on a stdlib Pipe), then put the next: each item's
latency runs from just before its ``put`` to just after its ``get`` returned and it was
checked (both ``time.monotonic()``, one clock for every process), median of N = 300 (the
first 30 not counted). Rows: the tiny int, SharedMemory by hand and the shared rows of
procspawn and torch, at 4 KiB and 64 MiB.

Fresh shared array per item. Paced as above, but the producer makes a new shared array
for every item: ``procspawn.sharing.zeros(nbytes, dtype=np.uint8)`` or
``torch.zeros(nbytes, dtype=torch.uint8).share_memory_()``, sets its last byte, puts it
and drops its reference. The consumer gets it, reads that byte (checked), drops it and
acknowledges. Each item's latency runs from just before the producer's allocation to
just after the consumer's drop (``time.monotonic()``), so it includes making the shared
memory, sending its handle, mapping it in the consumer and releasing it there; median of
N = 100 items at 4 KiB and 1 MiB, 30 at 64 MiB (the first n/10 not counted). Rows:
procspawn and torch, file_descriptor and file_system; "x torch fd" = time / the torch
file_descriptor row of the same size and mode. "fresh" rows touch one byte of the new
array, which flatters memory that is allocated as it is touched (a memfd); "filled" rows
write every byte, as a step that ships new data does: the producer makes
``np.full(nbytes, 7)`` and moves it into shared memory (``sharing.share_memory_`` /
``torch.full(...).share_memory_()``), timed the same way.

Many live arrays. A consumer lowers RLIMIT_NOFILE to (1024, 1024), then receives and
keeps 10,000 and 100,000 shared arrays of 64 float32 (the producer makes each one with
``procspawn.sharing.zeros`` / ``torch.zeros(64).share_memory_()``, puts it into a
bounded Queue and drops it). The table tells whether all were held, how many were held
before the failure, the time per item from the consumer's first get to its last ("us/item")
and that time over torch file_system's ("x torch fs"), and the error. Note the kernel's
vm.max_map_count (65530 by default): a process cannot map more segments than that,
whatever the strategy (procspawn carves arrays this small out of shared slabs).

``--quick`` runs 4 KiB and 1 MiB, 1 round, paced 4 KiB with N = 100, fresh 4 KiB and
1 MiB, and 2,000 live arrays (a smoke test). ``--only`` runs one table: ``throughput``
(the per-item latency table and the tiny-message time), ``paced``, ``fresh`` or ``live``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = str(Path(__file__).resolve().parent)
if BENCH_DIR not in sys.path:  # spawn children get the parent's sys.path
    sys.path.insert(0, BENCH_DIR)

import _bench_common as common  # noqa: E402
import _transfer_workers as workers  # noqa: E402

SIZES = (
    ("4 KiB", 4 << 10, 200),
    ("1 MiB", 1 << 20, 50),
    ("64 MiB", 64 << 20, 10),
    ("512 MiB", 512 << 20, 3),
)
QUICK_SIZES = SIZES[:2]
SMALL_MESSAGES = 1000
QUICK_SMALL_MESSAGES = 200
PACED_SIZES = (("4 KiB", 4 << 10), ("64 MiB", 64 << 20))
PACED_N, PACED_WARMUP = 300, 30
QUICK_PACED_N = 100
FRESH_SIZES = (("4 KiB", 4 << 10, 100), ("1 MiB", 1 << 20, 100), ("64 MiB", 64 << 20, 30))
QUICK_FRESH_SIZES = FRESH_SIZES[:2]
LIVE_COUNTS = (10_000, 100_000)
QUICK_LIVE_COUNTS = (2_000,)
LIVE_QUEUE_SIZE = 256
STRATEGIES = ("file_descriptor", "file_system")
MODES = ("shared", "unshared")
TABLES = ("throughput", "paced", "fresh", "live")
STARTUP_SECONDS = 120.0
LIVE_SECONDS = 600.0


@dataclass(frozen=True)
class Transport:
    """A row of the latency table; family and mode as in _transfer_workers."""

    family: str
    mode: str
    strategy: str | None = None

    @property
    def label(self) -> str:
        names = {
            "memcpy": "memcpy (np.copyto)",
            "small": "small msg",
            "stdlib": "stdlib Queue",
            "shm": "SharedMemory by hand",
        }
        return names.get(self.family) or f"{self.family} {self.strategy}, {self.mode}"


TRANSPORTS = (
    Transport("stdlib", "unshared"),
    Transport("shm", "shared"),
    *(Transport(f, m, s) for f in ("procspawn", "torch") for s in STRATEGIES for m in MODES),
)


# -- what can run --------------------------------------------------------------------------


def procspawn_queue_problem() -> str | None:
    """None when procspawn.get_context("spawn").Queue moves a shared array as shared."""
    try:
        import procspawn

        ctx = procspawn.get_context("spawn")
        q = ctx.Queue()
        sent = procspawn.sharing.zeros(16, np.uint8)
        q.put(sent)
        received = q.get(timeout=10)
        q.close()
        q.join_thread()
    except Exception as exc:
        return common.describe(exc)
    if not procspawn.sharing.is_shared(received):
        kind = f"{type(ctx).__module__}.{type(ctx).__name__}"
        return f"procspawn.get_context('spawn') is {kind}, whose Queue copies arrays"
    return None


def context_for(transport: Transport) -> Any:
    """The multiprocessing-like context whose Process and Queue the transport uses."""
    if transport.family == "procspawn":
        import procspawn

        procspawn.set_sharing_strategy(transport.strategy)
        return procspawn.get_context("spawn")
    if transport.family == "torch":
        import torch.multiprocessing

        return torch.multiprocessing.get_context("spawn")
    return multiprocessing.get_context("spawn")


# -- per-item latency ------------------------------------------------------------------------


def time_memcpy(nbytes: int, n: int, rounds: int) -> list[float]:
    """Seconds per ``np.copyto`` of ``nbytes``, one value per round."""
    src = np.full(nbytes, workers.FILL, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        samples.append((time.perf_counter() - start) / n)
    return samples


def time_transfer(transport: Transport, nbytes: int, n: int, rounds: int) -> list[float]:
    """Seconds per item through the transport's Queue, one value per timed round."""
    ctx = context_for(transport)
    q = ctx.Queue()
    prod_conn, prod_end = multiprocessing.Pipe()
    cons_conn, cons_end = multiprocessing.Pipe()
    fam, mode, strategy = transport.family, transport.mode, transport.strategy
    consumer = ctx.Process(
        name="consumer", target=workers.consume, args=(q, cons_end, fam, nbytes, n, rounds + 1)
    )
    producer = ctx.Process(
        name="producer",
        target=workers.produce,
        args=(q, prod_end, fam, mode, strategy, nbytes, n, rounds + 1),
    )
    round_seconds = 60.0 + 20.0 * nbytes * n / 1e9
    try:
        consumer.start()
        producer.start()
        common.receive(cons_conn, consumer, STARTUP_SECONDS)
        common.receive(prod_conn, producer, STARTUP_SECONDS)
        samples = []
        for _ in range(rounds + 1):
            prod_conn.send("go")
            start = common.receive(prod_conn, producer, round_seconds)
            end = common.receive(cons_conn, consumer, round_seconds)
            samples.append((end - start) / n)
        prod_conn.send("done")
        return samples[1:]
    finally:
        common.finish([producer, consumer])
        for conn in (prod_conn, prod_end, cons_conn, cons_end):
            conn.close()


def latency_row(
    size: str, nbytes: int, transport: Transport, samples: list[float] | str
) -> dict[str, Any]:
    """One result: the median seconds per item, or the error text."""
    row = {"size": size, "nbytes": nbytes, "transport": transport.label, "mode": transport.mode}
    if isinstance(samples, str):
        return {**row, "seconds": None, "error": samples}
    return {**row, "seconds": statistics.median(samples), "samples": samples, "error": None}


def transfer_samples(
    transport: Transport, nbytes: int, n: int, rounds: int, problem: str | None
) -> list[float] | str:
    """time_transfer's samples, or the text saying why there are none."""
    if problem is not None:
        return problem
    try:
        return time_transfer(transport, nbytes, n, rounds)
    except Exception as exc:
        return common.describe(exc)


def measure_size(
    size: str, nbytes: int, n: int, rounds: int, problems: dict[str, str | None]
) -> list[dict[str, Any]]:
    """The memcpy row and one row per transport for one array size."""
    memcpy = Transport("memcpy", "unshared")
    rows = [latency_row(size, nbytes, memcpy, time_memcpy(nbytes, n, rounds))]
    for transport in TRANSPORTS:
        samples = transfer_samples(transport, nbytes, n, rounds, problems.get(transport.family))
        rows.append(latency_row(size, nbytes, transport, samples))
        print(f"  {size:>8}  {transport.label}: done", file=sys.stderr)
    return rows


def latency_table(rows: list[dict[str, Any]], small_seconds: float) -> str:
    reference = {
        (row["size"], row["mode"]): row["seconds"]
        for row in rows
        if row["transport"].startswith("torch file_descriptor")
    }
    headers = ["size", "transport", "ms/item", "GB/s", "x torch fd", "x small msg"]
    lines = []
    for row in rows:
        seconds = row["seconds"]
        if seconds is None:
            lines.append([row["size"], row["transport"], f"n/a: {row['error']}", "", "", ""])
            continue
        lines.append(
            [
                row["size"],
                row["transport"],
                f"{seconds * 1e3:.3f}",
                f"{row['nbytes'] / seconds / 1e9:.2f}",
                common.ratio(seconds, reference.get((row["size"], row["mode"]))),
                common.ratio(seconds, small_seconds),
            ]
        )
    return common.markdown_table(headers, lines)


# -- one item at a time ----------------------------------------------------------------------

PACED_TRANSPORTS = (
    Transport("small", "shared"),
    Transport("shm", "shared"),
    *(Transport(f, "shared", s) for f in ("procspawn", "torch") for s in STRATEGIES),
)
FRESH_TRANSPORTS = tuple(
    Transport(f, m, s)
    for m in ("fresh", "filled")
    for f in ("procspawn", "torch")
    for s in STRATEGIES
)


def time_paced(transport: Transport, nbytes: int, n: int) -> list[float]:
    """Seconds per item after the warm-up, one item in flight: from put to get ("shared"
    mode), or from the producer's allocation to the consumer's drop ("fresh")."""
    ctx = context_for(transport)
    q = ctx.Queue()
    prod_conn, prod_end = multiprocessing.Pipe()
    cons_conn, cons_end = multiprocessing.Pipe()
    ack_recv, ack_send = multiprocessing.Pipe(duplex=False)
    fam, mode, strategy = transport.family, transport.mode, transport.strategy
    consumer = ctx.Process(
        name="consumer",
        target=workers.consume_paced,
        args=(q, cons_end, ack_send, fam, mode, nbytes, n),
    )
    producer = ctx.Process(
        name="producer",
        target=workers.produce_paced,
        args=(q, prod_end, ack_recv, fam, mode, strategy, nbytes, n),
    )
    try:
        consumer.start()
        producer.start()
        common.receive(cons_conn, consumer, STARTUP_SECONDS)
        common.receive(prod_conn, producer, STARTUP_SECONDS)
        prod_conn.send("go")
        ends = common.receive(cons_conn, consumer, 60.0 + n * (0.1 + 20.0 * nbytes / 1e9))
        starts = common.receive(prod_conn, producer, 60.0)
        prod_conn.send("done")
        skip = min(PACED_WARMUP, n // 10)
        return [end - start for start, end in zip(starts[skip:], ends[skip:], strict=True)]
    finally:
        common.finish([producer, consumer])
        for conn in (prod_conn, prod_end, cons_conn, cons_end, ack_recv, ack_send):
            conn.close()


def measure_paced(
    sizes: tuple[tuple[str, int, int], ...],
    transports: tuple[Transport, ...],
    problems: dict[str, str | None],
) -> list[dict[str, Any]]:
    """One row per (size, nbytes, n) and transport, each timed by time_paced."""
    rows = []
    for size, nbytes, n in sizes:
        for transport in transports:
            nb = 0 if transport.family == "small" else nbytes
            problem = problems.get(transport.family)
            if problem is None:
                try:
                    samples: list[float] | str = time_paced(transport, nb, n)
                except Exception as exc:
                    samples = common.describe(exc)
            else:
                samples = problem
            rows.append(latency_row(size, nb, transport, samples))
            table = "fresh" if transport.mode in workers.FRESH_MODES else "paced"
            print(f"  {table} {size:>8}  {transport.label}: done", file=sys.stderr)
    return rows


def paced_table(rows: list[dict[str, Any]]) -> str:
    """The paced or fresh rows; the "x small msg" column only when there is a small row."""
    small = {r["size"]: r["seconds"] for r in rows if r["transport"] == "small msg"}
    torch_fd = {
        (r["size"], r["mode"]): r["seconds"]
        for r in rows
        if r["transport"].startswith("torch file_desc")
    }
    headers = ["size", "transport", "ms/item", "x torch fd"] + (["x small msg"] if small else [])
    lines = []
    for row in rows:
        seconds = row["seconds"]
        if seconds is None:
            error = [f"n/a: {row['error']}"] + [""] * (len(headers) - 3)
            lines.append([row["size"], row["transport"], *error])
            continue
        line = [
            row["size"],
            row["transport"],
            f"{seconds * 1e3:.3f}",
            common.ratio(seconds, torch_fd.get((row["size"], row["mode"]))),
        ]
        if small:
            line.append(common.ratio(seconds, small.get(row["size"])))
        lines.append(line)
    return common.markdown_table(headers, lines)


# -- many live arrays ----------------------------------------------------------------------


def hold_live(family: str, strategy: str, count: int) -> dict[str, Any]:
    """Run one many-live-arrays case; the consumer's and the producer's reports."""
    ctx = context_for(Transport(family, "shared", strategy))
    q = ctx.Queue(maxsize=LIVE_QUEUE_SIZE)
    prod_conn, prod_end = multiprocessing.Pipe()
    cons_conn, cons_end = multiprocessing.Pipe()
    consumer = ctx.Process(name="consumer", target=workers.hold_many, args=(q, cons_end, count))
    producer = ctx.Process(
        name="producer", target=workers.send_many, args=(q, prod_end, family, strategy, count)
    )
    try:
        consumer.start()
        producer.start()
        held, error, per_item = common.receive(cons_conn, consumer, LIVE_SECONDS)
        prod_conn.send("stop")
        sent, producer_error = common.receive(prod_conn, producer, STARTUP_SECONDS)
    finally:
        common.finish([producer, consumer])
        for conn in (prod_conn, prod_end, cons_conn, cons_end):
            conn.close()
    if producer_error:
        error = f"{error}; producer: {producer_error}"
    return {"held": held, "sent": sent, "error": error, "seconds": per_item}


def live_row(family: str, strategy: str, count: int, problem: str | None) -> dict[str, Any]:
    """One many-live-arrays result; held is None when the case could not run."""
    row = {"transport": f"{family} {strategy}", "count": count}
    if problem is None:
        try:
            return {**row, **hold_live(family, strategy, count)}
        except Exception as exc:
            problem = common.describe(exc)
    return {**row, "held": None, "sent": None, "error": f"n/a: {problem}", "seconds": None}


def measure_live(counts: tuple[int, ...], problems: dict[str, str | None]) -> list[dict]:
    rows = []
    for family in ("procspawn", "torch"):
        for strategy in STRATEGIES:
            for count in counts:
                rows.append(live_row(family, strategy, count, problems.get(family)))
                print(f"  live {family} {strategy} {count:,}: done", file=sys.stderr)
    return rows


def live_table(rows: list[dict[str, Any]]) -> str:
    """The many-live-arrays rows; "x torch fs" = per-item time / torch file_system's for
    the same count (the strategy torch users switch to for many live tensors)."""
    headers = ["transport", "arrays", "held", "result", "us/item", "x torch fs", "error"]
    torch_fs = {
        r["count"]: r.get("seconds")
        for r in rows
        if r["transport"] == "torch file_system" and r["held"] == r["count"]
    }
    lines = []
    for row in rows:
        held = row["held"]
        ok = held == row["count"] and not row["error"]
        result = "-" if held is None else ("ok" if ok else "failed")
        held_text = "-" if held is None else f"{held:,}"
        seconds = row.get("seconds")
        per_item = "-" if seconds is None else f"{seconds * 1e6:.1f}"
        ref = torch_fs.get(row["count"])
        ratio = "-" if seconds is None or not ref else f"{seconds / ref:.2f}"
        error = (row["error"] or "").replace("|", "/")
        lines.append(
            [row["transport"], f"{row['count']:,}", held_text, result, per_item, ratio, error]
        )
    return common.markdown_table(headers, lines)


# -- main --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 KiB and 1 MiB, 1 round, paced 4 KiB, fresh 4 KiB and 1 MiB, 2,000 live arrays",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--only", choices=("all", *TABLES), default="all", help="run one table (default: all)"
    )
    return parser.parse_args()


def print_tables(results: dict[str, Any]) -> None:
    """The markdown tables of the parts that ran, each under its heading."""
    sections = []
    if "latency" in results:
        small = results["small_message_seconds"]
        sections.append(
            f"## transfer latency (median of {results['rounds']} round(s))\n\n"
            f"small stdlib Queue message: {small * 1e3:.3f} ms/item\n\n"
            + latency_table(results["latency"], small)
        )
    if "paced" in results:
        sections.append(
            "## one item at a time (paced: median latency from put to get)\n\n"
            + paced_table(results["paced"])
        )
    if "fresh" in results:
        sections.append(
            "## fresh shared array per item (paced: median latency from the producer's"
            " allocation to the consumer's drop)\n\n" + paced_table(results["fresh"])
        )
    if "live" in results:
        sections.append(
            f"## many live arrays (consumer RLIMIT_NOFILE = {workers.LIVE_FD_LIMIT})\n\n"
            + live_table(results["live"])
        )
    print("\n\n".join(sections))


def main() -> None:
    args = parse_args()
    run = set(TABLES) if args.only == "all" else {args.only}
    rounds = 1 if args.quick else args.repeats
    sizes = QUICK_SIZES if args.quick else SIZES
    problems = {"torch": common.torch_problem(), "procspawn": procspawn_queue_problem()}
    results: dict[str, Any] = {"rounds": rounds}
    if "throughput" in run:
        small_n = QUICK_SMALL_MESSAGES if args.quick else SMALL_MESSAGES
        small_transport = Transport("small", "unshared")
        small = statistics.median(time_transfer(small_transport, 0, small_n, rounds))
        rows = []
        for size, nbytes, n in sizes:
            rows += measure_size(size, nbytes, n, rounds, problems)
        results |= {"small_message_seconds": small, "latency": rows}
    if "paced" in run:
        paced_n = QUICK_PACED_N if args.quick else PACED_N
        paced_sizes = PACED_SIZES[:1] if args.quick else PACED_SIZES
        paced_sizes_n = tuple((size, nbytes, paced_n) for size, nbytes in paced_sizes)
        results["paced"] = measure_paced(paced_sizes_n, PACED_TRANSPORTS, problems)
    if "fresh" in run:
        fresh_sizes = QUICK_FRESH_SIZES if args.quick else FRESH_SIZES
        results["fresh"] = measure_paced(fresh_sizes, FRESH_TRANSPORTS, problems)
    if "live" in run:
        results["live"] = measure_live(QUICK_LIVE_COUNTS if args.quick else LIVE_COUNTS, problems)

    print_tables(results)
    if args.json:
        common.write_json(args.json, results)


if __name__ == "__main__":
    main()
