"""Model, data and rank functions for bench_hogwild.py, in a module spawn children import.

The model is softmax regression on scikit-learn's digits (the demo,
``examples/hogwild.py``, now trains a wider network; this benchmark keeps the small model,
which compares the per-step cost of the three ways of sharing), standardized, 75/25
stratified split, minibatch SGD written in place into the parameters. ``train_numpy`` is
the whole training loop of a NumPy rank and runs unchanged in the procspawn ranks and in
the hand-written ``multiprocessing.shared_memory`` ranks; ``train_torch`` is the same loop
with the same arithmetic in torch ops.

Before the timed loop each rank makes ``WARMUP_STEPS`` untimed steps on a private copy of
the parameters (first-call costs: torch's lazy initialisation of its operators, NumPy's
caches), so the timed loop measures steady-state steps. Every rank writes
``(start, end, steps)`` into its row of a shared float64 ``stats``
array: ``start`` right after a ``multiprocessing`` Barrier that all ranks reach, ``end``
after its last step (``time.perf_counter()``, CLOCK_MONOTONIC on Linux: one clock for all
processes), so the parent computes the training time with process start-up excluded.

Nothing here limits BLAS threads: bench_hogwild.py sets the variables at its top, which
every spawn child runs (as ``__mp_main__``) before it imports NumPy or torch.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

BATCH_SIZE = 16
LEARNING_RATE = 0.1
SEED = 0
STATS_COLUMNS = 3  # start, end, steps
WARMUP_STEPS = 20  # untimed steps on a private copy of the parameters, before the barrier


# -- data and model -------------------------------------------------------------------------


def load_data(seed: int = SEED) -> dict[str, np.ndarray]:
    """Standardized digits, split 75/25 into train and test (stratified, fixed seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, stratify=labels, random_state=seed
    )
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0
    return {
        "x_train": ((x_train - mean) / std).astype(np.float32),
        "y_train": y_train.astype(np.int64),
        "x_test": ((x_test - mean) / std).astype(np.float32),
        "y_test": y_test.astype(np.int64),
    }


def init_params(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n_features = data["x_train"].shape[1]
    n_classes = int(data["y_train"].max()) + 1
    return {
        "W": np.zeros((n_features, n_classes), dtype=np.float32),
        "b": np.zeros(n_classes, dtype=np.float32),
    }


def probabilities(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    logits = x @ params["W"]
    logits += params["b"]
    logits -= logits.max(axis=1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=1, keepdims=True)
    return logits


def sgd_step(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> None:
    """One minibatch step, written in place (lock-free) into ``params``."""
    grad = probabilities(params, x)
    grad[np.arange(len(y)), y] -= 1.0
    grad *= lr / len(y)
    params["W"] -= x.T @ grad
    params["b"] -= grad.sum(axis=0)


def accuracy(params: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> float:
    """Test accuracy of ``params`` (NumPy arrays)."""
    logits = data["x_test"] @ params["W"] + params["b"]
    return float((logits.argmax(axis=1) == data["y_test"]).mean())


def shard(n_rows: int, rank: int, nranks: int, seed: int = SEED) -> np.ndarray:
    """The training rows of ``rank``: disjoint across ranks."""
    return np.random.default_rng(seed).permutation(n_rows)[rank::nranks]


def total_steps(n_rows: int, nranks: int, epochs: int, batch_size: int = BATCH_SIZE) -> int:
    """Minibatch updates made by all ranks together (the last, smaller batch counts)."""
    return epochs * sum(-(-len(shard(n_rows, r, nranks)) // batch_size) for r in range(nranks))


def new_stats(nranks: int) -> np.ndarray:
    return np.zeros((nranks, STATS_COLUMNS), dtype=np.float64)


# -- NumPy ranks (procspawn and hand-written SharedMemory) ---------------------------------


def train_numpy(
    rank: int,
    nranks: int,
    params: dict[str, np.ndarray],
    data: dict[str, np.ndarray],
    stats: np.ndarray,
    barrier: Any,
    epochs: int,
    batch_size: int = BATCH_SIZE,
    lr: float = LEARNING_RATE,
    tick: bool = False,
) -> None:
    """A Hogwild rank: SGD on its shard, updates written into the shared ``params``.

    ``tick`` calls ``procspawn.progress()`` after every step (the procspawn variant with
    ``--progress``); the ``if tick`` test runs in every variant, so the loops stay the same.
    """
    if tick:
        from procspawn import progress
    rows = shard(len(data["x_train"]), rank, nranks)
    x, y = data["x_train"][rows], data["y_train"][rows]
    private = {key: value.copy() for key, value in params.items()}
    for _ in range(WARMUP_STEPS):
        sgd_step(private, x[:batch_size], y[:batch_size], lr)
    rng = np.random.default_rng(SEED + 1 + rank)
    steps = 0
    barrier.wait()
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(rows))
        for begin in range(0, len(order), batch_size):
            batch = order[begin : begin + batch_size]
            sgd_step(params, x[batch], y[batch], lr)
            steps += 1
            if tick:
                progress()
    stats[rank] = (start, time.perf_counter(), steps)


def attach_shared_memory(specs: dict[str, tuple[str, tuple[int, ...], str]]) -> tuple:
    """Attach each ``multiprocessing.shared_memory`` block by name; (arrays, blocks)."""
    from multiprocessing import shared_memory

    blocks = {}
    arrays = {}
    for key, (name, shape, dtype) in specs.items():
        blocks[key] = shared_memory.SharedMemory(name=name)
        arrays[key] = np.ndarray(shape, dtype=dtype, buffer=blocks[key].buf)
    return arrays, blocks


def stdlib_rank(
    rank: int,
    nranks: int,
    specs: dict[str, tuple[str, tuple[int, ...], str]],
    barrier: Any,
    epochs: int,
    batch_size: int,
    lr: float,
) -> None:
    """A plain ``multiprocessing.Process`` rank: attach the blocks, run ``train_numpy``."""
    arrays, blocks = attach_shared_memory(specs)
    params = {key: arrays[key] for key in ("W", "b")}
    data = {key: arrays[key] for key in ("x_train", "y_train", "x_test", "y_test")}
    train_numpy(rank, nranks, params, data, arrays["stats"], barrier, epochs, batch_size, lr)
    del params, data, arrays  # no view may remain when a block is closed
    for block in blocks.values():
        block.close()


# -- torch ranks ---------------------------------------------------------------------------


def torch_sgd_step(params: dict[str, Any], x: Any, y: Any, lr: float, arange: Any) -> None:
    """``sgd_step`` in torch ops: the same explicit gradient (no autograd), the same
    in-place update. The caller holds ``torch.no_grad()`` and passes
    ``arange = torch.arange(batch_size)``."""
    weight, bias = params["W"], params["b"]
    grad = x @ weight
    grad += bias
    grad -= grad.max(dim=1, keepdim=True).values
    grad.exp_()
    grad /= grad.sum(dim=1, keepdim=True)
    grad[arange[: len(y)], y] -= 1.0
    grad *= lr / len(y)
    weight -= x.T @ grad
    bias -= grad.sum(dim=0)


def train_torch(
    rank: int,
    nranks: int,
    params: dict[str, Any],
    data: dict[str, Any],
    stats: Any,
    barrier: Any,
    epochs: int,
    batch_size: int = BATCH_SIZE,
    lr: float = LEARNING_RATE,
) -> None:
    """``train_numpy`` with torch tensors (``share_memory_()``d by the parent); the same
    shards and the same shuffles (drawn with NumPy)."""
    import torch

    torch.set_num_threads(1)
    rows = torch.from_numpy(shard(len(data["x_train"]), rank, nranks))
    x, y = data["x_train"][rows], data["y_train"][rows]
    arange = torch.arange(batch_size)
    private = {key: value.clone() for key, value in params.items()}
    rng = np.random.default_rng(SEED + 1 + rank)
    steps = 0
    with torch.no_grad():  # the updates are made by hand, in place
        for _ in range(WARMUP_STEPS):
            torch_sgd_step(private, x[:batch_size], y[:batch_size], lr, arange)
        barrier.wait()
        start = time.perf_counter()
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(len(rows)))
            for begin in range(0, len(order), batch_size):
                batch = order[begin : begin + batch_size]
                torch_sgd_step(params, x[batch], y[batch], lr, arange)
                steps += 1
    stats[rank] = torch.tensor([start, time.perf_counter(), steps], dtype=torch.float64)
