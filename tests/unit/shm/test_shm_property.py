"""Property: any interleaving of reserve/commit/abort/put/get/release on one ring
preserves every message's contents and the FIFO order, and the ring is full or
empty exactly when a model says so."""

from __future__ import annotations

import os
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon.shm import ShmRing

SLOT_BYTES = 64 * 1024
DTYPES = [np.uint8, np.int32, np.float32]


def message_for(seq: int, data: st.DataObject) -> tuple[bytes, list[np.ndarray]]:
    extra = data.draw(st.binary(max_size=300), label="meta")
    shapes = data.draw(
        st.lists(
            st.tuples(st.sampled_from(DTYPES), st.integers(0, 3000), st.booleans()), max_size=3
        ),
        label="arrays",
    )
    rng = np.random.default_rng(seq)
    arrays = []
    for dtype, n, scalar in shapes:
        if scalar:
            arrays.append(np.array(rng.integers(0, 100), dtype=dtype))
        else:
            arrays.append(rng.integers(0, 100, size=n).astype(dtype))
    return struct.pack("<Q", seq) + extra, arrays


def check(message, expected: tuple[bytes, list[np.ndarray]]) -> None:
    meta, arrays = expected
    assert message.meta == meta
    assert len(message.arrays) == len(arrays)
    for got, want in zip(message.arrays, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nslots=st.integers(1, 4))
def test_random_interleavings_preserve_contents_and_order(data, nslots) -> None:
    with (
        ShmRing.create(nslots, SLOT_BYTES) as producer,
        ShmRing.attach(os.dup(producer.fileno())) as consumer,
    ):
        expected: dict[int, tuple[bytes, list[np.ndarray]]] = {}
        status: list[str] = []  # per reservation: "open", "committed" or "aborted"
        released: list[bool] = []
        writers: dict[int, object] = {}
        held: dict[int, object] = {}
        next_get = 0

        def head() -> int:
            n = 0
            while n < len(status) and status[n] != "open":
                n += 1
            return n

        def tail() -> int:
            n = 0
            while n < len(released) and released[n]:
                n += 1
            return n

        def reserve_expect_ok() -> bool:
            return len(status) - tail() < nslots

        def fill(slot, seq: int) -> None:
            meta, arrays = expected[seq]
            for a in arrays:
                slot.array(a.shape, a.dtype)[...] = a

        ops = st.sampled_from(["reserve", "commit", "abort", "put", "get", "release"])
        for _ in range(data.draw(st.integers(1, 40), label="steps")):
            op = data.draw(ops, label="op")
            if op in ("reserve", "put"):
                seq = len(status)
                ok = reserve_expect_ok()
                if op == "put":
                    expected[seq] = message_for(seq, data)
                    try:
                        producer.put(*expected[seq], timeout_s=0)
                    except TimeoutError:
                        assert not ok
                        del expected[seq]
                        continue
                    assert ok
                    status.append("committed")
                    released.append(False)
                    continue
                try:
                    slot = producer.reserve(timeout_s=0)
                except TimeoutError:
                    assert not ok
                    continue
                assert ok
                expected[seq] = message_for(seq, data)
                fill(slot, seq)
                writers[seq] = slot
                status.append("open")
                released.append(False)
            elif op in ("commit", "abort") and writers:
                seq = data.draw(st.sampled_from(sorted(writers)), label="writer")
                slot = writers.pop(seq)
                if op == "commit":
                    slot.commit(expected[seq][0])
                    status[seq] = "committed"
                else:
                    slot.abort()
                    status[seq] = "aborted"
            elif op == "get":
                # get() skips aborted slots, handing them back.
                while next_get < head() and status[next_get] == "aborted":
                    released[next_get] = True
                    next_get += 1
                zero_copy = data.draw(st.booleans(), label="zero_copy")
                try:
                    message = consumer.get(timeout_s=0, zero_copy=zero_copy)
                except TimeoutError:
                    assert next_get >= head()
                    continue
                assert next_get < head()
                check(message, expected[next_get])
                if zero_copy:
                    held[next_get] = message
                else:
                    released[next_get] = True
                next_get += 1
            elif op == "release" and held:
                seq = data.draw(st.sampled_from(sorted(held)), label="held")
                message = held.pop(seq)
                check(message, expected[seq])  # a held slot is never overwritten
                message.release()
                released[seq] = True

        for seq, message in held.items():
            check(message, expected[seq])
            message.release()
        for seq, slot in writers.items():
            slot.abort()
            status[seq] = "aborted"
        held.clear()
        while True:
            try:
                message = consumer.get(timeout_s=0, zero_copy=False)
            except TimeoutError:
                break
            while status[next_get] == "aborted":
                next_get += 1
            check(message, expected[next_get])  # committed after an open writer: in order
            next_get += 1
        assert all(s != "committed" for s in status[next_get:])
