"""The JAX backend of the aggregation store: ``aggregate_store="jax://"``.

It uses the key-value store of the coordination service that ``jax.distributed.initialize``
already runs (``jax._src.distributed.global_state.client``, a ``DistributedRuntimeClient``):
``key_value_set_bytes(key, value, allow_overwrite=True)``, ``key_value_try_get_bytes`` (which
raises ``NOT_FOUND`` for an absent key: mapped to None), ``key_value_delete``. Nothing blocks:
``get`` never waits for a key, the round protocol polls.

Quirks handled here:

* ``key_value_delete("a")`` also deletes every ``"a/..."`` key (the service's keys form a
  directory tree). The protocol's keys nest (``round`` and ``round/...`` may both exist), so
  every key is stored with a ``"#"`` suffix: ``"a#"`` and ``"a/b#"`` are never parent and
  child.
* Without ``allow_overwrite=True`` a second set raises ``ALREADY_EXISTS``.
* The service has no practical value-size limit (hundreds of MiB went through in testing)
  and no leases: ``announce`` and ``keep_alive`` are :class:`BaseStore`'s (a plain put, no
  fence; a handle whose ``stop()`` deletes the key). A dead leader is noticed through the
  failure notice, the round's time budget, and JAX's own heartbeat, which ends a job whose
  task died.
* ``create`` is ``key_value_set_bytes`` without ``allow_overwrite``: the service refuses
  it with ``ALREADY_EXISTS`` when the key exists, and the loser then reads the winner's
  value.
* The client has no per-request timeout: a SIGSTOPped coordinator blocked
  ``key_value_try_get_bytes`` for over 40 s in testing. Every call therefore runs on a
  daemon worker thread and the caller waits at most ``request_timeout_s``; a call that
  overruns raises ``AggregationError`` naming the coordinator and its thread is abandoned
  (a new one serves the next call). Errors the service returns (``JaxRuntimeError``) are
  mapped to ``AggregationError`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zephon.checkpoint.stores._bounded import BoundedWorker
from zephon.checkpoint.stores.base import BaseStore
from zephon.errors import AggregationError

DEFAULT_NAMESPACE = "zephon/"
DEFAULT_REQUEST_TIMEOUT_S = 5.0
_KEY_SUFFIX = "#"


def _coordination_client() -> tuple[Any, str]:
    try:
        from jax._src import distributed
    except ImportError as e:
        raise AggregationError(
            "aggregate_store='jax://' needs JAX: pip install 'zephon[jax]'"
        ) from e
    state = distributed.global_state
    if state.client is None:
        raise AggregationError(
            "aggregate_store='jax://' uses the jax.distributed coordination service, but "
            "jax.distributed is not initialised in this process; call "
            "jax.distributed.initialize(...) before building the Pipeline, or use "
            "aggregate_dir= or aggregate_store='etcd://...'"
        )
    where = f"jax://{state.coordinator_address} (process {state.process_id})"
    return state.client, where


class JaxStore(BaseStore):
    """A :class:`~zephon.checkpoint.stores.base.BaseStore` over the JAX coordination service.

    Args:
        client: a ``DistributedRuntimeClient``; by default the one ``jax.distributed``
            initialised in this process (an ``AggregationError`` when there is none).
        namespace: prefix of every key this store touches.
        request_timeout_s: the longest one call may take before it is an error.
        poll_interval_s: how often the round protocol re-reads a key it waits for.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        poll_interval_s: float = 0.01,
    ) -> None:
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0; got {request_timeout_s}")
        if client is None:
            client, where = _coordination_client()
        else:
            where = "jax://<given client>"
        self._client = client
        self._where = where
        # "job7" and "job7/" are the same namespace (open_store passes the former)
        self.namespace = namespace if not namespace or namespace.endswith("/") else namespace + "/"
        self.request_timeout_s = float(request_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self._worker = BoundedWorker("zephon-jax-store", lambda: None)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> JaxStore:
        """``"jax://"`` or ``"jax:///namespace"``."""
        if not url.startswith("jax://"):
            raise ValueError(
                f"a JAX aggregate_store is 'jax://' or 'jax:///namespace'; got {url!r}"
            )
        rest = url[len("jax://") :].strip("/")
        if rest:
            kwargs.setdefault("namespace", rest + "/")
        return cls(**kwargs)

    def __repr__(self) -> str:
        return f"JaxStore({self._where!r}, namespace={self.namespace!r})"

    def describe(self) -> str:
        return self._where

    def _key(self, key: str) -> str:
        return self.namespace + key + _KEY_SUFFIX

    def _call(self, what: str, fn: Callable[[], Any], absent: Any = None) -> Any:
        """``fn()`` on the worker within ``request_timeout_s``; NOT_FOUND -> ``absent``."""
        self.counters.add(requests=1)
        try:
            return self._worker.run(lambda _: fn(), self.request_timeout_s)
        except TimeoutError:
            self._worker.abandon()
            self._worker = BoundedWorker("zephon-jax-store", lambda: None)
            raise AggregationError(
                f"{what}: {self._where} did not answer within {self.request_timeout_s:g} s "
                f"(is the coordinator, process 0, stalled?); raise request_timeout_s if it "
                f"is just slow"
            ) from None
        except RuntimeError as e:  # JaxRuntimeError
            text = str(e)
            if text.startswith("NOT_FOUND"):
                return absent
            first_line = text.splitlines()[0] if text else type(e).__name__
            raise AggregationError(f"{what} failed on {self._where}: {first_line}") from e

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        # fence: announce() returns None here, so there is nothing to check
        k, v = self._key(key), bytes(value)
        self.counters.add(written=len(v))
        self._call(
            f"put {key!r}", lambda: self._client.key_value_set_bytes(k, v, allow_overwrite=True)
        )

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        """Write ``key`` only if absent: None when created, else the value already there."""
        k, v = self._key(key), bytes(value)
        self.counters.add(written=len(v))
        for _ in range(3):
            try:
                self._call(f"create {key!r}", lambda: self._client.key_value_set_bytes(k, v))
                return None
            except AggregationError as e:
                if "ALREADY_EXISTS" not in str(e):
                    raise
            existing = self.get(key)
            if existing is not None:
                return existing
        raise AggregationError(
            f"could not create {key!r} on {self._where}: it was created and removed three"
            " times while this rank tried"
        )

    def get(self, key: str) -> bytes | None:
        k = self._key(key)
        value = self._call(f"get {key!r}", lambda: self._client.key_value_try_get_bytes(k))
        if value is None:
            return None
        self.counters.add(read=len(value))
        return bytes(value)

    def delete(self, key: str) -> None:
        k = self._key(key)
        self._call(f"delete {key!r}", lambda: self._client.key_value_delete(k))

    def close(self) -> None:
        """Stops the worker thread; the coordination service belongs to jax.distributed."""
        self._worker.abandon()
