"""Hogwild training in NumPy: N processes update one shared model, lock-free.

A softmax regression on scikit-learn's bundled digits (1,797 8x8 images, 10 classes; the
data ships inside the scikit-learn wheel, nothing is downloaded). Its parameters are a dict
of NumPy arrays made shared with ``procspawn.sharing.share_memory_(params)``. Each rank of
``procspawn.spawn(train, ..., nprocs=N)`` runs minibatch SGD on its own shard of the
training set and writes every update straight into the shared arrays (``W -= lr * grad``),
with no lock and no message: the Hogwild recipe (Niu et al., 2011). An update can now and
then overwrite a concurrent one; on a sparse-enough or small-enough problem SGD does not
mind, and the ranks never wait for each other (but once, to start together).

Rank 0 prints the training loss and held-out accuracy of the shared model after each of
its epochs, while the other ranks keep training. The parent shows one live progress bar
(``procspawn.progress()`` in the ranks, ``spawn(..., progress=total)`` in the parent; on a
terminal only), then a table comparing 1 rank with N ranks: wall time including process
start-up, training time measured inside the ranks, minibatch steps per second, and test
accuracy. The data set is small, so the start-up of the ranks (a new interpreter that
imports NumPy) is a large part of the wall time; the training time column shows what the
extra ranks buy.

Run::

    pip install -e '.[examples]'      # scikit-learn (and tqdm for the progress bar)
    python examples/hogwild.py [--ranks N] [--epochs E] [--quick]

The last line is the N-rank run's ``test accuracy: 0.XXX`` (about 0.97).
"""

import os

# One BLAS thread per process, set before NumPy is imported: its BLAS library reads these
# variables once, when it loads. N ranks each running a multi-threaded BLAS would fight
# over the same cores, and for matrices this small the threads cost more than they save.
# The ranks get the limit too: procspawn starts each rank as a new interpreter (the
# "spawn" start method), which re-runs this script's top level as the module
# ``__mp_main__`` (the ``if __name__ == "__main__":`` block is skipped) before the rank
# unpickles its function, so these lines run in every rank before NumPy loads there.
# The parent gets the same limit, which is fine here.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import procspawn  # noqa: E402
from procspawn import sharing  # noqa: E402

# scikit-learn is imported inside load_digits_split(), in the parent only: the ranks re-run
# this top level, and importing scikit-learn there would add a second to each start-up.

BATCH_SIZE = 16
LEARNING_RATE = 0.1
EPOCHS = 20
QUICK_EPOCHS = 10
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


def init_params(n_features, n_classes):
    return {
        "W": np.zeros((n_features, n_classes), dtype=np.float32),
        "b": np.zeros(n_classes, dtype=np.float32),
    }


def probabilities(params, x):
    """Softmax of ``x @ W + b``, row by row."""
    logits = x @ params["W"]
    logits += params["b"]
    logits -= logits.max(axis=1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=1, keepdims=True)
    return logits


def sgd_step(params, x, y, lr):
    """One minibatch step of softmax regression, written in place into ``params``.

    When ``params`` holds shared arrays, the in-place ``-=`` is the Hogwild update: it goes
    straight into the memory every rank reads, with no lock.
    """
    grad = probabilities(params, x)  # d(mean cross-entropy)/d(logits), times len(y)
    grad[np.arange(len(y)), y] -= 1.0
    grad *= lr / len(y)
    params["W"] -= x.T @ grad
    params["b"] -= grad.sum(axis=0)


def evaluate(params, x, y):
    """(mean cross-entropy, accuracy) of the model on ``x``, ``y``."""
    probs = probabilities(params, x)
    loss = -np.log(probs[np.arange(len(y)), y] + 1e-12).mean()
    accuracy = (probs.argmax(axis=1) == y).mean()
    return float(loss), float(accuracy)


def shard(n_rows, rank, nranks, seed=SEED):
    """The rows of the training set that ``rank`` trains on: disjoint across ranks."""
    return np.random.default_rng(seed).permutation(n_rows)[rank::nranks]


def steps_per_epoch(n_rows, batch_size):
    return -(-n_rows // batch_size)  # the last, smaller batch counts too


# -- one rank -------------------------------------------------------------------------------


def train(rank, nranks, params, data, start_line, epochs, batch_size, lr):
    """Runs in every rank: SGD on this rank's shard, updates written into shared ``params``.

    Returns the seconds this rank spent training (start-up excluded).
    """
    rows = shard(len(data["x_train"]), rank, nranks)
    x, y = data["x_train"][rows], data["y_train"][rows]  # this rank's own copy of its shard
    rng = np.random.default_rng(SEED + 1 + rank)  # each rank its own shuffles
    # The ranks start one after the other; wait for all of them, so that they really train
    # at the same time (an epoch takes milliseconds, a start-up about a tenth of a second).
    start_line.wait()
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(rows))
        for begin in range(0, len(order), batch_size):
            batch = order[begin : begin + batch_size]
            sgd_step(params, x[batch], y[batch], lr)
            procspawn.progress()  # one shared-memory write: the parent draws the bar
        if rank == 0:
            # no barrier: the other ranks keep training while rank 0 measures
            loss, _ = evaluate(params, data["x_train"], data["y_train"])
            _, accuracy = evaluate(params, data["x_test"], data["y_test"])
            report(f"  epoch {epoch:3d}  train loss {loss:.4f}  test accuracy {accuracy:.3f}")
    return time.perf_counter() - start


def report(line):
    """Print a line from a rank; on a terminal, first clear the progress bar's line (the
    parent redraws the bar below it)."""
    if sys.stdout.isatty():
        line = "\r\x1b[K" + line
    print(line, flush=True)


# -- the parent ------------------------------------------------------------------------------


def run(data, nranks, epochs, batch_size=BATCH_SIZE, lr=LEARNING_RATE):
    """Train a fresh shared model with ``nranks`` Hogwild ranks; return the results."""
    params = init_params(data["x_train"].shape[1], int(data["y_train"].max()) + 1)
    sharing.share_memory_(params)  # W and b replaced in place by shared copies
    n_train = len(data["x_train"])
    steps = epochs * sum(
        steps_per_epoch(len(shard(n_train, r, nranks)), batch_size) for r in range(nranks)
    )
    print(f"{nranks} rank{'s' if nranks > 1 else ''}, {epochs} epochs, {steps} steps:")
    start_line = procspawn.get_context("spawn").Barrier(nranks)
    start = time.perf_counter()
    train_seconds = procspawn.spawn(
        train,
        args=(nranks, params, data, start_line, epochs, batch_size, lr),
        nprocs=nranks,
        progress=steps,
    )
    wall = time.perf_counter() - start
    # the ranks wrote into params: the parent sees the trained model
    _, accuracy = evaluate(params, data["x_test"], data["y_test"])
    train_time = max(train_seconds)
    return {
        "ranks": nranks,
        "wall": wall,
        "train": train_time,
        "steps_per_s": steps / train_time,
        "accuracy": accuracy,
    }


def print_table(results):
    print()
    print("| ranks | wall s (with start-up) | train s (in ranks) | steps/s | test accuracy |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['ranks']} | {r['wall']:.2f} | {r['train']:.3f} | "
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
        f"digits: {len(data['x_train'])} training and {len(data['x_test'])} test images, "
        f"batch {BATCH_SIZE}, learning rate {LEARNING_RATE}"
    )
    results = [run(data, 1, args.epochs)]
    if args.ranks > 1:
        results.append(run(data, args.ranks, args.epochs))
    print_table(results)
    print(f"test accuracy: {results[-1]['accuracy']:.3f}")


if __name__ == "__main__":
    main()
