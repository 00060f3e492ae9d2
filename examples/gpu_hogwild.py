"""Hogwild training on the GPU with CuPy: N processes update one shared model, lock-free.

The model of ``examples/hogwild.py`` (one hidden layer of 2,048 ReLU units, 153,610
float32 parameters, scikit-learn's bundled digits), with its parameters in shareable
device memory: ``procspawn.sharing.cuda.zeros`` makes one flat CuPy array, the weights are
views of it. Each rank of ``procspawn.spawn(train, ..., nprocs=N)`` gets the same device
memory (not a copy: the array travels as a file descriptor of the memory), runs minibatch
SGD on its shard of the training set and writes every update straight into the shared
weights (``W -= lr * grad``) on the GPU, with no lock and no message. The parent then
tests the model the ranks trained together.

Where there is no GPU (or no CuPy), it says so and exits 0.

Run::

    pip install -e '.[examples]' cupy-cuda13x     # or cupy-cuda12x, for your CUDA
    python examples/gpu_hogwild.py [--ranks N] [--epochs E] [--quick]
"""

import argparse
import sys
import time

import numpy as np

import procspawn

HIDDEN = 2048


def _gpu() -> str | None:
    """The GPU's name, or None (and why, printed) when there is none to use."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device is visible")
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # no CuPy, no driver, no device
        print(f"no GPU to train on here ({type(exc).__name__}: {exc}): nothing to do")
        return None


def layout(n_in: int, n_out: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Where each parameter lies in the flat buffer: name -> (offset, shape)."""
    shapes = {"W1": (n_in, HIDDEN), "b1": (HIDDEN,), "W2": (HIDDEN, n_out), "b2": (n_out,)}
    places, offset = {}, 0
    for name, shape in shapes.items():
        places[name] = (offset, shape)
        offset += int(np.prod(shape))
    return places


def views(flat, places):
    """The parameters as views of the one shared buffer."""
    return {
        name: flat[offset : offset + int(np.prod(shape))].reshape(shape)
        for name, (offset, shape) in places.items()
    }


def forward(p, x):
    import cupy

    hidden = cupy.maximum(x @ p["W1"] + p["b1"], 0)
    return hidden, hidden @ p["W2"] + p["b2"]


def train(rank, flat, places, x, y, epochs, lr, batch):
    """One rank: SGD on its shard, every update written into the shared parameters."""
    import cupy

    from procspawn.sharing import cuda

    assert cuda.is_shared(flat)  # the parent's memory, not a copy
    p = views(flat, places)
    rng = np.random.default_rng(rank)
    started = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch):
            pick = cupy.asarray(order[start : start + batch])
            xb, yb = x[pick], y[pick]
            hidden, logits = forward(p, xb)
            logits -= logits.max(axis=1, keepdims=True)
            probs = cupy.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            probs[cupy.arange(len(yb)), yb] -= 1  # d(loss)/d(logits), mean taken below
            probs /= len(yb)
            grad_hidden = (probs @ p["W2"].T) * (hidden > 0)
            # Hogwild: straight into the shared memory, no lock
            p["W2"] -= lr * (hidden.T @ probs)
            p["b2"] -= lr * probs.sum(axis=0)
            p["W1"] -= lr * (xb.T @ grad_hidden)
            p["b1"] -= lr * grad_hidden.sum(axis=0)
    cupy.cuda.get_current_stream().synchronize()  # the parent reads the weights after
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a short run (3 epochs)")
    options = parser.parse_args()
    device = _gpu()
    if device is None:
        return 0
    import cupy
    from sklearn.datasets import load_digits

    from procspawn.sharing import cuda

    epochs = 3 if options.quick else options.epochs
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(images))
    test, training = order[:360], order[360:]
    places = layout(images.shape[1], 10)
    total = sum(int(np.prod(shape)) for _, shape in places.values())
    flat = cuda.zeros(total, dtype=np.float32)  # shareable device memory
    p = views(flat, places)
    rng = np.random.default_rng(1)
    p["W1"][...] = cupy.asarray(rng.normal(0, 0.05, p["W1"].shape), dtype=cupy.float32)
    p["W2"][...] = cupy.asarray(rng.normal(0, 0.05, p["W2"].shape), dtype=cupy.float32)
    cupy.cuda.get_current_stream().synchronize()

    shards = np.array_split(training, options.ranks)
    # each rank gets its shard of the images on the GPU (copies: they are only read)
    args = [(cupy.asarray(images[s]), cupy.asarray(digits.target[s])) for s in shards]
    print(f"GPU: {device}; {total:,} parameters in one shareable block; {options.ranks} ranks")
    started = time.perf_counter()
    seconds = procspawn.spawn(
        _rank,
        args=(flat, places, args, epochs),
        nprocs=options.ranks,
        timeout=600,
    )
    wall = time.perf_counter() - started
    _, logits = forward(p, cupy.asarray(images[test]))
    accuracy = float((logits.argmax(axis=1).get() == digits.target[test]).mean())
    print(f"training in the ranks: {max(seconds):.2f} s; wall time with start-up: {wall:.2f} s")
    print(f"test accuracy: {accuracy:.3f}")
    return 0


def _rank(rank, flat, places, shards, epochs):
    x, y = shards[rank]
    return train(rank, flat, places, x, y, epochs, lr=0.1, batch=32)


if __name__ == "__main__":
    sys.exit(main())
