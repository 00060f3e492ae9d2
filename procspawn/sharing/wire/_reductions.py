"""NumPy arrays on the wire, a handle into a shared segment instead of the bytes.

An array is sent as ``(segment handle, byte offset, shape, strides, dtype, writeable)``.
A segment is reduced once per message, so many arrays over one segment cost one handle,
and the receiver rebuilds them over one mapping: views stay views.

* memory already in a Segment: the handle only, no copy;
* any other array of at least ``PROCSPAWN_INLINE_BYTES`` bytes (default 65536): copied
  once into a new segment (C or Fortran order, as the source), the sender's array
  untouched;
* smaller ones, zero-size ones and object dtypes: pickled as NumPy pickles them;
* a shared array of an ndarray subclass: the handle, made the subclass again on arrival
  (an unshared one is pickled as NumPy pickles it).

Two sections, one per kind of channel: procspawn's own (the descriptors ride inside the
message), and multiprocessing's (``ForkingPickler``), which cannot carry descriptors and
gets them through ``multiprocessing.reduction.DupFd`` instead. Imported by the pickler as
the NumPy plug-in (``_registry.PLUGINS``) once NumPy is imported.
"""

from __future__ import annotations

import os
import pickle
import weakref
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import numpy as np

from ... import _settings
from .. import _message, _registry
from ..segments._ndarray import array_over, copy_to_segment, layout
from ..segments._segment import segment_of
from . import _handles

# -- procspawn channels --------------------------------------------------------------------


def _reduce_ndarray(array: np.ndarray) -> Any:
    swap = _message.sending().swap_array
    if swap is not None:
        array = swap(array)
    # no bytes to share (and a reversed empty view points past its block); or references
    # to objects of this process, which no other can read (by value, even over a segment)
    if array.size == 0 or array.dtype.hasobject:
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    found = segment_of(array)
    if found is None:
        if array.nbytes < _settings.get("PROCSPAWN_INLINE_BYTES"):
            return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        array = copy_to_segment(array, for_send=True)
        found = segment_of(array)
        assert found is not None
    segment, offset, block = found
    return (
        _rebuild_ndarray,
        (_handles.segment_handle(segment), *layout(array, offset, block)),
    )


def _rebuild_ndarray(handle: _handles.Handle, *array_layout: Any) -> np.ndarray:
    """The received array: ``array_layout`` as ``array_over`` takes it."""
    return array_over(_handles.segment_from_handle(handle), *array_layout)


def _reduce_shared_subclass(array: np.ndarray) -> Any:
    """A shared array of an ndarray subclass (``np.matrix``, ``np.recarray``, one of the
    user's): as the plain array over the same memory, made the subclass again on the other
    side, with its attributes, so that writes are shared as they are for an ndarray.
    Any other goes as NumPy pickles it (a copy): a masked array's mask is private."""
    if array.size == 0 or array.dtype.hasobject or isinstance(array, np.ma.MaskedArray):
        return NotImplemented
    swap = _message.sending().swap_array
    if swap is not None:  # (a np.memmap joblib was given: one shared copy, as an ndarray)
        swapped = swap(array)
        if swapped is not array:
            return _reduce_ndarray(swapped)
    if segment_of(array) is None:
        return NotImplemented
    state = getattr(array, "__dict__", None) or None
    return (_rebuild_subclass, (array.view(np.ndarray), type(array), state))


def _rebuild_subclass(plain: np.ndarray, cls: type, state: dict[str, Any] | None) -> Any:
    array: Any = plain.view(cls)
    if state:
        array.__dict__.update(state)
    return array


_registry.register(np.ndarray, _reduce_ndarray)
_registry.subclass_reducers[np.ndarray] = _reduce_shared_subclass


# -- multiprocessing's own channels (stdlib Queue, Pipe, Pool, Process args) ---------------
#
# While a process is being started (its arguments), the start method hands each DupFd's
# descriptor to the new process. At any other time multiprocessing's resource_sharer
# thread in the sender keeps a duplicate until the receiver connects back for it, so the
# sender must still be alive when the array is received (procspawn's channels carry the
# descriptor inside the message and have no such limit). Arrays of custom strategies, and
# every array outside procspawn's segments, pickle exactly as NumPy pickles them.

_NUMPY_PROTOCOL = 4  # what ForkingPickler's default protocol gets from NumPy on 3.10-3.13
_BUILTIN_ONLY = ("file_descriptor", "file_system")


def _reduce_for_stdlib(array: np.ndarray) -> Any:
    found = None if array.dtype.hasobject else segment_of(array)
    if found is None or found[0].strategy not in _BUILTIN_ONLY or array.size == 0:
        return array.__reduce_ex__(_NUMPY_PROTOCOL)
    segment, offset, block = found
    state = _message.SendState()
    previous = _message.begin_send(state)
    try:
        handle = _handles.reduce_segment(segment)
    finally:
        _message.begin_send(previous)
    try:
        [fd] = state.fds  # one segment: always under the descriptors a message carries
        dupfd = _dupfd(fd, state.owned)
    finally:
        state.discard()  # DupFd holds a duplicate of its own now
    return (_rebuild_from_stdlib, (handle, dupfd, *layout(array, offset, block)))


class _StartFds:
    """Descriptors handed to a process being started, closed once its Popen is gone (the
    start method reads them after the pickler returns)."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def __del__(self) -> None:
        for fd in self.fds:
            os.close(fd)


_starting: weakref.WeakKeyDictionary[Any, _StartFds] = weakref.WeakKeyDictionary()


def _dupfd(fd: int, owned: list[int]) -> Any:
    popen = get_spawning_popen()
    if popen is None:
        return DupFd(fd)  # resource_sharer: a duplicate of its own each time
    # A start method refuses one descriptor twice and gives the child the same number for
    # every reference to it: one descriptor of its own per array, which the child owns.
    if fd in owned:
        owned.remove(fd)
    else:
        fd = os.dup(fd)
    start = _starting.get(popen)
    if start is None:
        start = _starting[popen] = _StartFds()
    start.fds.append(fd)
    return DupFd(fd)


def _rebuild_from_stdlib(handle: _handles.Handle, dupfd: Any, *array_layout: Any) -> np.ndarray:
    state = _message.RecvState([_detach(dupfd)])
    previous = _message.begin_receive(state)
    try:
        segment = _handles.rebuild_segment(handle)
    finally:
        _message.begin_receive(previous)
        state.close_rest()
    return array_over(segment, *array_layout)


def _detach(dupfd: Any) -> int:
    try:
        fd: int = dupfd.detach()
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"a shared array came through a multiprocessing (stdlib) channel, but its "
            f"shared-memory descriptor could not be fetched from the process that sent it "
            f"({exc}): that process has probably exited. Over stdlib channels the sender "
            f"must live until the array is received; procspawn's own channels "
            f"(procspawn.Queue, Pipe, SimpleQueue, Pool) carry the descriptor inside the "
            f"message and have no such limit.",
        ) from exc
    return fd


ForkingPickler.register(np.ndarray, _reduce_for_stdlib)
