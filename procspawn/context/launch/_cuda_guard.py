"""Whether this process has started CUDA, for the start methods that would break it.

CUDA copies none of its state into a forked child: a child of ``fork`` made after its
parent started CUDA fails or hangs at its first CUDA call. So ``fork`` after CUDA started
is refused at once, in the caller, naming the start methods that work; and procspawn's
fork server, whose children are forks of it, must never start CUDA itself (a child that
finds CUDA running refuses to run, naming the libraries the server had imported).

The driver opens ``/dev/nvidia-uvm`` when it starts (``cuInit``); a plain import of CuPy or
torch, and NVML (``nvidia-smi``'s library, which ``torch.cuda.is_available`` may use), do
not. So the test reads this process' descriptors, and only where a library that can start
CUDA is imported. Standard library only.
"""

from __future__ import annotations

import os
import sys

# modules through which a Python program starts CUDA
_CUDA_MODULES = ("cupy", "torch", "numba", "jax", "cuda", "procspawn.sharing.cuda._driver")


def cuda_started() -> bool:
    """Whether the CUDA driver runs in this process."""
    if not any(name in sys.modules for name in _CUDA_MODULES):
        return False
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/dev/nvidia-uvm"):
                return True
        except OSError:
            continue
    return False


def refuse_fork(what: str) -> None:
    """Raise where ``what`` would fork this process after it started CUDA.

    Raises:
        RuntimeError: CUDA runs here; the message names the start methods to use.
    """
    if cuda_started():
        raise RuntimeError(
            f"{what} cannot use start_method='fork': this process has started CUDA (a GPU "
            f"array, CuPy or torch on the GPU), and a forked child gets none of CUDA's "
            f"state: it would fail or hang at its first CUDA call. Use "
            f"start_method='forkserver' (procspawn's default) or 'spawn', or call "
            f"procspawn.set_start_method('forkserver')."
        )


def check_forked_child() -> None:
    """In a child of procspawn's fork server, before it runs anything of the user's:
    refuse to run if CUDA was running when it was forked.

    Raises:
        RuntimeError: naming the CUDA libraries the server had imported.
    """
    if cuda_started():
        loaded = [name for name in _CUDA_MODULES if name in sys.modules]
        raise RuntimeError(
            f"this process was forked by procspawn's fork server with CUDA already running "
            f"(imported: {', '.join(loaded)}): a preload module of the server "
            f"(set_forkserver_preload) or the main module's top level started CUDA, and a "
            f"forked process cannot use it. Start CUDA only inside the ranks' function or "
            f"under `if __name__ == '__main__':`, take that module out of the preload list, "
            f"or use start_method='spawn'."
        )
