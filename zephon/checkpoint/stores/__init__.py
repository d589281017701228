"""Stores that multi-rank checkpoint rounds run over (see :mod:`zephon.checkpoint.rounds`),
and :func:`open_store`, which picks one from a Pipeline's ``aggregate_dir`` or
``aggregate_store``.

Every store is a :class:`BaseStore` (:mod:`~zephon.checkpoint.stores.base`: what is required
of a store, and the optional powers with their defaults); so must be one you pass to
``Aggregator`` yourself. Only the directory stores are imported here (the fsspec one imports
fsspec when made); the etcd, JAX and torch stores import their client libraries, so
:func:`open_store` loads them on demand.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from zephon.checkpoint.stores.base import (
    BaseStore,
    KeepAlive,
    KeyHeldError,
    PrefixWatch,
    StaleRoundError,
    StoreCounters,
    check_store,
    poll_delays,
)
from zephon.checkpoint.stores.directory import DirectoryStore
from zephon.checkpoint.stores.fsspec_store import FsspecStore
from zephon.checkpoint.stores.local import LocalStore

__all__ = [
    "BaseStore",
    "DirectoryStore",
    "FsspecStore",
    "KeepAlive",
    "KeyHeldError",
    "LocalStore",
    "PrefixWatch",
    "StaleRoundError",
    "StoreCounters",
    "check_store",
    "open_store",
    "poll_delays",
]


def open_store(
    aggregate_dir: str | os.PathLike[str] | None = None,
    aggregate_store: str | None = None,
    *,
    namespace: str = "zephon",
) -> BaseStore:
    """The store behind ``Pipeline(aggregate_dir=...)`` or ``Pipeline(aggregate_store=...)``.

    Args:
        aggregate_dir: a local or shared directory, or an fsspec URL (``s3://b/dir``).
        aggregate_store: ``"etcd://host:port[,host:port...][/namespace][?blobs=DIR]"``
            (``blobs``: a directory or fsspec URL for the ranks' states, etcd keeping only
            the coordination keys; see :mod:`zephon.checkpoint.stores.split`), ``"jax://"``
            (the running ``jax.distributed`` service) or ``"torch://"`` (torchrun's
            TCPStore).
        namespace: a prefix under which the rounds' keys live (rounds of different jobs and
            pipelines are kept apart inside it by job id and fingerprint).

    Raises:
        ValueError: neither or both given, or an unknown ``aggregate_store`` scheme.
        ImportError: the backend's module or its client library is not installed.
    """
    if (aggregate_dir is None) == (aggregate_store is None):
        raise ValueError(
            "give exactly one of aggregate_dir (a directory or fsspec URL) and aggregate_store"
            f" ('etcd://host:port', 'jax://', 'torch://'); got aggregate_dir={aggregate_dir!r},"
            f" aggregate_store={aggregate_store!r}"
        )
    if aggregate_dir is not None:
        return DirectoryStore(aggregate_dir, namespace)
    assert aggregate_store is not None
    scheme, sep, rest = aggregate_store.partition("://")
    if not sep or scheme not in ("etcd", "jax", "torch"):
        raise ValueError(
            "aggregate_store must be 'etcd://host:port[,host:port]', 'jax://' or 'torch://';"
            f" got {aggregate_store!r} (use aggregate_dir= for a directory or fsspec URL)"
        )
    if scheme == "etcd":
        url, _, query = aggregate_store.partition("?")
        rest = rest.partition("?")[0]
        if not rest.split("/", 1)[0].strip(", "):
            raise ValueError(f"aggregate_store {aggregate_store!r} names no etcd endpoint")
        blobs = _blobs_of(query, aggregate_store)
        cls = _backend("etcd", "EtcdStore", aggregate_store, "zephon[etcd]")
        if "/" in rest.strip("/"):  # "etcd://h:p/job7": the URL names the namespace
            store: BaseStore = cls.from_url(url)
            namespace = store.namespace.strip("/")  # type: ignore[attr-defined]
        else:
            store = cls.from_url(url, namespace=namespace)
        if blobs is not None:
            from zephon.checkpoint.stores.split import SplitStore

            return SplitStore(store, DirectoryStore(blobs, namespace.replace("/", "-")))
        return store
    if scheme == "jax":
        store = _backend("jax_store", "JaxStore", aggregate_store, "zephon[jax]")(
            namespace=namespace
        )
        return store
    store = _backend("torch_store", "TorchStore", aggregate_store, "torch")(namespace=namespace)
    return store


def _blobs_of(query: str, url: str) -> str | None:
    """The ``blobs=`` location of an etcd URL's query (``?blobs=/shared/dir``), or None."""
    if not query:
        return None
    from urllib.parse import parse_qs

    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"blobs"})
    if unknown or not params.get("blobs", [""])[0]:
        raise ValueError(
            f"aggregate_store {url!r}: the only option is blobs=<directory or fsspec URL>"
            f" (where the ranks' states go, etcd keeping the coordination keys); got {query!r}"
        )
    return params["blobs"][0]


def _backend(module: str, name: str, url: str, extra: str) -> Any:
    try:
        mod = importlib.import_module(f"zephon.checkpoint.stores.{module}")
        return getattr(mod, name)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"aggregate_store={url!r} needs zephon.checkpoint.stores.{module}.{name}, which"
            f" could not be loaded ({type(e).__name__}: {e}); install {extra}"
        ) from e
