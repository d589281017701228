"""Stores that multi-rank checkpoint rounds run over (see :mod:`zephon.checkpoint.aggregate`).

Only the directory store is imported here; the etcd, JAX and torch stores import their
client libraries, so :func:`zephon.checkpoint.aggregate.open_store` loads them on demand.
"""

from zephon.checkpoint.stores.base import StaleRoundError, Store, poll_delays
from zephon.checkpoint.stores.directory import DirectoryStore

__all__ = ["DirectoryStore", "StaleRoundError", "Store", "poll_delays"]
