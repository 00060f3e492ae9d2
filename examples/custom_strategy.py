"""A custom sharing strategy: shared arrays as files in a directory you choose.

procspawn's ``file_system`` strategy names its segments in /dev/shm, which is a sized tmpfs
(64 MiB in a default Docker container; the default ``file_descriptor`` strategy's memfds are
not limited by it, but you cannot choose where they live). This example registers a
strategy that makes its segments in any directory instead: a larger tmpfs, a tmpfs mounted
with ``huge=always``, a size-capped tmpfs used as a quota, or a disk directory for arrays
larger than memory.

It shows how to:

* subclass ``procspawn.sharing.SharingStrategy`` (``allocate``, ``reduce``, ``rebuild``);
* register it so that every process finds it (at import time: see ``register_strategy``
  below), and select it with ``procspawn.set_sharing_strategy``;
* send its arrays through ``spawn`` arguments and results and through a ``Queue``, with
  writes made by one process seen by the others;
* keep procspawn's lifetime rule: a segment lives while an array over it or a message
  carrying it does, and no longer, even if a process is killed.

Run:

    python examples/custom_strategy.py                 # a temporary directory, removed after
    python examples/custom_strategy.py --dir /mnt/big  # your own directory (left in place)
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import shutil
import tempfile
import time

import numpy as np

import procspawn as mp
from procspawn import sharing

# The directory new segments are made in. The parent sets it (from --dir) before it starts
# any process, and every child inherits the environment: see the note at register_strategy.
DIR_ENV = "PROCSPAWN_EXAMPLE_SEGMENT_DIR"
NAME = "directory"
FALLBACK_PREFIX = "dirstrategy-"  # names that live an instant, without O_TMPFILE


class DirectoryStrategy(sharing.SharingStrategy):
    """Segments are files in a directory, unlinked at once; messages carry the descriptor.

    Design, and why it keeps the lifetime rule: the file is created without a name
    (``O_TMPFILE``) or unlinked right after it is created, so nothing is ever left in the
    directory, whoever dies how (SIGKILL included). What remains is an open file whose
    memory the kernel frees when its last descriptor and last mapping are gone. Each
    process that maps a segment keeps one descriptor of it (to send it on), and every
    message that carries the segment carries a descriptor of its own (``attach_fd``: sent
    over the UNIX socket with SCM_RIGHTS), so a message keeps its memory alive by itself,
    after its sender dropped the array or exited. This is what the built-in
    ``file_descriptor`` strategy does with memfds, in a directory of your choice.

    Costs: one open descriptor per live segment per process that maps it (as with
    ``file_descriptor``), and space is reserved when a segment is made
    (``posix_fallocate``), so a full directory fails at allocation with ENOSPC, not as a
    bus error when the memory is first written.
    """

    def directory(self) -> str:
        return os.environ.get(DIR_ENV) or tempfile.gettempdir()

    def allocate(self, nbytes: int) -> sharing.Segment:
        directory = self.directory()
        fd = _nameless_file(directory)
        try:
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                free = os.statvfs(directory)
                raise OSError(
                    errno.ENOSPC,
                    f"no room for a {nbytes}-byte shared segment in {directory} "
                    f"({free.f_bavail * free.f_frsize} bytes free)",
                ) from None
            st = os.fstat(fd)
            # key: the segment's identity across processes (a receiver maps each key once).
            # keep_fd: the Segment owns the descriptor (closed when its last array goes),
            # so reduce() can send it on.
            return sharing.Segment.map(
                fd, nbytes, strategy=self.name, key=(st.st_dev, st.st_ino), keep_fd=True
            )
        except BaseException:
            os.close(fd)
            raise

    def reduce(self, segment: sharing.Segment):
        # attach_fd: the descriptor goes with the message; the segment (its owner) is kept
        # alive by the message until it is sent. The key travels too (no fstat to redo).
        return (sharing.attach_fd(segment.fd, segment), segment.size, segment.key)

    def rebuild(self, handle) -> sharing.Segment:
        index, size, key = handle
        # received_fd is borrowed (closed once the message is unpickled): keep a duplicate
        fd = os.dup(sharing.received_fd(index))
        try:
            return sharing.Segment.map(fd, size, strategy=self.name, key=key, keep_fd=True)
        except BaseException:
            os.close(fd)
            raise

    # adopt_cached: the default (nothing) is right. A message for a segment this process
    # maps already carries nothing but its descriptor, which procspawn closes.


def _nameless_file(directory: str) -> int:
    """A new read-write file in ``directory`` that has no name (close-on-exec)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError) as exc:  # no O_TMPFILE here, or not on this filesystem
        if isinstance(exc, OSError) and exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
            raise
    fd, path = tempfile.mkstemp(prefix=FALLBACK_PREFIX, dir=directory)  # mode 0600, O_CLOEXEC
    os.unlink(path)  # named only for this instant
    return fd


# Register at import time, at the top level of the module, not under `if __name__ ==
# "__main__":`. Children started with "spawn" (every rank, every ctx.Process) re-import this
# file as `__mp_main__`, so each child registers an instance of its own, of a class it can
# find by name, before it receives a single array (procspawn then keeps it: the parent's
# instance, which comes with the start-up message, does not replace it). If only the parent
# registered it, a child would get the strategy by value (cloudpickle) in its start-up
# message and could use its arrays, but a Queue.put of one of them would fail in the child
# with "PicklingError: Can't pickle <class '__main__.DirectoryStrategy'>: it's not the same
# object as __main__.DirectoryStrategy": a message of plain data and arrays carries the
# strategy of each segment pickled by reference (module and class name).
# So a child's instance is not the parent's: it finds the directory in the environment,
# which main() sets before any child starts.
sharing.register_strategy(NAME, DirectoryStrategy())


def _is_segment(path: str, directory: str) -> bool:
    """Whether ``path`` (as /proc shows it) is one of our segments in ``directory``: an
    O_TMPFILE file shows as ``<dir>/#<inode> (deleted)``, a fallback one by its prefix."""
    head, name = os.path.split(path.removesuffix(" (deleted)"))
    return head == directory and name.startswith(("#", FALLBACK_PREFIX))


def mapped_from(directory: str) -> int:
    """How many of this process' mappings are segments of ``directory``."""
    with open("/proc/self/maps") as maps:
        fields = [line.rstrip("\n").split(maxsplit=5) for line in maps]
    return sum(len(f) == 6 and _is_segment(f[5], directory) for f in fields)


def fds_in(directory: str) -> int:
    """How many of this process' open descriptors are segments of ``directory``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += _is_segment(os.readlink(f"/proc/self/fd/{fd}"), directory)
        except OSError:
            pass  # the descriptor listdir itself used
    return count


# --- what the children run ---------------------------------------------------------------


def rank_fn(rank: int, shared: np.ndarray, world: int) -> tuple[str, int, np.ndarray]:
    """A rank writes into the parent's array and returns a new one of its own."""
    shared[rank::world] = rank + 1  # seen by the parent: same memory
    result = np.full(100_000, rank, dtype=np.int64)  # 800 kB: copied into a segment on return
    return mp.get_sharing_strategy(), mapped_from(os.environ[DIR_ENV]), result


def doubler(inbox, outbox) -> None:
    """Doubles each array in place and sends the same array back (a handle, not a copy)."""
    while (item := inbox.get()) is not None:
        i, array = item
        array *= 2
        outbox.put((i, array))
        del item, array  # hold nothing between items


def orphan_sender(queue) -> None:
    """Sends an array it made, then exits before it is received."""
    array = sharing.empty(50_000, np.float64)
    array[:] = 3.5
    queue.put(array)


# --- the parent ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="directory for the segments (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="fewer queue items")
    args = parser.parse_args()

    made_dir = args.dir is None
    base = os.environ.get("XDG_RUNTIME_DIR") or None  # usually a tmpfs; else $TMPDIR or /tmp
    directory = tempfile.mkdtemp(prefix="procspawn-example-", dir=base) if made_dir else args.dir
    os.environ[DIR_ENV] = os.path.realpath(directory)  # before any child starts
    try:
        run(os.environ[DIR_ENV], 20 if args.quick else 200)
    finally:
        if made_dir:
            shutil.rmtree(directory, ignore_errors=True)


def run(directory: str, n_items: int) -> None:
    start = time.perf_counter()
    mp.set_sharing_strategy(NAME)
    free = os.statvfs(directory)
    print(f"strategy {mp.get_sharing_strategy()!r}: segments in {directory}")
    print(f"  {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free there")
    fds_before = fds_in(directory)

    # 1. A new shared array is a nameless file of the directory, mapped here.
    world = 2
    shared = sharing.zeros(200_000)  # 1.6 MB
    assert sharing.is_shared(shared)
    assert mapped_from(directory) == 1
    assert not any(name.startswith(FALLBACK_PREFIX) for name in os.listdir(directory))
    print("1. sharing.zeros: 1 segment mapped from the directory, no name left in it")

    # 2. spawn: ranks write into it, and their own results come back through the strategy.
    # "spawn": each rank is a fresh process, so what it maps is what it received (under
    # "fork" a rank also inherits the parent's mappings, and the count below would say so)
    results = mp.spawn(rank_fn, args=(shared, world), nprocs=world, start_method="spawn")
    expected = np.tile(np.arange(1, world + 1, dtype=np.float64), len(shared) // world)
    assert np.array_equal(shared, expected), "a rank's writes are not visible"
    for rank, (strategy, mapped, result) in enumerate(results):
        assert strategy == NAME, f"rank {rank} used {strategy!r}"
        assert mapped == 1, f"rank {rank} mapped {mapped} segments from the directory"
        assert sharing.is_shared(result) and np.all(result == rank)
    assert mapped_from(directory) == 1 + world, "the results are not in the directory"
    print(
        f"2. spawn: {world} ranks wrote into the parent's array (seen here) and returned "
        f"arrays of their own, in shared memory: they used {results[0][0]!r}"
    )
    del results, result

    # 3. A Queue: the worker doubles each array in place and sends the same one back.
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(maxsize=4), ctx.Queue()
    worker = ctx.Process(target=doubler, args=(inbox, outbox))
    worker.start()
    arrays = [sharing.empty(20_000, np.float64) for _ in range(4)]  # reused, never remade
    for i in range(n_items):
        array = arrays[i % len(arrays)]
        array[:] = i
        inbox.put((i, array))
        j, back = outbox.get()
        assert j == i and np.shares_memory(back, array), "not the same memory"
        assert np.all(array == 2 * i), "the worker's write is not visible"
    inbox.put(None)
    worker.join()
    assert worker.exitcode == 0
    del array, back
    print(f"3. Queue: {n_items} arrays doubled in place by a worker, same memory both ways")

    # 4. A message keeps its memory alive by itself: its sender is gone before it is read.
    sender = ctx.Process(target=orphan_sender, args=(outbox,))
    sender.start()
    sender.join()
    orphan = outbox.get(timeout=30)
    assert sender.exitcode == 0 and np.all(orphan == 3.5)
    print("4. an array sent by a process that exited before it was received arrived intact")
    for queue in (inbox, outbox):
        queue.close()
        queue.join_thread()

    # 5. The lifetime rule: drop the arrays and nothing is left, mapped, open or named.
    held = mapped_from(directory)
    del shared, arrays, orphan
    gc.collect()
    assert mapped_from(directory) == 0, "a segment is still mapped"
    assert fds_in(directory) == fds_before, "a segment's descriptor is still open"
    left = [name for name in os.listdir(directory) if name.startswith(FALLBACK_PREFIX)]
    assert not left, f"files left in the directory: {left}"
    print(f"5. dropped the arrays: {held} mappings and their descriptors released, no name left")
    print(f"all checks passed in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
