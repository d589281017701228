"""PyTorch: a pipeline whose batches are tensors (no copy) and whose state is a
``torch.distributed.checkpoint`` (DCP) ``Stateful``, saved next to model and optimizer.

::

    import torch.distributed.checkpoint as dcp
    import zephon.torch as zt

    loader = zt.Loader(build(rank=dist.get_rank(), world_size=dist.get_world_size()))
    for step, batch in enumerate(loader, 1):       # {"tokens": torch.Tensor, ...}
        ...
        if step % 100 == 0:
            dcp.save({"model": model_sd, "optim": optim_sd, "loader": loader},
                     checkpoint_id=f"ckpt/step-{step}")

    loader = zt.Loader(build(...))                 # fresh, before next()
    dcp.load({"model": model_sd, "optim": optim_sd, "loader": loader},
             checkpoint_id="ckpt/step-100", planner=zt.LoadPlanner())

``import zephon`` never imports torch; this module does.

**Batches.** :func:`to_tensors` turns each array of a batch into a tensor with
``torch.from_numpy``: the tensor is the array's memory, nothing is copied. A pipeline hands
out arrays the caller owns (``zero_copy=False``, the default): the tensors stay valid for as
long as they are kept. With ``Pipeline(..., zero_copy=True)`` the arrays are views into a
worker's shared-memory ring slot, and that slot goes back to the worker at the next
``next()``: a batch's tensors are then valid only until the loop asks for the next batch:
copy them to the device (a blocking ``.to(device)``) or ``.clone()`` them before that, and
never keep one across steps. Every numeric dtype becomes the torch dtype of the same name
(bool, int8-64, uint8-64, float16/32/64, complex64/128), and ``ml_dtypes``' bfloat16 and
float8 types become torch's (a view of the same bytes). Three layouts torch cannot share are
copied: a read-only array (torch tensors are writable), negative strides, a non-native byte
order. Strings, bytes, objects and datetimes have no tensor type: a :class:`TypeError` names
the feature.

**State.** ``Loader.state_dict()`` is this rank's loader state
(:meth:`~zephon.Pipeline.local_checkpoint`: at the last batch the loop received) as the
files of :mod:`zephon.checkpoint.layout`, one uint8 tensor per file, keyed by file name:
``loader.zph`` for a job of one rank, ``process_<i>-of-<n>.zph`` for rank ``i`` of ``n``.
Under DCP's key for the loader (``"loader"`` above) these become ``loader.loader.zph``,
``loader.process_0-of-2.zph``, ...: distinct on every rank, so DCP, which writes each rank's
entries and deduplicates equal keys across ranks, never drops or mixes two ranks' states.
The bytes are Zephon's format (msgpack + zstd with a checksum). DCP writes a tensor with
``torch.save`` and reads it with ``torch.load(weights_only=True)``, which loads tensors and
nothing else; it pickles only non-tensor values (and unpickles them with
``weights_only=False``), and there are none. No checkpoint round runs (``aggregate_dir``/
``aggregate_store`` are not used): DCP's save is itself collective and commits once, its
metadata written after every rank's data.

**Restore** needs ``planner=zt.LoadPlanner()`` in ``dcp.load``. DCP loads in place into
tensors of the sizes ``state_dict()`` gives, and a loader state has no fixed size (it
carries the chunks in flight); and a rank restoring with another number of ranks needs
the other ranks' entries. The planner (a ``DefaultLoadPlanner``; it takes its arguments)
sees the checkpoint's metadata and asks for the entries this rank needs at their saved
sizes: every rank's state, merged (:func:`~zephon.checkpoint.state.merge_states`), so a
checkpoint of any number of ranks restores on any number. Without it DCP refuses with
``Size mismatch between saved ... and current ... for loader.<file>``.

Outside DCP the state dict is a plain dict of tensors:
``torch.save(loader.state_dict(), f"loader-{rank}.pt")`` and
``loader.load_state_dict(torch.load(path, weights_only=True))`` restore that rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zephon.checkpoint.layout import MemoryFiles, files_to_read, files_to_write, read_state
from zephon.errors import CheckpointError
from zephon.pipeline.pipeline import Pipeline

__all__ = ["LoadPlanner", "Loader", "to_tensors"]

#: ml_dtypes' types (as numpy dtypes of JAX) that torch has under the same name
_SAME_BYTES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16}


class Loader:
    """A pipeline that yields batches as torch tensors and is a DCP ``Stateful``.

    Args:
        pipeline: the :class:`~zephon.Pipeline` (build it with this rank's ``rank`` and
            ``world_size``, and ``dp_rank``/``dp_size`` with model parallelism).

    Iterating it iterates the pipeline (``break`` and a later loop go on with the same
    stream), each batch through :func:`to_tensors`. ``state_dict()`` /
    ``load_state_dict()`` are the ``torch.distributed.checkpoint.stateful.Stateful``
    protocol (see the module docstring for what they hold, and for ``LoadPlanner``).
    """

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def __iter__(self) -> Iterator[Any]:
        iter(self.pipeline)  # raises PipelineEndedError for a pipeline at its end
        return self

    def __next__(self) -> Any:
        return to_tensors(next(self.pipeline))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's loader state at the last batch returned: ``{file name: uint8
        tensor}`` (a copy; the loader may go on)."""
        files = files_to_write(self.pipeline.local_checkpoint(), primary_host=None)
        entries = _Entries([int(x) for x in self.pipeline.lanes])
        out = {}
        for name, blob in files.items():
            out[name] = _mark(torch.frombuffer(bytearray(blob), dtype=torch.uint8), entries, name)
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restores the pipeline (freshly built, before its first ``next()``) from
        ``state_dict``: what :class:`LoadPlanner` read in a ``dcp.load``, or a state dict
        given directly.

        Raises:
            CheckpointError: no loader state in it, a corrupt entry, or one the pipeline
                rejects (see :meth:`Pipeline.restore`).
        """
        entries = next((m[0] for t in state_dict.values() if (m := _mark_of(t))), None)
        if entries is not None and entries.read is not None:  # LoadPlanner read them
            blobs, label = entries.read, entries.label
        else:  # given directly (or DCP loaded our own entries at the sizes they had)
            blobs, label = dict(state_dict), "loader state dict entry "
        files = MemoryFiles({k: _bytes_of(k, t) for k, t in blobs.items()}, label)
        self.pipeline.restore(read_state(files, self.pipeline.lanes))

    def close(self) -> None:
        """Closes the pipeline."""
        self.pipeline.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Loader({self.pipeline!r})"


class LoadPlanner(DefaultLoadPlanner):
    """The ``dcp.load`` planner for a state dict holding :class:`Loader` entries: it
    reads each loader's entries at their saved sizes (every rank's, merged on restore,
    or of ``loader.zph`` the index and the lane shards this rank owns), and otherwise
    plans as ``DefaultLoadPlanner(**kwargs)`` does.

    Raises:
        ValueError: ``flatten_state_dict=False`` (the loader's entries are found among
            the flattened keys).
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("flatten_state_dict") is False:
            raise ValueError(
                "zephon.torch.LoadPlanner needs flatten_state_dict=True (the default): "
                "it finds the loader's entries among the flattened keys"
            )
        super().__init__(**kwargs)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        # Each loader's state_dict() entries, found by their mark, give way to the entries
        # the checkpoint holds under the same key.
        prefixes: dict[int, tuple[_Entries, str]] = {}
        for fqn, obj in list(self.state_dict.items()):
            mark = _mark_of(obj)
            if mark is None:
                continue
            entries, name = mark
            prefixes[id(entries)] = (entries, fqn[: len(fqn) - len(name)])  # "loader."
            del self.state_dict[fqn]
        saved = metadata.state_dict_metadata
        for entries, prefix in prefixes.values():
            ours = {
                key[len(prefix) :]: md
                for key, md in saved.items()
                if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
            }
            entries.read = {}
            entries.label = f"checkpoint entry {prefix}"
            for name in files_to_read(ours, entries.lanes):
                md = ours[name]
                if md.properties.dtype != torch.uint8 or len(md.size) != 1:
                    raise CheckpointError(
                        f"checkpoint entry {prefix}{name} is a {md.properties.dtype} tensor of "
                        f"shape {tuple(md.size)}; a Zephon loader entry is 1-D uint8"
                    )
                t = torch.empty(md.size, dtype=torch.uint8)
                self.state_dict[prefix + name] = t
                entries.read[name] = t


class _Entries:
    """A loader's state_dict() entries, as the planner finds them: the lanes the rank
    owns, and the entries read for it."""

    __slots__ = ("label", "lanes", "read")

    def __init__(self, lanes: list[int]) -> None:
        self.lanes = lanes
        self.read: dict[str, torch.Tensor] | None = None
        self.label = ""


#: id(tensor) -> (a weak reference to it, its loader's entries, its file name): the
#: tensors of state_dict(), for LoadPlanner to find. Not an attribute of the tensor:
#: torch.save would pickle that with it.
_MARKS: dict[int, tuple[weakref.ref[torch.Tensor], _Entries, str]] = {}


def _mark(t: torch.Tensor, entries: _Entries, name: str) -> torch.Tensor:
    _MARKS[id(t)] = (weakref.ref(t), entries, name)
    weakref.finalize(t, _MARKS.pop, id(t), None)
    return t


def _mark_of(obj: Any) -> tuple[_Entries, str] | None:
    m = _MARKS.get(id(obj))
    if m is None or m[0]() is not obj:
        return None
    return m[1], m[2]


def _bytes_of(name: str, t: torch.Tensor) -> memoryview:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CheckpointError(
            f"loader state entry {name!r} is {type(t).__name__}"
            + (f" {t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else "")
            + "; a Zephon loader entry is a 1-D uint8 tensor"
        )
    return t.detach().cpu().contiguous().numpy().data


# ------------------------------------------------------------------------------- batches


def to_tensors(batch: Any) -> Any:
    """``batch`` with every numpy array turned into a tensor over the same memory (dicts,
    lists and tuples are walked; other values are kept). See the module docstring for
    dtypes, the copied layouts and how long a ``zero_copy`` batch's tensors are valid.

    Raises:
        TypeError: an array of a dtype torch has no tensor type for (strings, bytes,
            objects, datetimes), naming its feature.
    """
    return _convert(batch, "batch")


def _convert(value: Any, where: str) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return _tensor(np.asarray(value), where)
    if isinstance(value, dict):
        return {k: _convert(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_convert(v, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def _tensor(a: np.ndarray, where: str) -> torch.Tensor:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if any(s < 0 for s in a.strides) or not a.flags.writeable:
        a = np.array(a)  # a copy torch can share: positive strides, writable
    name = a.dtype.name
    if name in _SAME_BYTES and a.dtype.itemsize in _UINT_OF_SIZE:
        return torch.from_numpy(a.view(_UINT_OF_SIZE[a.dtype.itemsize])).view(getattr(torch, name))
    try:
        return torch.from_numpy(a)
    except TypeError as e:
        raise TypeError(
            f"zephon.torch: {where} is a numpy array of dtype {a.dtype}, which has no torch "
            "tensor type (torch takes bool, int8-64, uint8-64, float16/32/64, complex64/128, "
            "bfloat16 and float8); drop the feature before the batch reaches the loader "
            "(a .map() that leaves it out) or encode it as numbers"
        ) from e
