"""The checkpoint file format: round trips, atomic save, and one test per way a file can be
wrong, asserting on the message that says which."""

from __future__ import annotations

import hashlib
import math
import os
import stat
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon.checkpoint.io import (
    DEFAULT_MAX_BYTES,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    dumps,
    load,
    loads,
    peek_header,
    save,
)
from zephon.errors import CheckpointError

# The layout is written out here, independently of the implementation, so a change to it
# fails these tests instead of silently changing the format.
LAYOUT = struct.Struct("<8sIIQQ32s")

STATE: dict[str, Any] = {
    "format_version": 1,
    "fingerprint": b"\x00\xff" * 16,
    "round_robin": 3,
    "lanes": [
        {
            "in_flight": [
                {"chunk": 0, "offsets": [0, 1, 2], "done": b"\x07", "epoch": 0},
                {"chunk": 1, "offsets": [], "done": b"", "epoch": 1},
            ],
            "boundaries": [0, 17, 2**63 - 1],
            "cursor": {"epoch": -1, "index": -(2**63), "unsigned": 2**64 - 1},
            "work_source": {"seed": 1234, "weights": [0.25, 0.75, -1.5e300], "name": "mix"},
            "progress": None,
            "finished": False,
        },
        {"in_flight": [], "nested": [[[], {}], [[None]]], "unicode": "zéphon ✓", "flag": True},
    ],
}


def envelope(
    raw: bytes | None = None,
    *,
    payload: bytes | None = None,
    magic: bytes = MAGIC,
    version: int = 1,
    flags: int = 0,
    uncompressed: int | None = None,
    payload_len: int | None = None,
    sha: bytes | None = None,
) -> bytes:
    """A checkpoint built by hand; every field can be made to lie."""
    if payload is None:
        assert raw is not None
        payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    if uncompressed is None:
        assert raw is not None
        uncompressed = len(raw)
    header = LAYOUT.pack(
        magic,
        version,
        flags,
        uncompressed,
        len(payload) if payload_len is None else payload_len,
        hashlib.sha256(payload).digest() if sha is None else sha,
    )
    return header + payload


def same(a: object, b: object) -> bool:
    """Equal and of the same types all the way down (``True == 1`` and ``1 == 1.0`` do not
    count)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)  # type: ignore[arg-type]
    return a == b


# ---------------------------------------------------------------------------- round trips


def test_round_trip_representative_state() -> None:
    assert same(loads(dumps(STATE)), STATE)


def test_round_trip_special_floats() -> None:
    state = {"x": [math.nan, math.inf, -math.inf, -0.0, 5e-324]}
    back = loads(dumps(state))
    assert same(back, state)
    assert math.copysign(1.0, back["x"][3]) == -1.0


@pytest.mark.parametrize("level", [1, 3, 22])
def test_round_trip_every_level(level: int) -> None:
    assert same(loads(dumps(STATE, level=level)), STATE)


def test_loads_accepts_memoryview_and_bytearray() -> None:
    blob = dumps(STATE)
    assert same(loads(memoryview(blob)), STATE)
    assert same(loads(bytearray(blob)), STATE)
    padded = memoryview(b"xx" + blob)[2:]
    assert same(loads(padded), STATE)
    strided = memoryview(bytes(b for pair in zip(blob, blob, strict=True) for b in pair))[::2]
    assert same(loads(strided), STATE)


def test_header_layout_is_pinned() -> None:
    blob = dumps(STATE)
    magic, version, flags, uncompressed, payload_len, sha = LAYOUT.unpack_from(blob)
    payload = blob[HEADER_SIZE:]
    assert HEADER_SIZE == 64
    assert (magic, version, flags) == (b"ZEPHONCK", 1, 0)
    assert FORMAT_VERSION == 1
    assert payload_len == len(payload)
    assert sha == hashlib.sha256(payload).digest()
    frame = zstandard.get_frame_parameters(payload)
    assert frame.has_checksum
    assert frame.content_size == uncompressed
    raw = zstandard.ZstdDecompressor().decompress(payload)
    assert raw == msgpack.packb(STATE, use_bin_type=True)


def test_peek_header() -> None:
    blob = dumps(STATE)
    info = peek_header(blob[:HEADER_SIZE])  # the header alone is enough
    assert info == {
        "format_version": 1,
        "flags": 0,
        "uncompressed_bytes": len(msgpack.packb(STATE, use_bin_type=True)),
        "payload_bytes": len(blob) - HEADER_SIZE,
        "payload_sha256": hashlib.sha256(blob[HEADER_SIZE:]).hexdigest(),
    }


def test_peek_header_describes_newer_versions() -> None:
    assert peek_header(envelope(b"\x80", version=9))["format_version"] == 9


def test_peek_header_rejects_short_and_foreign_blobs() -> None:
    with pytest.raises(CheckpointError, match="truncated: 10 bytes, header needs 64"):
        peek_header(b"ZEPHONCK\x01\x00")
    with pytest.raises(CheckpointError, match="not a Zephon checkpoint"):
        peek_header(b"PK\x03\x04" + b"\x00" * 60)


# ------------------------------------------------------------------------------- save/load


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "step_100.zck"
    written = save(path, STATE)
    assert written == path.stat().st_size
    assert same(load(path), STATE)
    assert same(load(str(path)), STATE)


def test_save_is_atomic_when_replace_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ck.zck"
    save(path, {"step": 1})
    before = path.read_bytes()

    def boom(src: str, dst: str) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        save(path, {"step": 2})
    assert path.read_bytes() == before
    assert load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.zck"]


def test_save_fsyncs_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ck.zck"
    synced: list[tuple[bool, int]] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        st_ = os.fstat(fd)
        synced.append((stat.S_ISDIR(st_.st_mode), st_.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save(path, STATE)
    assert (False, path.stat().st_ino) in synced
    assert (True, tmp_path.stat().st_ino) in synced


def test_save_of_unserialisable_state_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ck.zck"
    with pytest.raises(CheckpointError, match="tuple"):
        save(path, {"x": (1, 2)})
    assert list(tmp_path.iterdir()) == []


def test_load_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "missing.zck"
    with pytest.raises(CheckpointError, match="missing.zck: checkpoint file does not exist") as e:
        load(path)
    assert isinstance(e.value.__cause__, FileNotFoundError)


def test_load_directory_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read checkpoint") as e:
        load(tmp_path)
    assert str(tmp_path) in str(e.value)
    assert isinstance(e.value.__cause__, OSError)


def test_load_prefixes_errors_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "ck.zck"
    path.write_bytes(dumps(STATE)[:-5])
    with pytest.raises(CheckpointError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: truncated: payload has ")
    assert isinstance(e.value.__cause__, CheckpointError)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:40], "truncated: 40 bytes, header needs 64"),
        (lambda b: b"NOTZEPHN" + b[8:], "not a Zephon checkpoint: magic b'NOTZEPHN'"),
        (lambda b: b + b"\x00", "trailing garbage: 1 unexpected bytes after the payload"),
        (lambda b: b[:-1], "truncated: payload has"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "corrupt: checksum mismatch"),
    ],
)
def test_load_checks_like_loads(tmp_path: Path, mutate: Any, message: str) -> None:
    path = tmp_path / "ck.zck"
    path.write_bytes(mutate(dumps(STATE)))
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_load_judges_a_huge_file_by_its_size_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "huge.zck"
    blob = dumps(STATE)
    path.write_bytes(blob)
    os.truncate(path, 8 << 30)  # sparse: 8 GiB on paper, nothing on disk
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="trailing garbage: ") as e:
            load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"{(8 << 30) - len(blob)} unexpected bytes" in str(e.value)
    assert peak < 1 << 20


def test_load_rejects_a_payload_larger_than_zstd_could_produce(tmp_path: Path) -> None:
    raw = msgpack.packb({"a": 1})
    junk = b"\x00" * 4096
    path = tmp_path / "ck.zck"
    path.write_bytes(envelope(raw, payload=junk, uncompressed=len(raw)))
    with pytest.raises(CheckpointError, match="4096-byte payload for 4 uncompressed bytes"):
        load(path)


# --------------------------------------------------------------------- header errors


@pytest.mark.parametrize("n", [0, 1, 8, 63])
def test_truncated_header(n: int) -> None:
    with pytest.raises(CheckpointError, match=f"^truncated: {n} bytes, header needs 64$"):
        loads(dumps(STATE)[:n])


def test_wrong_magic() -> None:
    blob = envelope(b"\x80", magic=b"PK\x03\x04\x14\x00\x00\x00")
    with pytest.raises(CheckpointError) as e:
        loads(blob)
    assert str(e.value) == (
        r"not a Zephon checkpoint: magic b'PK\x03\x04\x14\x00\x00\x00' (expected b'ZEPHONCK')"
    )


def test_newer_format_version() -> None:
    with pytest.raises(CheckpointError) as e:
        loads(envelope(b"\x80", version=7))
    assert str(e.value) == (
        "format version 7 is not supported by this Zephon (supports 1); upgrade zephon"
    )


def test_format_version_zero_is_corrupt_not_old() -> None:
    with pytest.raises(CheckpointError, match=r"format version 0 .* the header is corrupt"):
        loads(envelope(b"\x80", version=0))


def test_unknown_flags() -> None:
    with pytest.raises(CheckpointError, match=r"unsupported flags 0x00000004"):
        loads(envelope(b"\x80", flags=4))


def test_oversized_declared_length_raises_before_touching_the_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def must_not_run(*args: object, **kwargs: object) -> None:
        pytest.fail("the payload was hashed or decompressed despite the size limit")

    monkeypatch.setattr(zstandard, "ZstdDecompressor", must_not_run)
    monkeypatch.setattr(zstandard, "get_frame_parameters", must_not_run)
    monkeypatch.setattr(hashlib, "sha256", must_not_run)
    blob = envelope(payload=b"\x00" * 16, uncompressed=2**40, sha=b"\x00" * 32)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as e:
            loads(blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(e.value) == (
        "declares 1 TiB uncompressed (1099511627776 bytes), over the max_bytes limit of"
        " 1 GiB (1073741824 bytes); pass max_bytes= to allow it"
    )
    assert peak < 1 << 20


def test_max_bytes_boundary() -> None:
    blob = dumps(STATE)
    size = peek_header(blob)["uncompressed_bytes"]
    assert same(loads(blob, max_bytes=size), STATE)
    with pytest.raises(CheckpointError, match="over the max_bytes limit of"):
        loads(blob, max_bytes=size - 1)
    assert DEFAULT_MAX_BYTES == 1 << 30


def test_raised_max_bytes_still_refuses_a_lying_header() -> None:
    # The caller allows 2 TiB, but the frame inside says otherwise: no 1 TiB allocation.
    raw = msgpack.packb({"a": 1})
    blob = envelope(raw, uncompressed=2**40)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as e:
            loads(blob, max_bytes=2**41)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(e.value) == "corrupt: zstd frame declares 4 bytes, header declares 1099511627776"
    assert peak < 1 << 20


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_bytes_must_be_a_non_negative_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        loads(dumps(STATE), max_bytes=bad)


# -------------------------------------------------------------------- payload errors


def test_truncated_payload() -> None:
    blob = dumps(STATE)
    n = len(blob) - HEADER_SIZE
    with pytest.raises(CheckpointError) as e:
        loads(blob[:-7])
    assert str(e.value) == f"truncated: payload has {n - 7} of {n} bytes"


def test_trailing_garbage() -> None:
    blob = dumps(STATE)
    with pytest.raises(CheckpointError) as e:
        loads(blob + b"GARBAGE")
    assert str(e.value) == (
        f"trailing garbage: 7 unexpected bytes after the payload ({len(blob) - HEADER_SIZE}"
        " declared)"
    )


def test_checksum_mismatch() -> None:
    blob = bytearray(dumps(STATE))
    blob[HEADER_SIZE + 10] ^= 0x40
    with pytest.raises(CheckpointError, match=r"^corrupt: checksum mismatch \(header sha256 "):
        loads(blob)


def test_every_bit_flip_is_detected() -> None:
    """No byte of the file is unchecked: flags must be 0, so there is no unused area in
    which a flip could pass silently."""
    state = {"step": 7, "cursor": [1, 2, 3], "seed": b"\x01\x02"}
    blob = dumps(state)
    assert same(loads(blob), state)
    for i in range(len(blob)):
        for bit in range(8):
            flipped = bytearray(blob)
            flipped[i] ^= 1 << bit
            try:
                result = loads(flipped)
            except CheckpointError:
                continue
            pytest.fail(f"flipping bit {bit} of byte {i} returned {result!r}")


def test_every_truncation_is_detected() -> None:
    blob = dumps({"step": 7, "cursor": [1, 2, 3]})
    for n in range(len(blob)):
        with pytest.raises(CheckpointError, match="^truncated: "):
            loads(blob[:n])


def test_zstd_garbage_with_matching_sha() -> None:
    with pytest.raises(CheckpointError, match="^corrupt: zstd frame header: ") as e:
        loads(envelope(payload=b"not a zstd frame at all", uncompressed=4))
    assert isinstance(e.value.__cause__, zstandard.ZstdError)


def test_zstd_frame_damaged_inside_with_matching_sha() -> None:
    raw = msgpack.packb({"k": "v" * 200})
    payload = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(raw))
    payload[-6] ^= 0xFF  # the last block's data (the frame header stays readable)
    with pytest.raises(CheckpointError, match="^corrupt: zstd ") as e:
        loads(envelope(raw, payload=bytes(payload)))
    assert isinstance(e.value.__cause__, zstandard.ZstdError)


def test_zstd_frame_without_content_size() -> None:
    raw = msgpack.packb({"a": 1})
    payload = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(raw)
    with pytest.raises(CheckpointError, match="zstd frame does not record its content size"):
        loads(envelope(raw, payload=payload))


def test_zstd_frame_without_checksum() -> None:
    raw = msgpack.packb({"a": 1})
    payload = zstandard.ZstdCompressor(write_checksum=False).compress(raw)
    with pytest.raises(CheckpointError, match="zstd frame has checksum=False"):
        loads(envelope(raw, payload=payload))


def test_zstd_second_frame_in_payload() -> None:
    raw = msgpack.packb({"a": 1})
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    with pytest.raises(CheckpointError, match="^corrupt: zstd .*unused data"):
        loads(envelope(raw, payload=frame + frame))


def test_decompressed_size_differs_from_header(monkeypatch: pytest.MonkeyPatch) -> None:
    # zstd itself enforces the frame's content size; this guards the check behind it.
    class Short:
        def decompress(self, data: object, **kwargs: object) -> bytes:
            return b"\x80"

    monkeypatch.setattr(zstandard, "ZstdDecompressor", Short)
    with pytest.raises(CheckpointError, match="corrupt: decompressed 1 bytes, header declares"):
        loads(dumps(STATE))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "^corrupt: msgpack FormatError: malformed data$"),  # a byte msgpack never uses
        (b"\x81\xa1a", "corrupt: msgpack "),  # map cut short
        (msgpack.packb({"a": 1}) + b"\x00", "corrupt: msgpack ExtraData"),
        (msgpack.packb({1: "int key"}), "corrupt: msgpack "),
        (msgpack.packb({"t": msgpack.Timestamp(1, 0)}), "corrupt: msgpack "),
        (msgpack.packb({"e": msgpack.ExtType(5, b"")}), "ext type 5"),
        (msgpack.packb({"s": b"\xff\xfe"}, use_bin_type=False), "corrupt: msgpack "),  # bad UTF-8
        (b"\x81\xa1x\xdb\x7f\xff\xff\xff", "corrupt: msgpack "),  # str claims 2 GiB
    ],
)
def test_bad_msgpack(raw: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as e:
        loads(envelope(raw))
    assert e.value.__cause__ is not None


def test_bytes_keys_are_rejected() -> None:
    with pytest.raises(CheckpointError) as e:
        loads(envelope(msgpack.packb({"ok": {b"k": 1}}, use_bin_type=True)))
    assert (
        str(e.value) == "corrupt: state['ok'] has key b'k' of type bytes; checkpoint keys are str"
    )


@pytest.mark.parametrize(
    ("top", "kind"), [([1, 2], "list"), (None, "NoneType"), (3, "int"), (b"x", "bytes")]
)
def test_top_level_must_be_a_dict(top: object, kind: str) -> None:
    with pytest.raises(CheckpointError) as e:
        loads(envelope(msgpack.packb(top, use_bin_type=True)))
    assert str(e.value) == f"not a checkpoint state: top level is {kind}, expected dict"


def test_too_deep_payload() -> None:
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(CheckpointError, match="is nested deeper than 256 levels"):
        loads(envelope(msgpack.packb({"d": deep})))


# ---------------------------------------------------------------------- dumps errors


class _Custom:
    pass


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"x": (1, 2)}, r"^cannot checkpoint state\['x'\]: tuple is not .*; use a list$"),
        ({"x": {1, 2}}, r"state\['x'\]: set is not .*; use a sorted list$"),
        ({"x": bytearray(b"a")}, r"bytearray is not .*; use bytes\(\.\.\.\)$"),
        ({"x": [0, _Custom()]}, r"state\['x'\]\[1\]: .*test_io\._Custom is not"),
        ({"x": 2**64}, r"int 18446744073709551616 is outside msgpack's range"),
        ({"x": -(2**63) - 1}, r"int -9223372036854775809 is outside"),
        ({1: "v"}, r"^cannot checkpoint state: key 1 is int; checkpoint keys must be str$"),
        ({"a": [{"b": {(1,): 2}}]}, r"state\['a'\]\[0\]\['b'\]: key \(1,\) is tuple"),
        ({"a": {b"k": 1}}, r"key b'k' is bytes"),
    ],
)
def test_dumps_rejects_what_would_not_round_trip(state: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        dumps(state)


def test_dumps_rejects_numpy_scalars() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(CheckpointError, match=r"numpy\.int64 is not a checkpoint type"):
        dumps({"step": np.int64(3)})


def test_dumps_rejects_a_cycle() -> None:
    state: dict[str, Any] = {}
    state["self"] = state
    with pytest.raises(CheckpointError, match="nested deeper than 256 levels .a reference cycle"):
        dumps(state)


@pytest.mark.parametrize("top", [[1], None, "s"])
def test_dumps_top_level_must_be_a_dict(top: Any) -> None:
    with pytest.raises(CheckpointError, match="a checkpoint state must be a dict"):
        dumps(top)


@pytest.mark.parametrize("level", [0, 23, -1, True, 3.0])
def test_dumps_level_range(level: Any) -> None:
    with pytest.raises(ValueError, match=r"zstd level must be an int in 1\.\.22"):
        dumps(STATE, level=level)


# ------------------------------------------------------------------------------ property

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary()
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=40,
)
states = st.dictionaries(st.text(max_size=8), values, max_size=8)


@settings(deadline=None)
@given(states)
def test_property_round_trip(state: dict[str, Any]) -> None:
    assert same(loads(dumps(state, level=1)), state)


@settings(deadline=None)
@given(st.binary(max_size=256))
def test_property_arbitrary_bytes_raise_only_checkpoint_error(blob: bytes) -> None:
    with pytest.raises(CheckpointError):
        loads(blob)


@settings(deadline=None)
@given(
    st.sampled_from([MAGIC, b"ZEPHONCX"]),
    st.sampled_from([0, 1, 2, 2**32 - 1]),
    st.sampled_from([0, 1]),
    st.integers(0, 2**64 - 1) | st.integers(0, 64),
    st.integers(0, 2**64 - 1) | st.integers(0, 64),
    st.binary(max_size=64),
)
def test_property_arbitrary_headers_raise_only_checkpoint_error(
    magic: bytes, version: int, flags: int, uncompressed: int, payload_len: int, payload: bytes
) -> None:
    blob = envelope(
        payload=payload,
        magic=magic,
        version=version,
        flags=flags,
        uncompressed=uncompressed,
        payload_len=payload_len,
    )
    with pytest.raises(CheckpointError):
        loads(blob, max_bytes=2**64)


def _damage(packed: bytes, position: int, byte: int) -> bytes:
    if not packed:
        return packed
    i = position % len(packed)
    return packed[:i] + bytes([byte]) + packed[i + 1 :]


near_msgpack = st.binary(max_size=512) | st.builds(
    _damage,
    st.one_of(states, values).map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.integers(min_value=0),
    st.integers(0, 255),
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_msgpack)
def test_property_arbitrary_msgpack_behind_a_valid_envelope(raw: bytes) -> None:
    """Past the checksum, only the msgpack decode stands between crafted bytes and the
    caller: it returns a str-keyed dict or raises CheckpointError, nothing else."""
    try:
        state = loads(envelope(raw))
    except CheckpointError:
        return
    assert isinstance(state, dict)
    assert same(loads(dumps(state)), state)


# ------------------------------------------------------ where the file goes, and I/O errors


def test_save_creates_missing_parent_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save("ckpt/loader-0.zph", {"step": 0})  # the README's snippet, with no ckpt/ yet
    assert load(tmp_path / "ckpt" / "loader-0.zph") == {"step": 0}
    save(tmp_path / "a" / "b" / "c.zph", {"step": 1})
    assert load(tmp_path / "a" / "b" / "c.zph") == {"step": 1}
    # Each new directory's entry is synced into its parent, like the file's into its own.
    for directory in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert directory.stat().st_ino in synced
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["c.zph"]


def test_save_where_a_file_stands_for_a_directory_names_the_target(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_bytes(b"not a directory")
    target = tmp_path / "ckpt" / "sub" / "loader.zph"
    with pytest.raises(NotADirectoryError) as e:
        save(target, {"step": 0})
    assert e.value.filename == str(target)
    assert str(target) in str(e.value) and f"{tmp_path / 'ckpt'} is not a directory" in str(e.value)


_FULL_DISK_CHILD = """
import json, os, resource, signal, sys
from zephon.checkpoint.io import save

# A file size limit makes the write fail as a full disk would: the kernel refuses the bytes
# past the limit (EFBIG, where a full disk says ENOSPC). SIGXFSZ would kill the process.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save(sys.argv[1], {"blob": os.urandom(64 << 10)})
except OSError as e:
    print(json.dumps({"type": type(e).__name__, "errno": e.errno, "filename": e.filename,
                      "text": str(e)}))
"""


def test_save_on_a_full_disk_names_the_target_and_keeps_the_old_file(tmp_path: Path) -> None:
    import errno
    import json
    import subprocess
    import sys

    target = tmp_path / "ckpt" / "loader.zph"
    save(target, {"step": 1})
    old = target.read_bytes()
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(target)],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=120,
        check=True,
    )
    error = json.loads(done.stdout)
    assert error["errno"] == errno.EFBIG and error["type"] == "OSError"
    assert error["filename"] == str(target)
    assert error["text"] == f"[Errno {errno.EFBIG}] File too large: '{target}'"
    assert target.read_bytes() == old
    assert [p.name for p in target.parent.iterdir()] == ["loader.zph"]  # no temp file left


def _unprivileged(fn: Any) -> str:
    """``fn()``'s OSError as ``"Type|errno|filename|text"`` ("ok" if none), run where file
    permissions apply: here when not root, else in a forked child that became nobody."""
    if os.geteuid() != 0:
        try:
            fn()
        except OSError as e:
            return f"{type(e).__name__}|{e.errno}|{e.filename}|{e}"
        return "ok"
    import warnings

    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork beside threads: the child
        pid = os.fork()  # only makes system calls and exits
    if pid == 0:  # pragma: no cover - the child
        result = "child failed"
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                fn()
                result = "ok"
            except OSError as e:
                result = f"{type(e).__name__}|{e.errno}|{e.filename}|{e}"
        finally:
            os.write(write_end, result.encode())
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def test_save_without_permission_names_the_target() -> None:
    import errno
    import shutil
    import tempfile

    # Not under tmp_path, whose ancestors only their owner may enter.
    top = Path(tempfile.mkdtemp(prefix="zephon-perm-"))
    locked = top / "locked"
    locked.mkdir()
    os.chmod(top, 0o755)  # others may look in, but not write in "locked"
    os.chmod(locked, 0o555)
    try:
        target = locked / "loader.zph"
        kind, code, filename, text = _unprivileged(lambda: save(target, {"step": 0})).split("|", 3)
        assert (kind, int(code), filename) == ("PermissionError", errno.EACCES, str(target))
        assert text == f"[Errno {errno.EACCES}] Permission denied: '{target}'"
        nested = locked / "new" / "loader.zph"
        kind, code, filename, text = _unprivileged(lambda: save(nested, {"step": 0})).split("|", 3)
        assert (kind, filename) == ("PermissionError", str(nested))
        assert f"creating the directory {locked / 'new'}" in text
        assert list(locked.iterdir()) == []
    finally:
        os.chmod(locked, 0o755)
        shutil.rmtree(top)


# ------------------------------------------------------- the structural check, C and Python


def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for k in range(depth):
        value = [value] if k % 2 else {"k": value}
    return value


_SHAPES = [
    {},
    {"a": [1, 2, {"b": b"x"}], "c": None},
    {"a": {b"k": 1}},  # a bytes key
    {"a": [{"b": {3: 2}}]},  # an int key deep down
    {"d": _nested(254, 1)},
    {"d": _nested(255, 1)},
    {"d": _nested(255, [])},  # an empty list at the limit is still plain
    {"d": _nested(255, [1])},
    {"d": _nested(300, {})},
    {"l": list(range(10_000)) + [{"x": 1}] * 50},
]


@pytest.mark.native
@pytest.mark.parametrize("state", _SHAPES, ids=range(len(_SHAPES)))
def test_the_c_and_python_structural_checks_agree(state: dict[str, Any]) -> None:
    from zephon.checkpoint import plain

    if plain._NATIVE is None:
        pytest.skip("zephon._state is not built (or ZEPHON_PURE_PYTHON=1)")
    assert plain._NATIVE.plain(state, plain.MAX_DEPTH) is plain._plain(state)
    with pytest.raises(ValueError, match="max_depth"):
        plain._NATIVE.plain(state, -1)


class _Str(str):
    pass


#: What saving may or may not take (the quick check's cases): exact types only, ints in
#: msgpack's range, containers above the depth limit.
_WRITABLE_SHAPES = [
    *_SHAPES,
    {"t": (1, 2)},
    {"i": 2**64 - 1, "j": -(2**63), "f": 1.5, "b": True, "n": None, "s": "x", "y": b"z"},
    {"i": 2**64},
    {"i": -(2**63) - 1},
    {"i": 2**200},
    {"k": _Str("subclass value")},
    {_Str("subclass key"): 1},
    {"a": np.int64(3)},
    {"a": [np.float32(1.0)]},
    {"e": []},
    {"d": _nested(254, [])},
]


@pytest.mark.native
@pytest.mark.parametrize("state", _WRITABLE_SHAPES, ids=range(len(_WRITABLE_SHAPES)))
def test_the_c_and_python_checks_before_saving_agree(state: dict[str, Any]) -> None:
    from zephon.checkpoint import plain

    assert plain._NATIVE is not None, "zephon._state is not built (native tests need it)"
    assert plain._NATIVE.writable(state, plain.MAX_DEPTH) is plain._writable(state)
    assert plain._NATIVE.writable([state], plain.MAX_DEPTH) is False  # not a dict
    with pytest.raises(ValueError, match="max_depth"):
        plain._NATIVE.writable(state, 2000)


def test_a_decoded_state_is_checked_whichever_check_runs() -> None:
    from zephon.checkpoint import plain

    for state in _SHAPES:
        raw = msgpack.packb(state, use_bin_type=True)
        if plain._plain(state):
            assert loads(envelope(raw)) == state
        else:
            with pytest.raises(CheckpointError, match="key|nested deeper"):
                loads(envelope(raw))
