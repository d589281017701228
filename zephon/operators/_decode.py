"""What the decoding operators share: one field of a dict record's data in, an array out,
errors that name the sample, and ``on_error="skip"`` through tombstones (as ``filter``).

The media libraries (Pillow, PyAV) are imported when a record is first decoded, never by
``import zephon``.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from zephon.operators.base import (
    Operator,
    OpTraits,
    Output,
    PipelineContext,
    data_text,
    record_text,
)
from zephon.records import Record, Tombstone

_ON_ERROR = ("raise", "skip")
_ON_MISSING = ("error", "pass")


def media_module(op: str, module: str, package: str) -> Any:
    """``import module``, or an ImportError that names the package and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{op} needs {package}; install it with `pip install zephon[media]` (or "
            f"`pip install {package}`)"
        ) from e


class DecodeError(ValueError):
    """A member that does not decode; the message names the sample, field and cause."""


class Decode(Operator):
    """Base of ``decode_image``, ``decode_video`` and ``decode_audio``: subclasses set
    ``name``, ``what``, the decoding library (``module``, from the pip ``package``) and
    implement :meth:`decode` (bytes in, array out), which reaches the library through
    :attr:`lib`: imported where the operator runs, on its first record, never pickled."""

    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    what = "media"
    module = ""
    package = ""
    _lib: Any = None

    @property
    def lib(self) -> Any:
        if self._lib is None:
            self._lib = media_module(self.name, self.module, self.package)
        return self._lib

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lib", None)  # the module is imported where the operator runs
        return state

    def __init__(
        self,
        field: str,
        to: str | None,
        on_error: str,
        parallelism: int = 1,
        on_missing: str = "error",
    ) -> None:
        if not isinstance(field, str) or not field:
            raise TypeError(f"{self.name}(field=...) must be a non-empty str; got {field!r}")
        if to is not None and (not isinstance(to, str) or not to):
            raise TypeError(f"{self.name}(to=...) must be a non-empty str or None; got {to!r}")
        if on_error not in _ON_ERROR:
            raise ValueError(
                f"{self.name}(on_error=...) must be one of {_ON_ERROR}; got {on_error!r}"
            )
        if on_missing not in _ON_MISSING:
            raise ValueError(
                f"{self.name}(on_missing=...) must be one of {_ON_MISSING}; got {on_missing!r}"
            )
        self.field = field
        self.to = field if to is None else to
        self.on_error = on_error
        self.on_missing = on_missing
        self.parallelism = parallelism
        #: Records this process's copy left out with ``on_error="skip"`` (the pipeline's
        #: ``stats()`` shows them as the operator's records in minus records out).
        self.skipped = 0
        self.names: tuple[str, ...] = ()

    def bind(self, ctx: PipelineContext) -> None:
        self.names = tuple(ctx.names)

    def decode(self, raw: bytes) -> np.ndarray:
        raise NotImplementedError

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def process_batch(self, records: list[Record]) -> list[Output]:
        out: list[Output] = []
        for r in records:
            data = r.data
            try:
                if not isinstance(data, dict) or self.field not in data:
                    if self.on_missing == "pass":
                        out.append(r)  # a sample of another kind (a text document)
                        continue
                    raise KeyError(
                        f"{self.name}: {self._sample(r)} has no field {self.field!r} "
                        f"({data_text(data)}); read it with TarShardSource(members=...) to "
                        "fail or skip such samples at the source, pass on_error='skip' to "
                        "drop them, or on_missing='pass' to let them through undecoded (a "
                        "mixture with text)"
                    )
                raw = data[self.field]
                try:
                    array = self.decode(_as_bytes(raw))
                except ImportError:
                    raise
                except Exception as e:
                    raise DecodeError(
                        f"{self.name}: cannot decode field {self.field!r} of {self._sample(r)} "
                        f"as {self.what} ({type(e).__name__}: {e}); fix or drop the member, or "
                        "pass on_error='skip'"
                    ) from e
            except (KeyError, DecodeError):
                if self.on_error == "raise":
                    raise
                self.skipped += 1
                out.append(Tombstone(r.lane, r.contributors))
                continue
            out.append(r.replace({**data, self.to: array}))
        return out

    def _sample(self, r: Record) -> str:
        """The sample by its key, member and shard when it has them (the runner adds the
        lane and the sample pointer to every operator error), else by its cursor."""
        data = r.data
        if isinstance(data, dict) and "__key__" in data:
            key = data["__key__"]
            shard = data.get("__url__")
            where = f" of {shard}" if shard else ""
            return f"sample {key!r} (member '{key}.{self.field}'{where})"
        return record_text(r, self.names)

    def fresh(self) -> Operator:
        clone = copy.copy(self)
        clone.skipped = 0
        return clone

    def fingerprint(self) -> str:
        return repr(self)

    def _params(self) -> str:
        return f"field={self.field!r}, to={self.to!r}"

    def __repr__(self) -> str:
        missing = "" if self.on_missing == "error" else f", on_missing={self.on_missing!r}"
        return f"{type(self).__name__}({self._params()}, on_error={self.on_error!r}{missing})"


def _as_bytes(raw: Any) -> bytes:
    if isinstance(raw, bytes | bytearray | memoryview):
        return bytes(raw)
    if isinstance(raw, np.ndarray) and raw.dtype == np.uint8:
        return raw.tobytes()
    if isinstance(raw, np.bytes_):
        return bytes(raw)
    raise TypeError(f"expected the member's bytes, got {type(raw).__name__}")
