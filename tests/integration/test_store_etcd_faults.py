"""EtcdStore against a misbehaving server: SIGSTOPped (the kernel still accepts connections,
nothing answers), unreachable endpoints, and failover between endpoints. Every failure must
be an AggregationError naming the endpoint, within the request timeout — never a hang."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.etcd_server import etcd_server, free_port, require_etcd3gw
from zephon.errors import AggregationError

pytestmark = [pytest.mark.stores, pytest.mark.etcd]

TIMEOUT_S = 0.5


@pytest.fixture(autouse=True)
def _client():
    require_etcd3gw()


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as server:
        yield server


def _store(endpoints, **kwargs):
    from zephon.checkpoint.stores.etcd import EtcdStore

    kwargs.setdefault("request_timeout_s", TIMEOUT_S)
    return EtcdStore(endpoints, namespace=f"{uuid.uuid4().hex}/", **kwargs)


def _raises_within(fn, limit_s: float, match: str) -> AggregationError:
    t0 = time.monotonic()
    with pytest.raises(AggregationError, match=match) as info:
        fn()
    elapsed = time.monotonic() - t0
    assert elapsed < limit_s, f"took {elapsed:.2f} s, limit {limit_s} s"
    return info.value


def test_stalled_server_gives_a_bounded_error_naming_it_and_recovers(etcd):
    store = _store([etcd.endpoint])
    store.put("k", b"before")
    etcd.pause()
    try:
        for op in (lambda: store.get("k"), lambda: store.put("k", b"x"), lambda: store.delete("k")):
            err = _raises_within(op, TIMEOUT_S + 1.0, match=etcd.endpoint)
            assert "no answer within 0.5 s" in str(err)
        _raises_within(lambda: store.keep_alive("lease", b"x", 2.0), TIMEOUT_S + 1.0, etcd.endpoint)
    finally:
        etcd.resume()
    # the same store works again once the server does (a put sent while it was stopped
    # may or may not have been applied: the value is one of the two)
    assert store.get("k") in (b"before", b"x", None)
    store.put("k", b"after")
    assert store.get("k") == b"after"
    store.close()


def test_unreachable_endpoint_is_named_with_its_reason():
    port = free_port()  # nothing listens here
    store = _store([f"127.0.0.1:{port}"])
    err = _raises_within(lambda: store.get("k"), TIMEOUT_S + 1.0, match=f"127.0.0.1:{port}")
    assert "Connection refused" in str(err)
    assert store.describe() == f"etcd://127.0.0.1:{port}"
    store.close()


def test_failover_to_the_next_endpoint_and_every_failure_named(etcd):
    dead = f"127.0.0.1:{free_port()}"
    store = _store([dead, etcd.endpoint])
    assert store.describe() == f"etcd://{dead},{etcd.endpoint}"
    store.put("k", b"v")  # the dead endpoint is skipped
    assert store.get("k") == b"v"

    etcd.pause()
    try:
        err = _raises_within(lambda: store.get("k"), 2 * TIMEOUT_S + 1.0, match=dead)
        assert etcd.endpoint in str(err)
    finally:
        etcd.resume()
    assert store.get("k") == b"v"
    store.close()


def test_url_parsing():
    from zephon.checkpoint.stores.etcd import EtcdStore, parse_etcd_url

    assert parse_etcd_url("etcd://a:1,b:2") == ([("a", 1), ("b", 2)], None)
    assert parse_etcd_url("etcd://a/job7") == ([("a", 2379)], "job7/")
    assert parse_etcd_url("etcd://[::1]:2380") == ([("::1", 2380)], None)
    store = EtcdStore.from_url("etcd://127.0.0.1:2379/job7")
    assert store.namespace == "job7/"
    assert store.describe() == "etcd://127.0.0.1:2379"
    store.close()
    for bad in ("etcd://", "http://a:1", "etcd://a:xyz"):
        with pytest.raises(ValueError, match="etcd"):
            parse_etcd_url(bad)
