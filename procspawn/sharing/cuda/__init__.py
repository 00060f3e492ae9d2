"""GPU arrays between processes: CuPy arrays sent as the same device memory.

``zeros``/``empty`` make CuPy arrays in shareable device memory on the current device,
``share_memory_`` moves the CuPy arrays of an array or a container there, ``collect``
gives back now what this process let go of, and ``is_shared`` tells. Such an array passed
to ``spawn``, a Pool, an executor, a procspawn Queue or Pipe arrives in the other process
as a ``cupy.ndarray`` over the same memory, on the same GPU (even where the processes see
different ``CUDA_VISIBLE_DEVICES``); any other CuPy array is copied into shareable memory
at the send (small ones travel by value). See the documentation's "GPU arrays" page.

The memory is made with CUDA's virtual memory management and exported as a file
descriptor that travels inside the message (the ``cuda_fd`` strategy): the kernel and the
driver count who holds it, so it goes back when the last holder lets go or dies in any
way, and stays valid in a receiver after its maker exited.

CuPy is imported only when one of these names is first used; ``import procspawn`` never
imports it.
"""

from __future__ import annotations

from ..._lazy import lazy_names

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)

if TYPE_CHECKING:  # pragma: no cover
    from .._errors import CudaError as CudaError
    from ._arrays import collect as collect
    from ._arrays import empty as empty
    from ._arrays import is_shared as is_shared
    from ._arrays import set_ipc as set_ipc
    from ._arrays import share_memory_ as share_memory_
    from ._arrays import zeros as zeros

_LAZY = {
    "CudaError": ".._errors",
    "collect": "._arrays",
    "empty": "._arrays",
    "is_shared": "._arrays",
    "set_ipc": "._arrays",
    "share_memory_": "._arrays",
    "zeros": "._arrays",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
