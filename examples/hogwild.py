"""Hogwild training in NumPy: N processes update one shared model, lock-free.

A neural network (one hidden layer of 2,048 ReLU units, 153,610 float32 parameters) learns
scikit-learn's bundled digits (1,797 8x8 images, 10 classes; the data ships inside the
scikit-learn wheel, nothing is downloaded). Its parameters live in one shared-memory
segment, made with ``procspawn.sharing.share_memory_(params)``. Each rank of
``procspawn.spawn(train, ..., nprocs=N)`` runs minibatch SGD on its own shard of the
training set and writes every update straight into the shared arrays (``W -= grad``),
with no lock and no message: the Hogwild recipe (Niu et al., 2011). An update can now and
then overwrite a concurrent one; SGD does not mind, and the ranks never wait for each
other (but once, to start together).

The same training runs twice: with 1 rank, then with N ranks (default min(4, CPUs)) that
share the work (each rank takes 1/N of the training set, so both runs make the same
number of updates). The parent shows a progress bar on a terminal (``procspawn.progress()``
in the ranks, ``spawn(..., progress=...)`` in the parent), then:

* one line showing that the model was shared, not copied: each rank reports which file
  its view of the model is mapped from (device and inode, read from /proc/self/maps), and
  the parent checks that they all name the one segment its own arrays live in;
* a table comparing 1 rank with N ranks: wall time including process start-up, training
  time measured inside the ranks, minibatch steps per second, and test accuracy;
* ``speed-up with N ranks: X.XX×`` (wall time of 1 rank over N ranks, start-up included)
  and ``test accuracy: 0.9XX`` (the N-rank model, on held-out images).

Run::

    pip install -e '.[examples]'      # scikit-learn (and tqdm for the progress bar)
    python examples/hogwild.py [--ranks N] [--epochs E] [--quick]
"""

import os

# One BLAS thread per process, set before NumPy is imported: its BLAS library reads these
# variables once, when it loads. N ranks each running a multi-threaded BLAS would fight
# over the same cores, and for matrices this small the threads cost more than they save.
# The ranks inherit the limit: procspawn's fork server (the default start method) starts
# after these lines, with this environment, and under "spawn" a rank runs this top level
# again before its NumPy loads.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import procspawn  # noqa: E402
from procspawn import sharing  # noqa: E402

# scikit-learn is imported inside load_digits_split(), in the parent only: the ranks do not
# need it.

# Sized so that the ranks' work dwarfs their start-up: with 1 rank, training takes about
# 8 s (on one core of a 2-core VM), starting the rank well under a tenth of a second. A
# batch of 64 gives each rank much arithmetic per write into the shared model, so the
# ranks seldom stall on memory the other one has just written.
HIDDEN = 2048
BATCH_SIZE = 64
LEARNING_RATE = 0.1
EPOCHS = 400
QUICK_EPOCHS = 40
SEED = 0


# -- data and model (plain NumPy) -----------------------------------------------------------


def load_digits_split(seed=SEED):
    """Standardized digits, split 75/25 into train and test (stratified, fixed seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, stratify=labels, random_state=seed
    )
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0  # pixels that are blank in every training image
    return {
        "x_train": ((x_train - mean) / std).astype(np.float32),
        "y_train": y_train.astype(np.int64),
        "x_test": ((x_test - mean) / std).astype(np.float32),
        "y_test": y_test.astype(np.int64),
    }


def init_params(n_features, n_hidden, n_classes, seed=SEED):
    """W1, b1, W2, b2 as views into one flat array, so that the model is one block of
    memory (``share_memory_`` keeps views of one base as views of one shared base)."""
    shapes = {
        "W1": (n_features, n_hidden),
        "b1": (n_hidden,),
        "W2": (n_hidden, n_classes),
        "b2": (n_classes,),
    }
    flat = np.zeros(sum(int(np.prod(shape)) for shape in shapes.values()), dtype=np.float32)
    params, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        params[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    rng = np.random.default_rng(seed)
    params["W1"][:] = rng.normal(0.0, np.sqrt(2.0 / n_features), shapes["W1"])  # He init
    params["W2"][:] = rng.normal(0.0, np.sqrt(1.0 / n_hidden), shapes["W2"])
    return params


def new_buffers(params, rows):
    """Room for the intermediate arrays of ``rows`` images at a time.

    A training step fills these instead of making new arrays: a fresh array of 100+ KB is
    new memory from the kernel (page faults), which can cost more than the arithmetic.
    """
    n_features, n_hidden = params["W1"].shape
    n_classes = params["W2"].shape[1]
    return {
        "hidden": np.empty((rows, n_hidden), dtype=np.float32),
        "probs": np.empty((rows, n_classes), dtype=np.float32),
        "grad_hidden": np.empty((rows, n_hidden), dtype=np.float32),
        "grad_W1": np.empty((n_features, n_hidden), dtype=np.float32),
        "grad_W2": np.empty((n_hidden, n_classes), dtype=np.float32),
    }


def forward(params, x, buffers):
    """(hidden activations, class probabilities) of the images ``x``, in ``buffers``."""
    hidden = np.matmul(x, params["W1"], out=buffers["hidden"][: len(x)])
    hidden += params["b1"]
    np.maximum(hidden, 0.0, out=hidden)  # ReLU
    probs = np.matmul(hidden, params["W2"], out=buffers["probs"][: len(x)])
    probs += params["b2"]
    probs -= probs.max(axis=1, keepdims=True)  # softmax, row by row
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    return hidden, probs


def sgd_step(params, x, y, lr, buffers):
    """One minibatch step of backpropagation, written in place into ``params``.

    When ``params`` holds shared arrays, each in-place ``-=`` is the Hogwild update: it
    goes straight into the memory every rank reads, with no lock.
    """
    hidden, grad = forward(params, x, buffers)
    grad[np.arange(len(y)), y] -= 1.0  # d(mean cross-entropy)/d(logits), times len(y)
    grad *= lr / len(y)  # ... scaled by the learning rate: the gradients below are steps
    grad_hidden = np.matmul(grad, params["W2"].T, out=buffers["grad_hidden"][: len(x)])
    grad_hidden *= hidden > 0  # back through the ReLU
    params["W2"] -= np.matmul(hidden.T, grad, out=buffers["grad_W2"])
    params["b2"] -= grad.sum(axis=0)
    params["W1"] -= np.matmul(x.T, grad_hidden, out=buffers["grad_W1"])
    params["b1"] -= grad_hidden.sum(axis=0)


def accuracy(params, x, y):
    """Share of the images ``x`` that the model classifies right."""
    _, probs = forward(params, x, new_buffers(params, len(x)))
    return float((probs.argmax(axis=1) == y).mean())


def shard(n_rows, rank, nranks, seed=SEED):
    """The rows of the training set that ``rank`` trains on: disjoint across ranks."""
    return np.random.default_rng(seed).permutation(n_rows)[rank::nranks]


def steps_per_epoch(n_rows, batch_size):
    return -(-n_rows // batch_size)  # the last, smaller batch counts too


def mapped_file(array):
    """Which file the memory of ``array`` is mapped from, in this process (Linux):
    ``(permissions, device, inode, path)`` of its line in /proc/self/maps.

    Two processes that name the same device and inode, with the ``s`` (shared) flag, map
    one and the same memory; a private copy would be ``p`` or anonymous (inode 0).
    """
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms, _offset, device, inode, *path = line.split(maxsplit=5)
            start, end = (int(bound, 16) for bound in span.split("-"))
            if start <= address < end:
                return perms, device, int(inode), path[0].strip() if path else ""
    raise LookupError(f"address {address:#x} is in no mapping of this process")


# -- one rank -------------------------------------------------------------------------------


def train(rank, nranks, params, data, start_line, epochs, batch_size, lr):
    """Runs in every rank: SGD on this rank's shard, updates written into shared ``params``.

    Returns the seconds this rank spent training (start-up excluded), and where each array
    of ``params`` is mapped from in this rank.
    """
    where = {name: mapped_file(array) for name, array in params.items()}
    rows = shard(len(data["x_train"]), rank, nranks)
    x, y = data["x_train"][rows], data["y_train"][rows]  # this rank's own copy of its shard
    buffers = new_buffers(params, batch_size)
    rng = np.random.default_rng(SEED + 1 + rank)  # each rank its own shuffles
    # The ranks start one after the other; wait for all of them, so that they really train
    # at the same time and the training time below is theirs alone.
    start_line.wait()
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(rows))
        for begin in range(0, len(order), batch_size):
            batch = order[begin : begin + batch_size]
            sgd_step(params, x[batch], y[batch], lr, buffers)
            procspawn.progress()  # one write into shared memory: the parent draws the bar
    return time.perf_counter() - start, where


def warm_up(rank):
    """Nothing: the first spawn of a program starts procspawn's fork server, once."""


# -- the parent ------------------------------------------------------------------------------


def ranks(n):
    """'1 rank', '2 ranks'."""
    return f"{n} rank{'s' if n > 1 else ''}"


def run(data, nranks, epochs, batch_size=BATCH_SIZE, lr=LEARNING_RATE):
    """Train a fresh shared model with ``nranks`` Hogwild ranks; return the results."""
    n_features, n_classes = data["x_train"].shape[1], int(data["y_train"].max()) + 1
    params = init_params(n_features, HIDDEN, n_classes)
    sharing.share_memory_(params)  # W1, b1, W2, b2 replaced in place by shared views
    n_train = len(data["x_train"])
    steps = epochs * sum(
        steps_per_epoch(len(shard(n_train, r, nranks)), batch_size) for r in range(nranks)
    )
    bar = procspawn.Progress(steps, per_rank=True, desc=ranks(nranks))
    if not sys.stdout.isatty():  # no bar off a terminal: say what runs, not stay silent
        print(f"training with {ranks(nranks)} ({steps:,} steps)...", flush=True)
    start_line = procspawn.get_context().Barrier(nranks)
    start = time.perf_counter()
    reports = procspawn.spawn(
        train,
        args=(nranks, params, data, start_line, epochs, batch_size, lr),
        nprocs=nranks,
        progress=bar,
    )
    wall = time.perf_counter() - start
    train_time = max(seconds for seconds, _ in reports)
    return {
        "ranks": nranks,
        "wall": wall,
        "train": train_time,
        "steps_per_s": steps / train_time,
        # the ranks wrote into params: the parent sees the trained model, nothing was sent
        "accuracy": accuracy(params, data["x_test"], data["y_test"]),
        "sharing": sharing_line(params, [where for _, where in reports]),
    }


def sharing_line(params, rank_reports):
    """Check that the parent and every rank mapped the model from one shared file (each
    array of it, in each process), and say so; raise if they did not."""
    files = {mapped_file(array) for array in params.values()}
    files |= {where for report in rank_reports for where in report.values()}
    perms, _device, inode, path = next(iter(files))
    if len(files) != 1 or not perms.endswith("s") or inode == 0:
        raise RuntimeError(f"the model is not in one shared segment: {sorted(files)}")
    nbytes = sum(array.nbytes for array in params.values())
    nranks = len(rank_reports)
    return (
        f"model: {nbytes / 1e6:.2f} MB in one shared segment ({path.split()[0]}, inode "
        f"{inode}), mapped by {ranks(nranks)} and the parent (no copies)"
    )


def print_table(results):
    print()
    print("| ranks | wall s (with start-up) | train s (in ranks) | steps/s | test accuracy |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['ranks']} | {r['wall']:.2f} | {r['train']:.2f} | "
            f"{r['steps_per_s']:,.0f} | {r['accuracy']:.3f} |"
        )
    print()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="number of Hogwild ranks to compare with 1 (default: min(4, CPUs))",
    )
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {EPOCHS})")
    parser.add_argument(
        "--quick", action="store_true", help=f"a short run: {QUICK_EPOCHS} epochs by default"
    )
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else EPOCHS
    elif args.epochs < 1:
        parser.error("--epochs must be >= 1")
    return args


def main():
    args = parse_args()
    data = load_digits_split()
    sharing.share_memory_(data)  # copied into shared memory once, sent to both runs as handles
    print(
        f"digits: {len(data['x_train']):,} training and {len(data['x_test'])} test images; "
        f"a 64-{HIDDEN}-10 network, batch {BATCH_SIZE}, {args.epochs} epochs per run"
    )
    # Start the fork server now, so that the first timed run does not pay for it alone.
    procspawn.spawn(warm_up, nprocs=1)
    results = [run(data, 1, args.epochs)]
    if args.ranks > 1:
        results.append(run(data, args.ranks, args.epochs))
    print(results[-1]["sharing"])
    print_table(results)
    speed_up = results[0]["wall"] / results[-1]["wall"]  # start-up included in both
    print(f"speed-up with {ranks(args.ranks)}: {speed_up:.2f}×")
    print(f"test accuracy: {results[-1]['accuracy']:.3f}")


if __name__ == "__main__":
    main()
