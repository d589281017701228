"""The checkpoint file format: a fixed header, then a zstd frame of msgpack.

Layout (little endian)::

    offset  size  field
         0     8  magic b"ZEPHONCK"
         8     4  format version (u32, currently 1)
        12     4  flags (u32, must be 0)
        16     8  uncompressed length (u64): bytes of msgpack inside the zstd frame
        24     8  payload length (u64): bytes of the zstd frame that follows the header
        32    32  sha256 of the payload
        64     -  payload: one zstd frame (content size and checksum written) of msgpack

A checkpoint is never trusted on load: every header field is checked before the payload is
touched, the declared size is capped by ``max_bytes`` before anything is allocated, and each
failure is a :class:`~zephon.errors.CheckpointError` whose message says which check failed,
with the values. Every bit of the file is covered: a flip in the header fails the magic,
version, flags, length or checksum check, and a flip in the payload fails the sha256. Nothing
here pickles or evaluates: what a state may hold (plain msgpack values), checked before
writing and after decoding, is :mod:`zephon.checkpoint.plain`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgpack
import zstandard

from zephon.checkpoint.atomic import atomic_write_bytes, remove_stale_temps
from zephon.checkpoint.plain import check_decoded, check_writable, reject_ext
from zephon.checkpoint.state import FORMAT_VERSION, ROUND
from zephon.errors import CheckpointError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "dumps",
    "load",
    "loads",
    "peek_header",
    "save",
]

MAGIC = b"ZEPHONCK"
DEFAULT_MAX_BYTES = 1 << 30

_HEADER = struct.Struct("<8sIIQQ32s")
HEADER_SIZE = _HEADER.size  # 64
_FLAGS = 0
_MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL


@dataclass(frozen=True)
class _Header:
    version: int
    flags: int
    uncompressed_bytes: int
    payload_bytes: int
    sha256: bytes


# ---------------------------------------------------------------------------------- writing


def dumps(state: dict[str, Any], *, level: int = 3) -> bytes:
    """Serialise a checkpoint state to the file format.

    Args:
        state: a dict with str keys whose values are None, bool, int (64-bit), float, str,
            bytes, list or dict, nested.
        level: zstd compression level, 1 to 22.

    Returns:
        The header followed by the compressed payload.

    Raises:
        CheckpointError: ``state`` holds something the format cannot round-trip exactly (a
            tuple, a non-str key, a numpy scalar, an int over 64 bits, a cycle); the message
            names where.
        ValueError: ``level`` is out of range.
    """
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= _MAX_LEVEL:
        raise ValueError(f"zstd level must be an int in 1..{_MAX_LEVEL}; got {level!r}")
    check_writable(state)
    raw = msgpack.packb(state, use_bin_type=True)
    payload = zstandard.ZstdCompressor(
        level=level, write_checksum=True, write_content_size=True
    ).compress(raw)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, _FLAGS, len(raw), len(payload), hashlib.sha256(payload).digest()
    )
    return header + payload


def save(path: str | os.PathLike[str], state: dict[str, Any], *, level: int = 3) -> int:
    """Write a checkpoint state to ``path`` atomically (temp file, fsync, rename, fsync dir),
    creating missing parent directories.

    A crash at any point leaves either the old file or the new one at ``path``.

    A follower's share of a checkpoint round (:class:`zephon.checkpoint.share.Share`, what
    ``Pipeline.checkpoint()`` returns on every rank but 0) is saved as the whole merged
    state it is a share of, read from the round's store, so the file restores on any rank
    and any world size.

    Returns:
        The number of bytes written.

    Raises:
        CheckpointError: ``state`` cannot be serialised (see :func:`dumps`), or it is a
            share whose merged state the store no longer holds; nothing is written.
        OSError: the file cannot be written (a full disk, no permission, a file where a
            directory must be); ``path`` is untouched, no temp file remains, and the error
            names ``path`` (as its ``filename``).
    """
    from zephon.checkpoint.share import complete

    # What a save killed midway left in this directory (its writer is gone) goes first.
    remove_stale_temps(os.path.dirname(os.path.abspath(os.fspath(path))))
    try:
        return atomic_write_bytes(path, dumps(complete(state), level=level), make_parents=True)
    except (OSError, CheckpointError) as e:
        committed = state.get(ROUND) if isinstance(state, dict) else None
        if isinstance(committed, dict):
            e.add_note(
                f"checkpoint round {committed.get('round_id')} (step {committed.get('step')})"
                " committed on every rank: the state is good and only this save failed."
                " Save it again once the cause is fixed (or save another rank's result)"
            )
        raise


# ---------------------------------------------------------------------------------- reading


def peek_header(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Read a checkpoint's header without checking or decoding the payload.

    Only the length and the magic are checked, so this also describes files from newer
    format versions (for ``zephon inspect``).

    Args:
        blob: the file's bytes; the first :data:`HEADER_SIZE` are enough.

    Returns:
        ``{"format_version", "flags", "uncompressed_bytes", "payload_bytes",
        "payload_sha256"}`` (the last as a hex string).

    Raises:
        CheckpointError: too short for a header, or not a Zephon checkpoint.
    """
    h = _unpack_header(_as_bytes_view(blob))
    return {
        "format_version": h.version,
        "flags": h.flags,
        "uncompressed_bytes": h.uncompressed_bytes,
        "payload_bytes": h.payload_bytes,
        "payload_sha256": h.sha256.hex(),
    }


def loads(
    blob: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, Any]:
    """Decode and verify a checkpoint produced by :func:`dumps`.

    Args:
        blob: the whole file.
        max_bytes: refuse checkpoints declaring more uncompressed bytes than this, before
            allocating anything for them.

    Returns:
        The state dict.

    Raises:
        CheckpointError: truncated, not a checkpoint, unsupported version or flags, over
            ``max_bytes``, trailing garbage, corrupt (checksum, zstd, msgpack), or not a
            dict with str keys. The message says which, with the values.
    """
    _check_max_bytes(max_bytes)
    view = _as_bytes_view(blob)
    header = _parse_header(view, max_bytes)
    payload = view[HEADER_SIZE:]
    _check_payload_length(header, len(payload))
    _check_payload_bound(header)
    return _decode(header, payload)


def load(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Read and verify the checkpoint at ``path`` (see :func:`loads`).

    The header is checked before the payload is read, so a hostile or wrong file (a huge
    one included) is rejected without reading it into memory.

    Raises:
        CheckpointError: the file does not exist or cannot be read, or any :func:`loads`
            check fails; the message starts with the path.
    """
    _check_max_bytes(max_bytes)
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            return _read_file(f, max_bytes)
    except FileNotFoundError as e:
        raise CheckpointError(f"{name}: checkpoint file does not exist") from e
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read checkpoint: {e.strerror or e}") from e
    except CheckpointError as e:
        raise CheckpointError(f"{name}: {e}") from e


def _read_file(f: BinaryIO, max_bytes: int) -> dict[str, Any]:
    st = os.fstat(f.fileno())
    header = _parse_header(memoryview(f.read(HEADER_SIZE)), max_bytes)
    if stat.S_ISREG(st.st_mode):
        # Judge the length by the size on disk, before reading (or allocating) anything.
        _check_payload_length(header, st.st_size - HEADER_SIZE)
    _check_payload_bound(header)
    # The read is now bounded by zstd's bound on max_bytes; the +1 notices a file that grew
    # since fstat (or a pipe with more) without reading all of it.
    payload = f.read(header.payload_bytes + 1)
    _check_payload_length(header, len(payload))
    return _decode(header, memoryview(payload))


def _check_max_bytes(max_bytes: int) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0; got {max_bytes!r}")


def _as_bytes_view(blob: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(blob)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    return memoryview(view.tobytes())  # hashlib and zstd need flat contiguous bytes


def _unpack_header(view: memoryview) -> _Header:
    if len(view) < HEADER_SIZE:
        raise CheckpointError(f"truncated: {len(view)} bytes, header needs {HEADER_SIZE}")
    magic, version, flags, uncompressed, payload, sha = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CheckpointError(f"not a Zephon checkpoint: magic {magic!r} (expected {MAGIC!r})")
    return _Header(version, flags, uncompressed, payload, sha)


def _parse_header(view: memoryview, max_bytes: int) -> _Header:
    h = _unpack_header(view)
    if h.version != FORMAT_VERSION:
        fix = "upgrade zephon" if h.version > FORMAT_VERSION else "the header is corrupt"
        raise CheckpointError(
            f"format version {h.version} is not supported by this Zephon"
            f" (supports {FORMAT_VERSION}); {fix}"
        )
    if h.flags != _FLAGS:
        raise CheckpointError(
            f"unsupported flags {h.flags:#010x} (this Zephon supports {_FLAGS:#010x});"
            " the header is corrupt or was written by a newer zephon"
        )
    if h.uncompressed_bytes > max_bytes:
        raise CheckpointError(
            f"declares {_human(h.uncompressed_bytes)} uncompressed ({h.uncompressed_bytes} bytes),"
            f" over the max_bytes limit of {_human(max_bytes)} ({max_bytes} bytes);"
            f" pass max_bytes= to allow it"
        )
    return h


def _check_payload_length(h: _Header, actual: int) -> None:
    if actual < h.payload_bytes:
        raise CheckpointError(f"truncated: payload has {actual} of {h.payload_bytes} bytes")
    if actual > h.payload_bytes:
        raise CheckpointError(
            f"trailing garbage: {actual - h.payload_bytes} unexpected bytes after the payload"
            f" ({h.payload_bytes} declared)"
        )


def _check_payload_bound(h: _Header) -> None:
    bound = _zstd_bound(h.uncompressed_bytes)
    if h.payload_bytes > bound:
        raise CheckpointError(
            f"corrupt: header declares a {h.payload_bytes}-byte payload for"
            f" {h.uncompressed_bytes} uncompressed bytes; zstd never needs more than {bound}"
        )


def _zstd_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND(n) (frame header and checksum included), plus slack."""
    small = (128 * 1024 - n) >> 11 if n < 128 * 1024 else 0
    return n + (n >> 8) + small + 64


def _decode(h: _Header, payload: memoryview) -> dict[str, Any]:
    actual_sha = hashlib.sha256(payload).digest()
    if actual_sha != h.sha256:
        raise CheckpointError(
            f"corrupt: checksum mismatch (header sha256 {h.sha256.hex()[:16]}…,"
            f" payload sha256 {actual_sha.hex()[:16]}…)"
        )
    # The sha256 only catches accidents; a crafted file carries a matching one. So the frame
    # must also agree with the header before zstd allocates its declared content size.
    try:
        frame = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as e:
        raise CheckpointError(f"corrupt: zstd frame header: {e}") from e
    if frame.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise CheckpointError("corrupt: zstd frame does not record its content size")
    if frame.content_size != h.uncompressed_bytes:
        raise CheckpointError(
            f"corrupt: zstd frame declares {frame.content_size} bytes,"
            f" header declares {h.uncompressed_bytes}"
        )
    if not frame.has_checksum or frame.dict_id != 0:
        raise CheckpointError(
            f"corrupt: zstd frame has checksum={frame.has_checksum} dict_id={frame.dict_id};"
            " Zephon writes checksum=True dict_id=0"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            payload, max_output_size=h.uncompressed_bytes, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise CheckpointError(f"corrupt: zstd {e}") from e
    if len(raw) != h.uncompressed_bytes:
        raise CheckpointError(
            f"corrupt: decompressed {len(raw)} bytes, header declares {h.uncompressed_bytes}"
        )
    n = len(raw)
    try:
        state = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=n,
            max_str_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
            ext_hook=reject_ext,
        )
    except Exception as e:  # any failure to decode untrusted bytes is corruption
        detail = str(e) or "malformed data"  # msgpack's FormatError has no message
        raise CheckpointError(f"corrupt: msgpack {type(e).__name__}: {detail}") from e
    if not isinstance(state, dict):
        raise CheckpointError(
            f"not a checkpoint state: top level is {type(state).__name__}, expected dict"
        )
    # msgpack's strict_map_key still admits bytes keys, and a crafted file can nest too deep.
    check_decoded(state)
    return state


_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _human(n: int) -> str:
    """``5368709120`` -> ``"5 GiB"``, ``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
