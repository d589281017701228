"""One process of the two-process JaxStore test.

    python _store_jax_worker.py PORT PROCESS_ID NUM_PROCESSES

Initialises jax.distributed on the CPU backend (gloo collectives) with the coordinator on
127.0.0.1:PORT (process 0 hosts it), runs the Store contract on process 0, then checks that
each process sees what the other wrote, and prints ``OK <process_id>``.

Then the stalled-coordinator check, driven by the parent through process 1's stdin: the
parent SIGSTOPs process 0 and sends ``go``; process 1's ``get`` must fail with an
AggregationError naming the coordinator within its request timeout (prints
``STALL_OK <seconds>``); the parent SIGCONTs process 0 and sends ``resumed``; the store
works again (``RESUMED_OK``), within a minute of tries on a busy machine. Both processes print ``DONE`` after shutting down.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from tests.integration._store_contract import (
    check_large_values,
    check_plain_keep_alive,
    check_protocol,
    check_put_get_delete,
)
from zephon.checkpoint.stores.jax_store import JaxStore
from zephon.errors import AggregationError


def main() -> None:
    port, pid, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    try:
        JaxStore()
    except AggregationError as e:
        assert "not initialised" in str(e), e
    else:
        raise AssertionError("JaxStore() before jax.distributed.initialize must raise")

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        initialization_timeout=60,
    )
    from jax._src.distributed import global_state

    client = global_state.client
    store = JaxStore.from_url("jax:///jaxtest")
    assert store.describe().startswith(f"jax://127.0.0.1:{port}"), store.describe()
    check_protocol(store)
    if pid == 0:
        check_put_get_delete(store, "c/")
        check_large_values(store, "c/", 3 << 20)
        check_plain_keep_alive(store, "c/")
        assert store.announce("c/round", b"r1") is None, "no fencing on jax://"
        store.put("c/merged", b"m", fence=None)
    client.wait_at_barrier("contract_done", 60_000)

    store.put(f"x/from_{pid}", f"hello from {pid}".encode())
    client.wait_at_barrier("written", 60_000)
    for other in range(n):
        got = store.get(f"x/from_{other}")
        assert got == f"hello from {other}".encode(), (other, got)
    assert store.get("c/merged") == b"m"
    client.wait_at_barrier("read", 60_000)
    if pid == 0:
        for other in range(n):
            store.delete(f"x/from_{other}")
    client.wait_at_barrier("deleted", 60_000)
    assert store.get(f"x/from_{pid}") is None
    print(f"OK {pid}", flush=True)

    if pid == 1:
        bounded = JaxStore(namespace="jaxtest", request_timeout_s=1.0)
        assert sys.stdin.readline().strip() == "go"
        t0 = time.monotonic()
        try:
            got = bounded.get("c/merged")
        except AggregationError as e:
            assert f"jax://127.0.0.1:{port}" in str(e) and "did not answer" in str(e), e
        else:
            raise AssertionError(
                f"get on a stalled coordinator must raise; it returned {got!r} after "
                f"{time.monotonic() - t0:.2f} s"
            )
        print(f"STALL_OK {time.monotonic() - t0:.2f}", flush=True)
        assert sys.stdin.readline().strip() == "resumed"
        # The same store works again once the coordinator runs: within a few tries of its
        # 1 s timeout (a coordinator just woken on a busy machine may take longer at first).
        deadline = time.monotonic() + 60
        while True:
            try:
                got = bounded.get("c/merged")
                break
            except AggregationError:
                if time.monotonic() > deadline:
                    raise
        assert got == b"m", got
        bounded.close()
        print("RESUMED_OK", flush=True)
    client.wait_at_barrier("end", 60_000)
    store.close()
    jax.distributed.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
