"""The Store contract as plain functions, so pytest (etcd, torch in-process) and the
two-process JAX worker script run the same checks. Each function takes a fresh key prefix so
checks never see each other's keys."""

from __future__ import annotations

import os

from zephon.checkpoint.stores.base import BaseStore


def check_protocol(store: BaseStore) -> None:
    assert isinstance(store, BaseStore), f"{type(store).__name__} is not a BaseStore"
    assert 0 < store.poll_interval_s <= 0.1, store.poll_interval_s
    assert store.describe(), "describe() must name the store"


def check_put_get_delete(store: BaseStore, p: str) -> None:
    assert store.get(f"{p}absent") is None
    store.delete(f"{p}absent")  # absent is fine

    store.put(f"{p}k", b"v1")
    assert store.get(f"{p}k") == b"v1"
    store.put(f"{p}k", b"v2")  # overwrite
    assert store.get(f"{p}k") == b"v2"
    store.delete(f"{p}k")
    assert store.get(f"{p}k") is None

    binary = bytes(range(256)) * 4 + b"\x00\x00\xff"
    store.put(f"{p}bin", binary)
    assert store.get(f"{p}bin") == binary
    store.put(f"{p}empty", b"")
    assert store.get(f"{p}empty") == b"", "an empty value is present, not absent"

    # nested names are independent keys: deleting a parent name leaves the child
    store.put(f"{p}round", b"parent")
    store.put(f"{p}round/process_0-of-2", b"child")
    store.delete(f"{p}round")
    assert store.get(f"{p}round") is None
    assert store.get(f"{p}round/process_0-of-2") == b"child"
    store.delete(f"{p}round/process_0-of-2")


def check_large_values(store: BaseStore, p: str, size: int) -> None:
    big = os.urandom(size)
    store.put(f"{p}big", big)
    assert store.get(f"{p}big") == big
    big2 = os.urandom(size + 12345)
    store.put(f"{p}big", big2)  # large over large
    assert store.get(f"{p}big") == big2
    store.put(f"{p}big", b"small")  # small over large
    assert store.get(f"{p}big") == b"small"
    store.put(f"{p}big", big)  # large over small
    assert store.get(f"{p}big") == big
    store.delete(f"{p}big")
    assert store.get(f"{p}big") is None


def check_plain_keep_alive(store: BaseStore, p: str) -> None:
    """Backends without leases: the key is there until stop() deletes it."""
    handle = store.keep_alive(f"{p}leader", b"alive", 2.0)
    assert store.get(f"{p}leader") == b"alive"
    handle.stop()
    assert store.get(f"{p}leader") is None
    handle.stop()  # idempotent
