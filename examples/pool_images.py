"""A batch job over images with procspawn's pools: features in a Pool, model search with futures.

The data is scikit-learn's bundled digits (1,797 8x8 images of 10 classes; it ships inside
the scikit-learn wheel, nothing is downloaded). The job has two stages:

1. Features, in a ``procspawn.Pool`` with ``imap_unordered``. The images are put in shared
   memory once (``sharing.share_memory_``); each task is a chunk of them, a slice of that
   array, which travels as a small handle, not a copy. A worker upscales its images to
   32x32 (bilinear), filters them with a bank of 16 Gabor filters (4 orientations x 2
   wavelengths x 2 phases), takes histograms of gradient orientations, and pools all of
   it over a 4x4 grid of cells: 416 numbers per image. The feature array it returns goes
   back through shared memory too. The parent writes each chunk's rows where they belong,
   in whatever order the chunks finish.
2. Model search, in a ``procspawn.ProcessPoolExecutor`` with ``submit``: one future per
   (C, fold) pair of a cross-validated logistic regression over the training features
   (shared once, so each call sends handles). The parent takes the results with
   ``as_completed``, picks the C with the best mean validation accuracy, fits the final
   model itself and prints its accuracy on the held-out test images.

Run::

    pip install -e '.[examples]'      # scikit-learn
    python examples/pool_images.py [--workers N] [--start-method M] [--quick]

``--quick`` takes 400 of the images and a smaller search, and runs in a few seconds. The
last line is ``test accuracy: 0.XXX`` (about 0.99).
"""

import os

# One BLAS thread per process, before NumPy is imported (see examples/hogwild.py): the
# workers already run one per core, and a multi-threaded BLAS in each would fight them.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import as_completed  # noqa: E402

import numpy as np  # noqa: E402
from numpy.lib.stride_tricks import sliding_window_view  # noqa: E402

import procspawn  # noqa: E402
from procspawn import sharing  # noqa: E402

# scikit-learn is imported inside the functions that use it (the parent's and the model
# search's), so that a worker computing features never pays for importing it.

SIDE = 8  # the digits are 8x8
UPSCALE = 4  # -> 32x32
CELLS = 4  # features pooled over a 4x4 grid of cells
ORIENTATION_BINS = 9
KERNEL = 7  # the Gabor filters are 7x7
CHUNK = 64  # images per task
QUICK_CHUNK = 32
QUICK_IMAGES = 400
C_GRID = (0.01, 0.1, 1.0, 10.0)
QUICK_C_GRID = (0.1, 1.0)
FOLDS = 3
QUICK_FOLDS = 2
SEED = 0


# -- stage 1: features of a chunk of images (plain NumPy, runs in the Pool's workers) -------


def upscale_matrix(n, factor):
    """The (n * factor, n) matrix of bilinear interpolation: ``M @ img @ M.T`` upscales."""
    size = n * factor
    position = np.clip((np.arange(size) + 0.5) / factor - 0.5, 0, n - 1)
    low = np.minimum(np.floor(position).astype(int), n - 2)
    weight = position - low
    matrix = np.zeros((size, n))
    matrix[np.arange(size), low] = 1 - weight
    matrix[np.arange(size), low + 1] = weight
    return matrix


def gabor_bank(size=KERNEL):
    """16 zero-mean, unit-norm Gabor filters: 4 orientations x 2 wavelengths x 2 phases."""
    half = size // 2
    y, x = np.mgrid[-half : half + 1, -half : half + 1].astype(float)
    filters = []
    for theta in np.arange(4) * np.pi / 4:
        along = x * np.cos(theta) + y * np.sin(theta)
        across = -x * np.sin(theta) + y * np.cos(theta)
        for wavelength in (4.0, 8.0):
            sigma = 0.5 * wavelength
            envelope = np.exp(-(along**2 + across**2) / (2 * sigma**2))
            for phase in (0.0, np.pi / 2):
                g = envelope * np.cos(2 * np.pi * along / wavelength + phase)
                g -= g.mean()
                filters.append(g / np.linalg.norm(g))
    return np.stack(filters)


def pool_cells(maps):
    """Mean of each of the CELLS x CELLS cells of ``maps`` (..., H, W) -> (..., CELLS**2)."""
    *lead, h, w = maps.shape
    cells = maps.reshape(*lead, CELLS, h // CELLS, CELLS, w // CELLS).mean(axis=(-3, -1))
    return cells.reshape(*lead, CELLS * CELLS)


def image_features(images, bank):
    """The feature rows (float32) of a stack of 8x8 images (n, 8, 8)."""
    n = len(images)
    grow = upscale_matrix(SIDE, UPSCALE)
    up = grow @ (images / 16.0) @ grow.T  # (n, 32, 32), pixel values 0..1

    # Gabor responses ("same" size), rectified, pooled over cells
    pad = bank.shape[-1] // 2
    padded = np.pad(up, ((0, 0), (pad, pad), (pad, pad)))
    windows = sliding_window_view(padded, bank.shape[1:], axis=(1, 2))  # (n, 32, 32, 7, 7)
    responses = np.abs(np.tensordot(windows, bank, axes=([3, 4], [1, 2])))  # (n, 32, 32, 16)
    gabor = pool_cells(responses.transpose(0, 3, 1, 2)).reshape(n, -1)

    # histograms of gradient orientation, weighted by magnitude, L2-normalized per cell
    gy, gx = np.gradient(up, axis=(1, 2))
    magnitude = np.hypot(gx, gy)
    angle = np.mod(np.arctan2(gy, gx), np.pi)  # unsigned orientation, 0..pi
    bins = np.minimum((angle / np.pi * ORIENTATION_BINS).astype(int), ORIENTATION_BINS - 1)
    hist = np.stack(
        [pool_cells(magnitude * (bins == b)) for b in range(ORIENTATION_BINS)], axis=1
    )  # (n, 9, 16)
    hist /= np.linalg.norm(hist, axis=1, keepdims=True) + 1e-6
    hog = hist.reshape(n, -1)

    intensity = pool_cells(up)
    return np.hstack([gabor, hog, intensity]).astype(np.float32)


def chunk_features(task, bank):
    """A Pool task: ``task`` is (first row, images); returns (first row, feature rows)."""
    start, images = task
    return start, image_features(images, bank)


# -- stage 2: one fit of the model search (runs in the executor's workers) -------------------


def fit_and_score(x, y, fit_rows, validation_rows, c):
    """Fit the model with inverse regularization ``c`` on ``fit_rows`` and return its
    accuracy on ``validation_rows``."""
    model = make_model(c)
    model.fit(x[fit_rows], y[fit_rows])
    return float(model.score(x[validation_rows], y[validation_rows]))


def make_model(c):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000))


# -- the parent ------------------------------------------------------------------------------


def load_images(limit=None):
    """The digits as (images (n, 8, 8) float64, labels); the first ``limit`` of them."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images, digits.target
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return images, labels


def compute_features(pool, images, chunk, bank):
    """Stage 1: every image's features, computed chunk by chunk in ``pool``."""
    features = None
    tasks = ((start, images[start : start + chunk]) for start in range(0, len(images), chunk))
    done = 0
    for start, rows in pool.imap_unordered(functools.partial(chunk_features, bank=bank), tasks):
        if features is None:
            features = np.empty((len(images), rows.shape[1]), dtype=rows.dtype)
        features[start : start + len(rows)] = rows
        done += len(rows)
    assert done == len(images), f"{done} of {len(images)} images came back"
    return features


def search_c(executor, x, y, c_grid, folds):
    """Stage 2: mean validation accuracy of each C, one future per (C, fold)."""
    from sklearn.model_selection import StratifiedKFold

    splits = list(StratifiedKFold(folds, shuffle=True, random_state=SEED).split(x, y))
    futures = {
        executor.submit(fit_and_score, x, y, fit_rows, validation_rows, c): c
        for c in c_grid
        for fit_rows, validation_rows in splits
    }
    scores = {c: [] for c in c_grid}
    for future in as_completed(futures):
        scores[futures[future]].append(future.result())
    return {c: float(np.mean(s)) for c, s in scores.items()}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="worker processes of each pool (default: min(4, CPUs))",
    )
    parser.add_argument(
        "--start-method",
        choices=multiprocessing.get_all_start_methods(),
        help="start method of the workers (default: multiprocessing's default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_IMAGES} images, {len(QUICK_C_GRID)} values of C, {QUICK_FOLDS} folds",
    )
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


def main():
    args = parse_args()
    if importlib.util.find_spec("sklearn") is None:
        sys.exit("pool_images.py needs sklearn: pip install -e '.[examples]'")
    from sklearn.model_selection import train_test_split

    chunk = QUICK_CHUNK if args.quick else CHUNK
    c_grid = QUICK_C_GRID if args.quick else C_GRID
    folds = QUICK_FOLDS if args.quick else FOLDS
    method = args.start_method or multiprocessing.get_start_method()
    began = time.perf_counter()

    images, labels = load_images(QUICK_IMAGES if args.quick else None)
    images = sharing.share_memory_(images)  # copied into shared memory once
    bank = gabor_bank()
    n_chunks = -(-len(images) // chunk)
    print(
        f"digits: {len(images)} images of {SIDE}x{SIDE}, upscaled to "
        f"{SIDE * UPSCALE}x{SIDE * UPSCALE}; {args.workers} worker"
        f"{'s' if args.workers > 1 else ''}, start method {method!r}"
    )

    # stage 1: features in a Pool (chunks go out as handles to the shared images)
    t0 = time.perf_counter()
    with procspawn.Pool(args.workers, context=args.start_method) as pool:
        features = compute_features(pool, images, chunk, bank)
    feature_seconds = time.perf_counter() - t0
    # the rows came back to the right place: the first chunk, computed here, matches
    check = image_features(images[:chunk], bank)
    assert np.allclose(features[:chunk], check, rtol=1e-5, atol=1e-6), "rows out of place"
    print(
        f"  features: {features.shape[1]} per image (Gabor {len(bank) * CELLS**2}, gradient "
        f"histograms {ORIENTATION_BINS * CELLS**2}, intensity {CELLS**2}), "
        f"Pool.imap_unordered over {n_chunks} chunks of {chunk}: {feature_seconds:.2f} s"
    )

    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.25, stratify=labels, random_state=SEED
    )
    # shared once: every future below sends handles to these, not copies
    x_shared, y_shared = sharing.share_memory_(x_train), sharing.share_memory_(y_train)

    # stage 2: model search with futures
    t0 = time.perf_counter()
    with procspawn.ProcessPoolExecutor(args.workers, mp_context=args.start_method) as executor:
        scores = search_c(executor, x_shared, y_shared, c_grid, folds)
    search_seconds = time.perf_counter() - t0
    best = max(scores, key=scores.get)
    print(
        f"  model search: {len(c_grid) * folds} fits ({len(c_grid)} values of C x {folds} "
        f"folds) with ProcessPoolExecutor.submit: {search_seconds:.2f} s"
    )
    for c, score in scores.items():
        print(f"    C={c:<5g} validation accuracy {score:.3f}{'  <- best' if c == best else ''}")

    # the final model, in the parent
    model = make_model(best).fit(x_train, y_train)
    accuracy = model.score(x_test, y_test)
    total = time.perf_counter() - began
    print(
        f"images processed: {len(images)} ({len(x_train)} train, {len(x_test)} test); "
        f"total {total:.2f} s"
    )
    print(f"test accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
