"""A batch job that survives bad inputs: task_timeout, retries and progress in a Pool.

The data is scikit-learn's bundled digits (1,797 8x8 images; nothing is downloaded),
shared once (``sharing.share_memory_``) and cut into chunks that travel as handles. Each
task denoises its chunk (a 3x3 median filter) and returns per-image statistics. Two
chunks are made to misbehave as real inputs do:

* a "poison" chunk crashes its worker the first time it is run (as a native library's
  segfault or the out-of-memory killer would): ``retries=1`` runs it again on another
  worker, and it succeeds;
* a "stuck" chunk never finishes (a deadlock in a decoder, say): ``task_timeout`` kills
  its worker after the limit, that chunk alone fails with ``procspawn.TaskTimeoutError``,
  and the job goes on without it.

``progress=`` shows a bar of finished images while the job runs (tqdm when installed,
else a plain line; shown when stderr is a terminal). The last line says how many images
were processed, how many a timeout skipped, and the mean foreground of the rest.

Run::

    pip install -e '.[examples]'      # scikit-learn
    python examples/pool_resilient.py [--workers N] [--timeout S] [--quick]
"""

import argparse
import os
import signal
import tempfile
import time

import numpy as np

import procspawn
from procspawn import sharing

CHUNK = 64
QUICK_IMAGES = 512


def median3x3(images):
    """A 3x3 median filter over a stack of images (edges padded by reflection)."""
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1)), mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(1, 2))
    return np.median(windows.reshape(*images.shape, 9), axis=-1)


def denoise_chunk(task):
    """One task: (start, images, fault, flag_dir) -> (start, per-image stats)."""
    start, images, fault, flag_dir = task
    if fault == "poison":
        flag = os.path.join(flag_dir, f"crashed-{start}")
        if not os.path.exists(flag):  # the first run only: a retry gets through
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stuck":
        time.sleep(3600)
    clean = median3x3(images.astype(np.float32))
    foreground = (clean > 4).mean(axis=(1, 2))
    return start, np.stack([clean.mean(axis=(1, 2)), foreground], axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, help="task_timeout, seconds (default 2, with --quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_IMAGES} images")
    args = parser.parse_args()
    if args.timeout is None:
        args.timeout = 1.0 if args.quick else 2.0

    from sklearn.datasets import load_digits

    images = load_digits().images
    if args.quick:
        images = images[:QUICK_IMAGES]
    shared = sharing.share_memory_(np.ascontiguousarray(images))
    starts = list(range(0, len(shared), CHUNK))
    faults = {starts[1]: "poison", starts[-2]: "stuck"}
    stats = np.full((len(shared), 2), np.nan)
    done, timeouts = set(), 0
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as flag_dir:
        tasks = [(s, shared[s : s + CHUNK], faults.get(s), flag_dir) for s in starts]
        with procspawn.Pool(args.workers, task_timeout=args.timeout, retries=1) as pool:
            bar = procspawn.Progress(len(tasks), desc="chunks")
            results = pool.imap_unordered(denoise_chunk, tasks, progress=bar)
            while True:
                try:
                    start, chunk_stats = next(results)
                except StopIteration:
                    break
                except procspawn.TaskTimeoutError:  # that chunk only; the others go on
                    timeouts += 1
                    continue
                stats[start : start + len(chunk_stats)] = chunk_stats
                done.add(start)
    poison = next(s for s, fault in faults.items() if fault == "poison")
    print(
        f"{len(done)} of {len(starts)} chunks done (the one that crashed its worker: "
        f"{'done, after a retry' if poison in done else 'lost'}); skipped by the "
        f"{args.timeout:g} s task_timeout: {timeouts}, at images {sorted(set(starts) - done)}"
    )
    ok = ~np.isnan(stats[:, 0])
    print(
        f"{ok.sum()} of {len(shared)} images in {time.monotonic() - began:.1f} s; "
        f"mean foreground {stats[ok, 1].mean():.3f}"
    )


if __name__ == "__main__":
    main()
