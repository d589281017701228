"""The etcd backend of the aggregation store: ``aggregate_store="etcd://host:port[,host:port]"``.

It speaks etcd's v3 JSON gateway (the API ``etcd3gw`` wraps; not the ``etcd3`` package, which
no longer imports with protobuf >= 4) directly with the standard library's ``http.client``:
``requests``, under etcd3gw, cost 2.3-2.8 ms of CPU per request where ``http.client`` costs
0.4 ms, which at a thousand ranks is most of a round. No client library is needed.

* **a timeout on every request** (``request_timeout_s``, applied by ``requests`` to the
  connect and to every read), and a server that does not answer in time — refused, reset,
  or SIGSTOPped with the kernel still accepting connections — raises ``AggregationError``
  naming the endpoint rather than hanging;
* **failover**: endpoints are tried in the order given, starting from the last one that
  answered; the error names every endpoint that failed and why. Worst case for one call is
  ``len(endpoints) * request_timeout_s``. A request that timed out may still have been
  applied by the server (as with any RPC); puts are idempotent and fenced writes stay fenced;
* every key lives under ``namespace`` (default ``"zephon/"``; ``etcd://h:p/myjob`` gives
  ``"myjob/"``), so several jobs can share one cluster;
* **etcd's default limits are never hit**: a transaction holds at most 64 operations
  (``--max-txn-ops`` is 128), a request at most ``part_size_bytes`` of value (1 MiB, under
  ``--max-request-bytes`` of 1.5 MiB), range reads are paginated (``list_keys``) and a
  round's keys are removed with one range delete (``delete_prefix``);
* **watches** (``watch(prefix)``): a daemon thread holds one watch stream over the prefix
  (its own HTTP connection) and keeps a local copy of every key under it, so a waiting rank
  sends no requests until something changes. The stream has a read timeout and reconnects
  (a range read, then a watch from the revision after it) after an error, a timeout or a
  compaction that cancelled it;
* **compaction** (``compact()``): etcd keeps every revision of every key until it is
  compacted, and its database quota (2 GiB by default) counts that history. Rounds write
  their states into etcd, so the leader compacts after each committed round (``physical``
  false: etcd frees the space in the background and reuses it; the database file does not
  shrink without a defragmentation, but it stops growing);
* **fencing**: ``announce`` returns an :class:`EtcdFence` — the announcement key and its
  ``mod_revision`` after the put — and a fenced ``put``/``create`` is one transaction
  ``mod_revision(f.key) == f.mod_revision ? write : nothing``; a failed compare raises
  :class:`StaleRoundError`. A newer announcement *or the deletion* of the announcement key
  makes older fences stale;
* **create**: one transaction ``create_revision(key) == 0 ? put : range(key)``, so of
  several racing writers exactly one wins and the others get its value;
* **leases**: ``keep_alive`` grants a lease of ``ceil(ttl_s)`` seconds, puts the key with
  it and refreshes it every ``ttl_s / 3`` from a daemon thread with its own connection;
  ``stop()`` revokes the lease (the key vanishes at once); a dead holder's key vanishes when
  the lease expires (etcd checks expiry about every 0.5 s). A lease the server reports
  expired is never re-granted (the followers may already have given up on this leader):
  the handle's ``lost`` turns True instead. ``lost`` is also True once ``ttl_s`` has passed
  since the last refresh the server confirmed, so a holder that was paused (SIGSTOP) knows
  at once when it resumes, before its refresher thread has run;
* **large values are split**: a value of more than ``part_size_bytes`` is written as
  numbered parts under ``<key>#zephon-part/<nonce>/<i>`` followed by a small manifest at
  ``<key>`` itself, written last (and fenced or conditional, when asked), so a reader sees
  either the old value or the whole new one. ``get`` reads the parts at the manifest's
  revision (a consistent snapshot even if the key is overwritten meanwhile); overwriting or
  deleting the key removes the old parts. Values are framed with one tag byte (inline or
  manifest), so keys written by other tools are reported as foreign rather than misread.

The package, one concern a module: :mod:`~.gateway` (the JSON gateway over ``http.client``:
URLs, endpoints, failover), :mod:`~.store` (:class:`EtcdStore`), :mod:`~.fence`
(:class:`EtcdFence` and the fenced and conditional transactions), :mod:`~.parts` (the tag
byte, large values in parts), :mod:`~.lease` (:class:`EtcdLease`) and :mod:`~.watch`
(:class:`EtcdWatch`).
"""

from zephon.checkpoint.stores.etcd.fence import EtcdFence
from zephon.checkpoint.stores.etcd.gateway import DEFAULT_PORT, parse_etcd_url
from zephon.checkpoint.stores.etcd.lease import EtcdLease
from zephon.checkpoint.stores.etcd.parts import DEFAULT_PART_SIZE_BYTES
from zephon.checkpoint.stores.etcd.store import (
    DEFAULT_NAMESPACE,
    DEFAULT_REQUEST_TIMEOUT_S,
    LIST_PAGE_KEYS,
    MAX_TXN_OPS,
    EtcdStore,
)
from zephon.checkpoint.stores.etcd.watch import WATCH_READ_TIMEOUT_S, EtcdWatch

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_PART_SIZE_BYTES",
    "DEFAULT_PORT",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "LIST_PAGE_KEYS",
    "MAX_TXN_OPS",
    "WATCH_READ_TIMEOUT_S",
    "EtcdFence",
    "EtcdLease",
    "EtcdStore",
    "EtcdWatch",
    "parse_etcd_url",
]
