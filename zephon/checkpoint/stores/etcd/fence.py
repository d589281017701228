"""Fencing and conditional writes of the etcd store: :class:`EtcdFence` and the
transactions that check it.

``announce`` returns an :class:`EtcdFence` — the announcement key and its ``mod_revision``
after the put — and a fenced ``put``/``create`` is one transaction
``mod_revision(f.key) == f.mod_revision ? write : nothing``; a ``create`` is one transaction
``create_revision(key) == 0 ? put : range(key)``. A newer announcement *or the deletion* of
the announcement key makes older fences stale. This module builds those transactions and
reads a failed one's answer; the store sends them and owns the keys' namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zephon.checkpoint.stores.base import StaleRoundError
from zephon.checkpoint.stores.etcd.gateway import _b64


@dataclass(frozen=True)
class EtcdFence:
    """Proof of an announcement: valid while ``key``'s mod revision is ``mod_revision``."""

    key: str
    mod_revision: int


def conditional_txn(
    request: dict[str, Any],
    *,
    fence: EtcdFence | None,
    fence_key: bytes,
    create: bool,
    delete_keys: list[bytes],
) -> dict[str, Any]:
    """The transaction of the put ``request``: fenced (``fence_key`` is the fence's key in
    etcd) and/or only if absent (``create``), deleting ``delete_keys`` when it succeeds; on
    failure it reads the key, then the fence's key (see :func:`raise_if_stale`)."""
    k64 = request["key"]
    compare: list[dict[str, Any]] = []
    if fence is not None:
        compare.append(
            {
                "key": _b64(fence_key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": str(fence.mod_revision),
            }
        )
    if create:
        compare.append({"key": k64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
    failure = [{"request_range": {"key": k64}}]
    if fence is not None:
        failure.append({"request_range": {"key": _b64(fence_key)}})
    success: list[dict[str, Any]] = [{"request_put": request}]
    success += [{"request_delete_range": {"key": _b64(k)}} for k in delete_keys]
    return {"compare": compare, "success": success, "failure": failure}


def raise_if_stale(responses: list[dict[str, Any]], fence: EtcdFence, key: str, where: str) -> None:
    """Raise StaleRoundError when a failed :func:`conditional_txn`'s read of the fence's key
    shows the announcement gone or moved on (else the create's compare failed)."""
    fkvs = responses[1].get("response_range", {}).get("kvs") or []
    if not fkvs or int(fkvs[0].get("mod_revision", 0)) != fence.mod_revision:
        raise StaleRoundError(
            f"fenced write of {key!r} refused: announcement {fence.key!r}"
            f" is no longer at revision {fence.mod_revision} (a newer round"
            f" was announced or this one was closed) in {where}"
        )
