"""Holds an etcd lease until killed: the "dead leader" of the keep_alive tests.

    python _store_etcd_holder.py ETCD_URL KEY TTL_S

Puts KEY with ``keep_alive``, prints ``ready`` and sleeps; the test SIGKILLs it and checks
that KEY vanishes within the TTL.
"""

from __future__ import annotations

import sys
import time

from zephon.checkpoint.stores.etcd import EtcdStore


def main() -> None:
    url, key, ttl_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    store = EtcdStore.from_url(url, request_timeout_s=1.0)
    store.keep_alive(key, b"holder", ttl_s)
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
