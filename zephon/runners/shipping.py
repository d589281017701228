"""How the operators, datasets included, reach the worker processes: by reference.

The pipeline definition is pickled once with dill (so lambdas and closures work) and every
worker unpickles its own copy. Each dataset of the work source's mixture is pickled on its
own, and its data does not travel in that pickle:

- a numpy array backed by a file (``np.load(path, mmap_mode="r")``, ``np.memmap``, or a
  view of one) travels as its path and place in the file, and each worker maps the file
  again, read-only;
- any other numpy array of :data:`SHARED_ARRAY_MIN_BYTES` or more, and every large buffer
  that pickles out of band (pickle protocol 5: pyarrow tables, hence in-memory Hugging
  Face datasets, pandas frames), is copied once into one shared-memory segment (a memfd,
  see ``zephon.shm.segment``) that every worker maps read-only;
- an object whose class defines ``__zephon_reopen__`` travels as the recipe it returns
  (the reopen protocol, below);
- everything else pickles as usual. The built-in file sources hold paths and small
  indexes (the indexes' arrays go through shared memory), never their files' contents.

The operators' pickle refers to those datasets; the arrays an operator holds itself (its
state, a lookup table) are pickled by value, so each worker's copy stays writable, unless
a file is behind them (mapped again, read-only) or their class defines the protocol.

The reopen protocol: a dataset that must not be copied into the workers, or cannot be
(it holds an open connection, a client, a handle that does not pickle), says how a
worker builds its own copy::

    class SqliteSource:
        def __init__(self, path):
            self.path = path
            self.db = sqlite3.connect(path)

        def __zephon_reopen__(self):
            return SqliteSource, (self.path,)

``__zephon_reopen__()`` returns ``(factory, args)``; Zephon ships that pair instead of the
object, and each worker calls ``factory(*args)`` once, before its first batch. Both travel
by the same rules (the factory with dill, arrays in ``args`` through shared memory). The
result must read the same samples as the original: restore replays depend on it.

An object that cannot travel is a :class:`~zephon.errors.TransferError` at the first
``next()``, naming the mixture component (or the operator) and the fix.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import dill
import msgpack
import numpy as np

from zephon.errors import ShmError, TransferError
from zephon.shm.segment import Segment, create_segment

#: The method a dataset (or any object in a pipeline) defines to say how a worker rebuilds it.
REOPEN_METHOD = "__zephon_reopen__"
#: Arrays and buffers from this size on go through shared memory; smaller ones are pickled.
SHARED_ARRAY_MIN_BYTES = 64 << 10
_ALIGN = 64  # bytes: each shared buffer starts on a cache line


class Shipment:
    """The pickled operators and the dataset buffers they reference, until :meth:`place`
    copies those into shared memory.

    Attributes:
        payload: what every worker receives and gives to :func:`load_operators`.
        shared_bytes: the size of the shared segment :meth:`place` makes (0: none).
    """

    def __init__(self, payload: bytes, buffers: _Buffers) -> None:
        self.payload = payload
        self.shared_bytes = buffers.size_bytes
        self._placements = buffers.placements

    def place(self) -> Segment | None:
        """Copies the buffers into a new shared segment, sealed read-only (None when there
        are none). The caller keeps it open while the workers run and closes it at the
        end: its mapping, populated at once, keeps the copy in this process's PSS, shared
        with the workers that map it."""
        if not self._placements:
            return None
        try:
            segment = create_segment(
                self.shared_bytes, name="zephon-data", contents=self._placements
            )
        except ShmError as e:
            raise ShmError(
                e.errno,
                f"{e.strerror}. The datasets' in-memory arrays ({self.shared_bytes} bytes) are "
                "placed once in shared memory for the worker processes; memory-mapped arrays "
                "(np.load(path, mmap_mode='r')) are not copied",
            ) from e
        self._placements = []  # let go of the caller's arrays
        return segment


class _Buffers:
    """Where the out-of-band buffers of the datasets' pickles go in the shared segment;
    the same memory referenced twice is placed once."""

    def __init__(self) -> None:
        self.size_bytes = 0
        self.placements: list[tuple[int, memoryview]] = []
        self._offsets: dict[tuple[int, int], int] = {}

    def place(self, raw: memoryview) -> list[int]:
        """``[offset, nbytes]`` of ``raw`` in the segment."""
        key = (np.frombuffer(raw, np.uint8).ctypes.data, raw.nbytes)
        offset = self._offsets.get(key)
        if offset is None:
            offset = self._offsets[key] = self.size_bytes
            self.placements.append((offset, raw))
            self.size_bytes = -(-(offset + raw.nbytes) // _ALIGN) * _ALIGN
        return [offset, raw.nbytes]


class _Pickler(dill.Pickler):  # type: ignore[misc]
    """dill with the rules of this module. With ``buffers`` (a dataset's pickle) large
    arrays and buffers go out of band into them, listed in ``table`` in the order the
    pickle consumes them; without (the operators' pickle) they are pickled by value, and
    the datasets in ``datasets`` (by ``id``) become references to their own pickles."""

    def __init__(
        self, file: io.BytesIO, buffers: _Buffers | None, datasets: dict[int, int]
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._out_of_band, recurse=True)
        self._buffers = buffers
        self._datasets = datasets
        self.table: list[list[int]] = []

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if self._buffers is None or raw.nbytes < SHARED_ARRAY_MIN_BYTES:
            return True  # in band: small, or not a dataset's
        self.table.append(self._buffers.place(raw))
        return False

    def persistent_id(self, obj: Any) -> Any:
        return self._datasets.get(id(obj))

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return _reduce_array(obj, shared=self._buffers is not None)
        reopen = getattr(type(obj), REOPEN_METHOD, None)
        if reopen is not None:
            return _recipe(obj, reopen(obj))
        return NotImplemented


def _dumps(
    obj: Any, buffers: _Buffers | None, datasets: dict[int, int] | None = None
) -> tuple[bytes, list[list[int]]]:
    """``obj`` pickled, and where its out-of-band buffers are."""
    out = io.BytesIO()
    pickler = _Pickler(out, buffers, datasets or {})
    pickler.dump(obj)
    return out.getvalue(), pickler.table


class _Unpickler(dill.Unpickler):  # type: ignore[misc]
    def __init__(self, data: bytes, buffers: list[memoryview], datasets: list[Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._datasets = datasets

    def persistent_load(self, pid: Any) -> Any:
        return self._datasets[pid]


def pack_operators(ops: Sequence[Any], components: Sequence[tuple[str, Any]] = ()) -> Shipment:
    """Pickles ``ops`` for the workers, the mixture's datasets by reference: each dataset
    in a pickle of its own, its large arrays bound for shared memory; the operators in
    another, referring to the datasets (and pickling any other array by value, so that
    what an operator keeps stays writable).

    Args:
        ops: the operators, as each worker will run them.
        components: ``(name, dataset)`` of the work source's mixture.

    Raises:
        TransferError: something cannot be pickled; it names the component or the operator.
    """
    buffers = _Buffers()
    datasets: list[list[Any]] = []
    for name, dataset in components:
        try:
            datasets.append(list(_dumps(dataset, buffers)))
        except Exception as e:  # noqa: BLE001 - any pickling failure: name the dataset
            raise _component_error(name, dataset, e) from e
    index = {id(dataset): i for i, (_, dataset) in reversed(list(enumerate(components)))}
    try:
        pickled, _ = _dumps(list(ops), None, index)
    except Exception as e:  # noqa: BLE001 - any pickling failure: find out whose
        raise _operator_error(e, ops, index) from e
    payload = msgpack.packb({"datasets": datasets, "ops": pickled})
    return Shipment(payload, buffers)


def load_operators(payload: bytes, segment: Segment | None) -> list[Any]:
    """The operators from a :class:`Shipment`'s payload, the datasets' shared arrays
    mapped from ``segment`` (read-only; it must stay open while they are in use)."""
    shipped = msgpack.unpackb(payload)
    view = memoryview(segment.mmap) if segment is not None else memoryview(b"")
    datasets = []
    for pickled, table in shipped["datasets"]:
        if any(offset + nbytes > len(view) for offset, nbytes in table):
            raise ShmError(
                f"a dataset's arrays lie beyond the shared segment ({len(view)} bytes): the "
                "segment that came is not the one the pipeline was packed with"
            )
        buffers = [view[offset : offset + nbytes] for offset, nbytes in table]
        datasets.append(_Unpickler(pickled, buffers, []).load())
    ops: list[Any] = _Unpickler(shipped["ops"], [], datasets).load()
    return ops


# ----------------------------------------------------------------------------- arrays
def _reduce_array(a: np.ndarray, shared: bool) -> Any:
    if a.nbytes < SHARED_ARRAY_MIN_BYTES or a.dtype.hasobject:
        return NotImplemented  # pickled by value
    mapped = _mapped_file(a)
    if mapped is not None:
        return mapped
    if not shared:  # by value; a memory map without a file as the plain array it maps
        return (np.array, (a.view(np.ndarray),)) if isinstance(a, np.memmap) else NotImplemented
    if type(a) is not np.ndarray and not isinstance(a, np.memmap):
        return NotImplemented  # a subclass with its own state (masked arrays, ...)
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        a = np.ascontiguousarray(a)
    order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    # Its bytes in memory order, as uint8: every dtype (datetime64 too) exports those.
    raw = a.reshape(-1, order="A").view(np.uint8).data
    return _shared_array, (pickle.PickleBuffer(raw), a.dtype, a.shape, order)


def _shared_array(buffer: Any, dtype: np.dtype, shape: tuple[int, ...], order: str) -> np.ndarray:
    """A worker's view of an array placed in shared memory (read-only there)."""
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)  # type: ignore[call-overload, no-any-return]


def _mapped_file(a: np.ndarray) -> Any:
    """How a worker maps the file behind ``a`` again, or None when no file is behind it."""
    root: Any = a
    while root is not None and not (
        isinstance(root, np.memmap) and isinstance(root.base, mmap.mmap)
    ):
        root = root.base
    if root is None or root.filename is None:
        return None
    low, high = _byte_bounds(a)
    stat = os.stat(root.filename)
    file_offset = root.offset + (low - root.ctypes.data)
    args = (root.filename, (stat.st_dev, stat.st_ino), file_offset, high - low)
    return _reopen_mapped, (*args, a.dtype, a.shape, a.strides, a.ctypes.data - low)


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    """The first and one past the last byte address ``a`` touches (any strides)."""
    low = high = a.ctypes.data
    for dim, stride in zip(a.shape, a.strides, strict=True):
        reach = (dim - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + a.itemsize


def _reopen_mapped(
    path: str,
    identity: tuple[int, int],
    file_offset: int,
    span_bytes: int,
    dtype: np.dtype,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    start: int,
) -> np.ndarray:
    """A worker's read-only view of ``path`` where the parent's memory-mapped array was."""
    fix = (
        "worker processes map a memory-mapped array's file again: keep the file in place, "
        "unchanged, while the pipeline runs"
    )
    try:
        stat = os.stat(path)
    except OSError as e:
        raise FileNotFoundError(f"memory-mapped array file {path} is gone ({e}); {fix}") from e
    if (stat.st_dev, stat.st_ino) != tuple(identity):
        raise FileNotFoundError(f"memory-mapped array file {path} was replaced by another; {fix}")
    if stat.st_size < file_offset + span_bytes:
        raise ValueError(
            f"memory-mapped array file {path} holds {stat.st_size} bytes but the array "
            f"spans bytes {file_offset}..{file_offset + span_bytes}; {fix}"
        )
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=file_offset, shape=(span_bytes,))
    return np.ndarray(shape, dtype, buffer=mapped, offset=start, strides=strides)


# ------------------------------------------------------------------- reopen protocol
def _recipe(obj: Any, recipe: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if (
        not isinstance(recipe, tuple)
        or len(recipe) != 2
        or not callable(recipe[0])
        or not isinstance(recipe[1], tuple | list)
    ):
        raise TypeError(
            f"{type(obj).__name__}.{REOPEN_METHOD}() must return (factory, args): a callable "
            f"and a tuple of arguments, so that a worker rebuilds it as factory(*args); "
            f"got {_short_repr(recipe)}"
        )
    return recipe[0], tuple(recipe[1])


# ---------------------------------------------------------------------------- errors
def _short_repr(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _component_error(name: str, dataset: Any, error: Exception) -> TransferError:
    cls = type(dataset).__name__
    return TransferError(
        f"mixture component {name!r} ({_short_repr(dataset)}) cannot be sent to the worker "
        f"processes: {type(error).__name__}: {error}. Give {cls} a {REOPEN_METHOD}(self) "
        "method returning (factory, args), so that each worker builds its own copy as "
        f"factory(*args) (e.g. `return {cls}, (self.path,)`), or use Pipeline(workers=0)"
    )


def _operator_error(
    error: Exception, ops: Sequence[Any], datasets: dict[int, int]
) -> TransferError:
    """The error naming the operator that cannot be pickled (tried one by one)."""
    for position, op in enumerate(ops):
        try:
            _dumps(op, None, datasets)
        except Exception as e:  # noqa: BLE001 - this is the one
            return TransferError(
                f"operator {getattr(op, 'name', type(op).__name__)!r} (position {position}, "
                f"{_short_repr(op)}) cannot be sent to the worker processes: "
                f"{type(e).__name__}: {e}. Workers get the pipeline pickled with dill: create "
                "what does not pickle (a socket, a database connection) inside the function on "
                f"first use, give its class a {REOPEN_METHOD}(self) method returning "
                "(factory, args), or use Pipeline(workers=0)"
            )
    return TransferError(
        f"the pipeline cannot be sent to the worker processes ({type(error).__name__}: "
        f"{error}); use Pipeline(workers=0) or make what it holds picklable"
    )
