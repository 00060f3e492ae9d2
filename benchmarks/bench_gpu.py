"""GPU arrays through a queue: procspawn (CuPy, cuda_fd) against torch.multiprocessing
(CUDA tensors, torch's CUDA IPC), side by side on one GPU, medians.

Rows:
- an already-shared array sent again and again to a consumer, which adds 1 in place,
  synchronises and acks (4 KiB, 64 MiB, 1 GiB): time per message;
- an array of CuPy's pool sent again and again (cuda_ipc; torch: its tensor again);
- a fresh 64 MiB array each message (CuPy's pool, by IPC handle; then copied into
  cuda_fd memory with ``set_ipc(False)``; torch: a fresh tensor from its caching allocator);
- a consumer SIGKILLed while it holds 1 GiB of CuPy's pool that the producer dropped:
  seconds until the device memory is back (torch: after ``ipc_collect`` and
  ``empty_cache``), 5 s at most.

Both consumers run the same CuPy kernel (torch's tensor through DLPack), so the rows
compare the sharing, not two libraries' kernels.

Usage: ``python benchmarks/bench_gpu.py [--repeats N] [--json F]`` on a machine with a GPU,
CuPy and (for the torch column) torch. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

SIZES = {"4 KiB": 4 << 10, "64 MiB": 64 << 20, "1 GiB": 1 << 30}


# -- consumers --------------------------------------------------------------------------------


def _cupy_consumer(inbox, outbox):
    import cupy

    while True:
        array = inbox.get(timeout=120)
        if array is None:
            return
        if isinstance(array, str):  # "hold": keep the next array until killed
            held = inbox.get(timeout=120)
            held += 1
            cupy.cuda.get_current_stream().synchronize()
            outbox.put(1)
            time.sleep(600)
            return
        array += 1
        cupy.cuda.get_current_stream().synchronize()
        outbox.put(1)
        del array


def _torch_consumer(inbox, outbox):
    import cupy
    import torch

    while True:
        tensor = inbox.get(timeout=120)
        if tensor is None:
            return
        if isinstance(tensor, str):
            held = inbox.get(timeout=120)
            held.add_(1)
            torch.cuda.synchronize()
            outbox.put(1)
            time.sleep(600)
            return
        array = cupy.from_dlpack(tensor)  # the same kernel as procspawn's consumer runs
        array += 1
        cupy.cuda.get_current_stream().synchronize()
        outbox.put(1)
        del tensor, array


# -- runs ---------------------------------------------------------------------------------------


def _per_message(send, recv, make, repeats: int) -> float:
    """Median seconds from a send to its ack, over ``repeats`` after 3 warm-ups."""
    times = []
    for i in range(repeats + 3):
        item = make()
        started = time.perf_counter()
        send(item)
        recv()
        if i >= 3:
            times.append(time.perf_counter() - started)
        del item
    return statistics.median(times)


def _procspawn_rows(repeats: int) -> dict[str, float]:
    import cupy

    import procspawn
    from procspawn.sharing import cuda

    inbox, outbox = procspawn.Queue(), procspawn.Queue()
    p = procspawn.Process(target=_cupy_consumer, args=(inbox, outbox))
    p.start()
    rows: dict[str, float] = {}
    try:
        for label, nbytes in SIZES.items():
            array = cuda.zeros(nbytes // 4)
            cupy.cuda.get_current_stream().synchronize()
            rows[f"shared {label}"] = _per_message(
                inbox.put, lambda: outbox.get(timeout=60), lambda a=array: a, repeats
            )
            del array
        cuda.set_ipc(True)  # (off by default: not yet run on a GPU)
        pooled = cupy.zeros((64 << 20) // 4, dtype=cupy.float32)
        rows["CuPy pool 64 MiB, same array"] = _per_message(
            inbox.put, lambda: outbox.get(timeout=60), lambda p=pooled: p, repeats
        )
        del pooled
        fresh = [("fresh 64 MiB", True), ("fresh 64 MiB, copied (set_ipc(False))", False)]
        for label, ipc in fresh:
            cuda.set_ipc(ipc)
            rows[label] = _per_message(
                inbox.put,
                lambda: outbox.get(timeout=60),
                lambda: cupy.ones((64 << 20) // 4, dtype=cupy.float32),
                repeats,
            )
        cuda.set_ipc(True)
        rows["SIGKILL 1 GiB back (s)"] = _kill_while_holding(
            lambda: cupy.zeros(1 << 28, dtype=cupy.float32), inbox, outbox, p.pid, _cupy_free
        )
    finally:
        _stop(p, inbox)
    return rows


def _cupy_free() -> int:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    return cupy.cuda.runtime.memGetInfo()[0]


def _kill_while_holding(make, inbox, outbox, pid, free) -> float:
    before = free()
    inbox.put("hold")
    item = make()
    inbox.put(item)
    outbox.get(timeout=60)
    del item
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while free() < before - (64 << 20):
        if time.monotonic() - killed > 5:
            return float("inf")
        time.sleep(0.01)
    return time.monotonic() - killed


def _torch_rows(repeats: int) -> dict[str, float]:
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_torch_consumer, args=(inbox, outbox))
    p.start()
    rows: dict[str, float] = {}
    try:
        for label, nbytes in SIZES.items():
            tensor = torch.zeros(nbytes // 4, device="cuda")
            torch.cuda.synchronize()
            rows[f"shared {label}"] = _per_message(
                inbox.put, lambda: outbox.get(timeout=60), lambda t=tensor: t, repeats
            )
            del tensor
        pooled = torch.zeros((64 << 20) // 4, device="cuda")
        rows["CuPy pool 64 MiB, same array"] = _per_message(
            inbox.put, lambda: outbox.get(timeout=60), lambda p=pooled: p, repeats
        )
        del pooled
        rows["fresh 64 MiB"] = _per_message(
            inbox.put,
            lambda: outbox.get(timeout=60),
            lambda: torch.ones((64 << 20) // 4, device="cuda"),
            repeats,
        )

        def free() -> int:
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
            return torch.cuda.mem_get_info()[0]

        rows["SIGKILL 1 GiB back (s)"] = _kill_while_holding(
            lambda: torch.zeros(1 << 28, device="cuda"), inbox, outbox, p.pid, free
        )
    finally:
        _stop(p, inbox)
    return rows


def _stop(p, inbox) -> None:
    if p.is_alive():
        try:
            inbox.put(None)
        except Exception:  # noqa: BLE001,S110
            pass
        p.join(timeout=10)
    if p.is_alive():
        p.kill()
        p.join(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    try:
        import cupy

        device = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        device = device.decode() if isinstance(device, bytes) else device
    except Exception as exc:  # noqa: BLE001
        print(f"no GPU here ({exc}): nothing to measure")
        return 0
    results = {"device": device, "procspawn": _procspawn_rows(options.repeats)}
    try:
        results["torch"] = _torch_rows(options.repeats)
    except ImportError as exc:
        results["torch"] = {"error": str(exc)}
    rows = list(results["procspawn"])
    print(f"GPU: {device}; medians of {options.repeats} messages (ms), else seconds")
    print("| case | procspawn | torch.multiprocessing | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        ours, theirs = (
            results["procspawn"][row],
            results["torch"].get(row, results["torch"].get(row.split(",")[0])),
        )
        scale = 1 if row.endswith("(s)") else 1000
        theirs_text = "—" if theirs is None else f"{theirs * scale:.3f}"
        ratio = "—" if not theirs or theirs == float("inf") else f"{ours / theirs:.2f}×"
        print(f"| {row} | {ours * scale:.3f} | {theirs_text} | {ratio} |")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
