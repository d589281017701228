"""The torch backend of the aggregation store: ``aggregate_store="torch://"``.

It uses a ``torch.distributed`` TCPStore, found in this order:

1. a store passed in (``TorchStore(store)``: a TCPStore, PrefixStore, HashStore, ...);
2. the default process group's store, when ``torch.distributed`` is initialised (so the
   job's own rendezvous is reused and no second server is started);
3. one built from the torchrun environment: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
   ``WORLD_SIZE``. As in ``torch.distributed``'s own ``env://`` rendezvous, rank 0 hosts
   the server with ``multi_tenant=True`` (so a later ``init_process_group`` in the same
   process shares it instead of failing to bind), unless ``TORCHELASTIC_USE_AGENT_STORE``
   is ``True`` (torchrun's agent already hosts it): then every rank is a client.

torch is imported lazily: ``import zephon`` never imports it.

Quirks handled here:

* ``TCPStore.get`` *waits* for an absent key until the store's timeout: ``get`` asks
  ``check([key])`` first, and treats a timeout on the following ``get`` (the key was deleted
  in between) as absent. So is an empty value, which Zephon never stores (each value carries
  a tag byte; parts are never empty): about once in 25 three-rank test runs a follower read
  the round key as empty while the leader was removing it, most likely deleted between
  ``get``'s own wait and its read.
* ``check``, ``set`` and ``delete_key`` wait on the socket with no timeout at all (a
  SIGSTOPped server blocked ``check`` for 10 minutes in testing), and a client connection
  never recovers from a network error. So every call runs on a daemon worker thread that
  owns the connection, the caller waits at most ``request_timeout_s + 1`` and gets an
  ``AggregationError`` naming the server; after a timeout or a network error the worker
  and its connection are dropped and the next call opens a fresh one with ``clone()``.
  That clone is also what ``set_timeout(request_timeout_s)`` is applied to, so a process
  group's store keeps its own timeout.
* The libuv server (the default) refuses a message over 8 MiB and drops the connection. A
  value larger than ``part_size_bytes`` (4 MiB) is written as parts under
  ``<key>#part/<nonce>/<i>`` followed by a manifest at ``<key>`` (written last), plus a
  marker ``<key>#split`` naming the current parts so ``delete`` and overwrites can remove
  them without reading the value. Values carry one tag byte (inline or manifest).
* No leases and no fencing here: ``announce`` and ``keep_alive`` are :class:`BaseStore`'s
  (a plain put, no fence; a handle whose ``stop()`` deletes the key).
* ``create`` is ``compare_set(key, b"", value)``: the server sets the key only when it is
  absent and answers with the value it holds afterwards, so the caller won when that is
  its own value.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zephon.checkpoint.stores._bounded import BoundedWorker
from zephon.checkpoint.stores.base import BaseStore
from zephon.errors import AggregationError

DEFAULT_NAMESPACE = "zephon"
DEFAULT_REQUEST_TIMEOUT_S = 5.0
_VANISHED_WAIT_S = 0.5  # get() of a key check() just saw; longer means it was deleted


class _Vanished(Exception):
    """A key disappeared between check() and get() (another rank deleted it)."""


DEFAULT_CONNECT_TIMEOUT_S = 300.0
#: the libuv TCPStore server refuses messages over 8 MiB; half leaves margin for the key
DEFAULT_PART_SIZE_BYTES = 4 << 20

_TAG_INLINE = b"\x00"
_TAG_MANIFEST = b"\x01"
_READ_RETRIES = 3


def _import_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise AggregationError(
            "aggregate_store='torch://' needs PyTorch (torch.distributed); install torch, "
            "or use aggregate_dir= or aggregate_store='etcd://...'"
        ) from e
    return dist


def store_from_env(connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> tuple[Any, str]:
    """The job's store (default process group's, else a TCPStore from the torchrun env)."""
    dist = _import_dist()
    if dist.is_available() and dist.is_initialized():
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except (ImportError, ValueError, RuntimeError):
            store = None
        if store is not None:
            return store, f"{_where(store)} (the default process group's store)"
    missing = [
        v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not os.environ.get(v)
    ]
    if missing:
        raise AggregationError(
            f"aggregate_store='torch://' needs the torchrun environment or an initialised "
            f"torch.distributed; {', '.join(missing)} not set. Launch with torchrun, call "
            f"torch.distributed.init_process_group first, or pass a store: TorchStore(store)"
        )
    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    is_master = rank == 0 and not agent_store
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size=world_size,
            is_master=is_master,
            timeout=timedelta(seconds=connect_timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        if is_master and "EADDRINUSE" in first:
            raise AggregationError(
                f"could not host the TCPStore at {addr}:{port} (rank {rank} of {world_size}): "
                f"another process holds port {port}. Pick a free MASTER_PORT ({first})"
            ) from e
        role = "host" if is_master else "reach"
        raise AggregationError(
            f"could not {role} the TCPStore at {addr}:{port} (rank {rank} of {world_size}) "
            f"within {connect_timeout_s:g} s: {first}"
        ) from e
    return store, f"torch://{addr}:{port}"


def _where(store: Any) -> str:
    """``torch://host:port`` of the TCPStore under any PrefixStore wrappers."""
    for _ in range(8):
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if host is not None and port is not None:
            return f"torch://{host}:{port}"
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return f"torch://<{type(store).__name__}>"


class TorchStore(BaseStore):
    """A :class:`~zephon.checkpoint.stores.base.BaseStore` over a ``torch.distributed`` store.

    Args:
        store: the store to use; by default the job's (see the module docstring).
        namespace: prefix of every key (through a ``PrefixStore``).
        request_timeout_s: how long one ``get`` may wait on the server.
        part_size_bytes: values larger than this are split into parts of this size.
        poll_interval_s: how often the round protocol re-reads a key it waits for.
        describe_as: what error messages call this store (default: from the environment).
    """

    def __init__(
        self,
        store: Any = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        poll_interval_s: float = 0.01,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        describe_as: str | None = None,
    ) -> None:
        dist = _import_dist()
        if store is None:
            store, where = store_from_env(connect_timeout_s)
        else:
            where = _where(store)
        if part_size_bytes < 1024:
            raise ValueError(f"part_size_bytes must be >= 1024; got {part_size_bytes}")
        # keep the original alive: when it hosts the server, dropping it stops the server
        self._owner = store
        self._worker = BoundedWorker("zephon-torch-store", self._connect)
        self._dist = dist
        self._connections = 0
        self._where = describe_as or where
        self.namespace = namespace
        self.request_timeout_s = float(request_timeout_s)
        self.part_size_bytes = int(part_size_bytes)
        self.poll_interval_s = float(poll_interval_s)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> TorchStore:
        """``"torch://"`` or ``"torch:///namespace"``."""
        if not url.startswith("torch://"):
            raise ValueError(
                f"a torch aggregate_store is 'torch://' or 'torch:///namespace'; got {url!r}"
            )
        rest = url[len("torch://") :].strip("/")
        if rest:
            kwargs.setdefault("namespace", rest)
        return cls(**kwargs)

    def __repr__(self) -> str:
        return f"TorchStore({self._where!r}, namespace={self.namespace!r})"

    def describe(self) -> str:
        return self._where

    # ------------------------------------------------------------------ raw access

    def _connect(self) -> Any:
        """A connection of our own (runs on the worker thread, under the call's timeout):
        a clone of the store where it has ``clone()``, so a stalled or broken connection can
        be dropped and a process group's store keeps its own timeout."""
        base = self._owner
        try:
            base = base.clone()
        except (AttributeError, RuntimeError):
            pass
        try:
            base.set_timeout(timedelta(seconds=self.request_timeout_s))
        except (AttributeError, RuntimeError):
            pass
        self._connections += 1
        return self._dist.PrefixStore(self.namespace, base)

    def _run(self, fn: Callable[[Any], Any], what: str) -> Any:
        """Run ``fn(store)`` on the worker thread, bounded by ``request_timeout_s``.

        TCPStore's ``check``/``set``/``delete_key`` wait on the socket without a timeout, so
        a stalled server would block the caller forever; here the caller gets an
        ``AggregationError`` instead, and the stuck connection (and its thread) is dropped
        for a fresh one, as it is after a network error (a TCPStore client never recovers
        from one)."""
        limit_s = self.request_timeout_s + 1.0  # get() itself may wait request_timeout_s
        self.counters.add(requests=1)
        try:
            return self._worker.run(fn, limit_s)
        except TimeoutError:
            self._replace_worker()
            raise AggregationError(
                f"{what}: {self._where} did not answer within {limit_s:g} s (is the TCPStore "
                f"server, rank 0 or torchrun's agent, stalled?); raise request_timeout_s "
                f"(now {self.request_timeout_s:g} s) if it is just slow"
            ) from None
        except RuntimeError as e:  # torch's DistError family
            self._replace_worker()
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AggregationError(f"{what} failed on {self._where}: {first_line}") from e

    def _replace_worker(self) -> None:
        self._worker.abandon()
        self._worker = BoundedWorker("zephon-torch-store", self._connect)

    def _set(self, key: str, value: bytes, what: str) -> None:
        self.counters.add(written=len(value))
        self._run(lambda st: st.set(key, value), what)

    def _get(self, key: str, what: str) -> bytes | None:
        def get(st: Any) -> bytes | None:
            if not st.check([key]):
                return None
            # get() waits for the key: if another rank deleted it right after check(), it
            # would wait the whole request timeout. It was there a moment ago, so wait briefly.
            st.set_timeout(timedelta(seconds=_VANISHED_WAIT_S))
            try:
                value = bytes(st.get(key))
            except RuntimeError:
                raise _Vanished from None
            finally:
                st.set_timeout(timedelta(seconds=self.request_timeout_s))
            if not value:  # never Zephon's: deleted while get() ran (see the module doc)
                raise _Vanished
            self.counters.add(read=len(value))
            return value

        try:
            result: bytes | None = self._run(get, what)
        except _Vanished:
            # The server may still answer that get() if the key comes back, which would
            # desynchronise this connection: drop it. For the caller the key is absent.
            self._replace_worker()
            return None
        return result

    def _delete(self, key: str, what: str) -> None:
        self._run(lambda st: st.delete_key(key), what)

    # ------------------------------------------------------------------ Store protocol

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        # fence: announce() returns None here, so there is nothing to check
        value = bytes(value)
        old = self._get(key + "#split", f"put {key!r}")
        if len(value) + 1 <= self.part_size_bytes:
            self._set(key, _TAG_INLINE + value, f"put {key!r}")
            if old is not None:
                self._delete(key + "#split", f"put {key!r}")
        else:
            nonce = os.urandom(8).hex()
            n = -(-len(value) // self.part_size_bytes)
            for i in range(n):
                chunk = value[i * self.part_size_bytes : (i + 1) * self.part_size_bytes]
                self._set(f"{key}#part/{nonce}/{i}", chunk, f"put part {i + 1}/{n} of {key!r}")
            manifest = json.dumps({"nonce": nonce, "parts": n, "size": len(value)}).encode()
            self._set(key + "#split", manifest, f"put {key!r}")
            self._set(key, _TAG_MANIFEST + manifest, f"put {key!r}")
        if old is not None:
            self._delete_parts(key, old)

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        """Write ``key`` only if absent (``compare_set``): None when created, else the
        value already there."""
        value = bytes(value)
        parts: tuple[str, int] | None = None
        if len(value) + 1 <= self.part_size_bytes:
            desired = _TAG_INLINE + value
        else:
            nonce = os.urandom(8).hex()
            n = -(-len(value) // self.part_size_bytes)
            for i in range(n):
                chunk = value[i * self.part_size_bytes : (i + 1) * self.part_size_bytes]
                self._set(f"{key}#part/{nonce}/{i}", chunk, f"create part {i + 1}/{n} of {key!r}")
            manifest = json.dumps({"nonce": nonce, "parts": n, "size": len(value)}).encode()
            desired = _TAG_MANIFEST + manifest
            parts = (nonce, n)
        self.counters.add(written=len(desired))
        held = bytes(
            self._run(lambda st: st.compare_set(key, b"", desired), f"create {key!r}") or b""
        )
        if held == desired:
            if parts is not None:
                self._set(key + "#split", desired[1:], f"create {key!r}")
            return None
        if parts is not None:
            self._delete_parts(key, json.dumps({"nonce": parts[0], "parts": parts[1]}).encode())
        return self._decode(key, held)

    def get(self, key: str) -> bytes | None:
        for _ in range(_READ_RETRIES):
            raw = self._get(key, f"get {key!r}")
            if raw is None:
                return None
            value = self._decode(key, raw)
            if value is not None:
                return value
            time.sleep(self.poll_interval_s)
        raise AggregationError(
            f"could not read the parts of {key!r} from {self._where} after {_READ_RETRIES} "
            f"tries: it is being overwritten faster than it can be read"
        )

    def _decode(self, key: str, raw: bytes) -> bytes | None:
        """A stored value back to the caller's bytes; None if its parts vanished (it was
        overwritten while we read)."""
        tag, body = raw[:1], raw[1:]
        if tag == _TAG_INLINE:
            return body
        if tag != _TAG_MANIFEST:
            raise AggregationError(
                f"key {key!r} in {self._where} holds a value not written by Zephon "
                f"(first byte {raw[:1]!r}); is another tool using namespace "
                f"{self.namespace!r}?"
            )
        manifest = json.loads(body)
        chunks = []
        for i in range(manifest["parts"]):
            chunk = self._get(f"{key}#part/{manifest['nonce']}/{i}", f"get {key!r}")
            if chunk is None:
                return None  # overwritten while we read: read the new manifest
            chunks.append(chunk)
        value = b"".join(chunks)
        if len(value) != manifest["size"]:
            raise AggregationError(
                f"the parts of {key!r} in {self._where} add up to {len(value)} bytes, "
                f"not the {manifest['size']} of their manifest: the value is corrupt"
            )
        return value

    def delete(self, key: str) -> None:
        old = self._get(key + "#split", f"delete {key!r}")
        self._delete(key, f"delete {key!r}")
        if old is not None:
            self._delete(key + "#split", f"delete {key!r}")
            self._delete_parts(key, old)

    def _delete_parts(self, key: str, manifest_bytes: bytes) -> None:
        manifest = json.loads(manifest_bytes)
        for i in range(manifest["parts"]):
            self._delete(f"{key}#part/{manifest['nonce']}/{i}", f"delete parts of {key!r}")

    def close(self) -> None:
        """Stops the worker thread. A server this store hosts (rank 0 under torchrun
        without an agent store) stops when the store is garbage-collected, and the other
        ranks may still be reading the merged result from it."""
        self._worker.abandon()
