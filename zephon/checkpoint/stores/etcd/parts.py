"""How the etcd store lays a value out in etcd: one tag byte, and large values in parts.

Every value is framed with one tag byte: ``_TAG_INLINE`` and the value itself, or
``_TAG_MANIFEST`` and a small JSON manifest (``nonce``, ``parts``, ``size``, ``blake2b``)
of a value of more than ``part_size_bytes``, whose parts lie under
``<key>#zephon-part/<nonce>/<i>``. A key written by another tool has neither tag, and is
reported as foreign rather than misread. The parts are written first and the manifest last,
so a reader sees either the old value or the whole new one; they are read at the manifest's
revision (a consistent snapshot even if the key is overwritten meanwhile) and checked
against its size and digest.

The requests go through the store's ``call`` (its ``_call``: one connection, the store's
lock, its revision bookkeeping); the store owns the key layout (the namespace, each key's
part prefix) and the cleanup of parts that a write or delete leaves behind.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

from zephon.checkpoint.stores.etcd.gateway import _b64, _unb64
from zephon.errors import AggregationError

#: etcd's default --max-request-bytes is 1.5 MiB; the JSON gateway base64-encodes values
#: (4/3) but the limit applies to the decoded gRPC request, so 1 MiB parts leave margin.
DEFAULT_PART_SIZE_BYTES = 1 << 20

_TAG_INLINE = b"\x00"
_TAG_MANIFEST = b"\x01"
_PART_MARK = "#zephon-part/"
_PART_READ_RETRIES = 3

#: ``call(path, payload, what)``: one request to the gateway, its answer
Call = Callable[[str, dict[str, Any], str], dict[str, Any]]


def write_parts(
    call: Call,
    key: str,
    prefix: bytes,
    nonce: str,
    value: bytes,
    part_size_bytes: int,
    lease_id: int | None,
) -> bytes:
    """Put ``value``'s parts under ``prefix`` (under the lease, if any); return the framed
    manifest, for the caller to write at ``key`` last."""
    n = math.ceil(len(value) / part_size_bytes)
    for i in range(n):
        chunk = value[i * part_size_bytes : (i + 1) * part_size_bytes]
        put: dict[str, Any] = {"key": _b64(prefix + b"%06d" % i), "value": _b64(chunk)}
        if lease_id is not None:
            put["lease"] = lease_id
        call("/kv/put", put, f"put part {i + 1}/{n} of {key!r}")
    manifest = {
        "nonce": nonce,
        "parts": n,
        "size": len(value),
        "blake2b": hashlib.blake2b(value, digest_size=16).hexdigest(),
    }
    return _TAG_MANIFEST + json.dumps(manifest).encode()


def manifest_of(key: str, raw: bytes, where: str, namespace: str) -> dict[str, Any]:
    """The manifest ``raw`` (not inline) frames; AggregationError when Zephon did not write
    it (``where`` and ``namespace`` name the store in the message)."""
    if raw[:1] != _TAG_MANIFEST:
        raise AggregationError(
            f"key {key!r} in {where} holds a value not written by Zephon "
            f"(first byte {raw[:1]!r}); is another tool using namespace "
            f"{namespace!r}?"
        )
    manifest: dict[str, Any] = json.loads(raw[1:])
    return manifest


def read_parts(
    call: Call, key: str, prefix: bytes, manifest: dict[str, Any], revision: int, where: str
) -> bytes | None:
    """The value whose parts lie under ``prefix``, read at ``revision``; None when they are
    gone (compacted away: the key was overwritten meanwhile).

    Raises:
        AggregationError: the parts do not match the manifest's size and digest.
    """
    chunks = []
    for i in range(int(manifest["parts"])):
        request = {"key": _b64(prefix + b"%06d" % i), "revision": revision}
        try:
            result = call("/kv/range", request, f"get part {i} of {key!r}")
        except AggregationError as e:
            if "compacted" in str(e):
                return None
            raise
        kvs = result.get("kvs") or []
        if not kvs:
            return None
        chunks.append(_unb64(kvs[0].get("value")))
    value = b"".join(chunks)
    digest = hashlib.blake2b(value, digest_size=16).hexdigest()
    if len(value) != manifest["size"] or digest != manifest["blake2b"]:
        raise AggregationError(
            f"the parts of {key!r} in {where} do not match their manifest "
            f"({len(value)} bytes, expected {manifest['size']}): the value is corrupt"
        )
    return value


def nonce_of(raw: bytes) -> str | None:
    """The nonce naming the parts of the value ``raw`` frames; None when it is inline (or
    not a readable manifest): then there are no parts to remove."""
    if raw[:1] != _TAG_MANIFEST:
        return None
    try:
        nonce: str = json.loads(raw[1:])["nonce"]
    except (ValueError, KeyError):
        return None
    return nonce
