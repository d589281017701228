"""ShmRing behaviour, run once per core (see conftest.py)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import struct
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from zephon.errors import RingError, ShmError
from zephon.shm import (
    PAYLOAD_PHASE,
    PHASED_ARRAY_MIN_BYTES,
    RingClosedError,
    ShmRing,
    create_segment,
    message_nbytes,
    plan_layout,
)


def sample_arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(-(2**31), 2**31, size=(7, 33), dtype=np.int32),
        rng.random(1000, dtype=np.float32),
        rng.integers(0, 256, size=(3, 5, 2), dtype=np.uint8),
        np.array(seed, dtype=np.int32),  # 0-d
        np.zeros((0, 4), dtype=np.float32),  # empty
        rng.random(20_000, dtype=np.float32),  # large: phased placement
    ]


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def slot_offset_of(ring: ShmRing, array: np.ndarray) -> int:
    """Offset of an array inside its slot."""
    base = np.frombuffer(ring._view, np.uint8, count=1).ctypes.data
    return (array.ctypes.data - base - ring._slots_offset) % ring.slot_bytes


# -- round trips -------------------------------------------------------------


def test_round_trip_meta_and_several_arrays(rings) -> None:
    producer, consumer = rings
    arrays = sample_arrays(1)
    meta = msgpack.packb({"contributors": [[0, 1, 0, True]], "cursor": [3, 4, 5, 0]})
    nbytes = producer.put(meta, arrays, timeout_s=1)
    assert nbytes == message_nbytes(len(meta), arrays)
    with consumer.get(timeout_s=1) as message:
        assert message.meta == meta
        assert message.nbytes == nbytes
        assert_same(message.arrays, arrays)
        assert not message.released
    assert message.released


def test_round_trip_of_noncontiguous_byteswapped_and_bool_arrays(rings) -> None:
    producer, consumer = rings
    base = np.arange(60, dtype=np.int64).reshape(6, 10)
    arrays = [
        base[::2, 1::3],
        base.T,
        np.arange(5, dtype=">i4"),
        np.array([True, False, True]),
        np.array([b"ab", b"c"], dtype="S2"),
    ]
    producer.put(b"", arrays, timeout_s=1)
    message = consumer.get(timeout_s=1)
    assert_same(message.arrays, arrays)
    assert message.arrays[2].dtype.str == ">i4"
    message.release()


def test_message_without_arrays_and_without_meta(rings) -> None:
    producer, consumer = rings
    producer.put(b"only meta", timeout_s=1)
    producer.put(b"", timeout_s=1)
    first, second = consumer.get(timeout_s=1), consumer.get(timeout_s=1)
    assert (first.meta, first.arrays, second.meta, second.arrays) == (b"only meta", [], b"", [])
    first.release()
    second.release()


def test_zero_copy_false_returns_independent_copies_and_frees_the_slot(make_rings) -> None:
    producer, consumer = make_rings(nslots=1)
    arrays = sample_arrays(2)
    producer.put(b"m", arrays, timeout_s=1)
    message = consumer.get(timeout_s=1, zero_copy=False)
    assert message.released
    assert all(a.flags.owndata for a in message.arrays)
    producer.put(b"next", [np.full(5, 9, np.int32)], timeout_s=1)  # the one slot is free
    assert_same(message.arrays, arrays)  # not overwritten
    consumer.get(timeout_s=1).release()


def test_zero_copy_views_point_into_the_slot(rings) -> None:
    producer, consumer = rings
    producer.put(b"", [np.arange(PHASED_ARRAY_MIN_BYTES, dtype=np.uint8)], timeout_s=1)
    message = consumer.get(timeout_s=1)
    view = message.arrays[0]
    assert not view.flags.owndata
    assert slot_offset_of(consumer, view) % 4096 == PAYLOAD_PHASE
    message.release()


# -- order -------------------------------------------------------------------


def test_fifo_order_and_wraparound_over_many_messages(make_rings) -> None:
    producer, consumer = make_rings(nslots=3, slot_bytes=8192)
    sent = received = 0
    for burst in [1, 3, 2, 3, 1] * 60:  # 600 messages, the slot index wraps 200 times
        for _ in range(burst):
            producer.put(struct.pack("<I", sent), [np.full(sent % 50, sent, np.int64)], 1)
            sent += 1
        for _ in range(burst):
            with consumer.get(timeout_s=1) as message:
                assert struct.unpack("<I", message.meta)[0] == received
                np.testing.assert_array_equal(message.arrays[0], np.full(received % 50, received))
            received += 1
    assert sent == received == 600


def test_out_of_order_release_keeps_fifo_and_frees_in_order(make_rings) -> None:
    producer, consumer = make_rings(nslots=3, slot_bytes=4096)
    for i in range(3):
        producer.put(bytes([i]), timeout_s=1)
    messages = [consumer.get(timeout_s=1) for _ in range(3)]
    assert [m.meta for m in messages] == [b"\0", b"\1", b"\2"]
    messages[2].release()
    messages[1].release()
    with pytest.raises(TimeoutError):  # the oldest slot is still held
        producer.reserve(timeout_s=0)
    messages[0].release()  # now all three come back at once
    for i in range(3, 6):
        producer.put(bytes([i]), timeout_s=0)
    assert [consumer.get(timeout_s=0, zero_copy=False).meta for _ in range(3)] == [
        b"\3",
        b"\4",
        b"\5",
    ]


def test_a_kept_array_view_holds_its_slot_until_dropped(make_rings) -> None:
    producer, consumer = make_rings(nslots=1)
    producer.put(b"", [np.arange(10)], timeout_s=1)
    kept = consumer.get(timeout_s=1).arrays[0]  # the Message itself is dropped at once
    with pytest.raises(TimeoutError):
        producer.reserve(timeout_s=0)  # the view still pins the slot: no silent overwrite
    np.testing.assert_array_equal(kept[2:], np.arange(2, 10))
    del kept
    gc.collect()
    producer.put(b"again", timeout_s=0)
    consumer.get(timeout_s=0).release()


# -- timeouts ----------------------------------------------------------------


def test_full_ring_reserve_times_out_within_the_timeout(make_rings) -> None:
    producer, consumer = make_rings(nslots=2, slot_bytes=4096)
    producer.put(b"a", timeout_s=1)
    producer.put(b"b", timeout_s=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="is full"):
        producer.reserve(timeout_s=0.2)
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 1.0
    with pytest.raises(TimeoutError):
        producer.put(b"c", timeout_s=0)


def test_empty_ring_get_times_out_within_the_timeout(rings) -> None:
    _, consumer = rings
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="is empty"):
        consumer.get(timeout_s=0.2)
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 1.0
    with pytest.raises(TimeoutError):
        consumer.get(timeout_s=0)


def test_negative_timeout_is_rejected(rings) -> None:
    producer, consumer = rings
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        consumer.get(timeout_s=-1)
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        producer.reserve(timeout_s=-0.5)


def test_a_blocked_get_wakes_when_a_message_arrives(rings) -> None:
    producer, consumer = rings
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(consumer.get(timeout_s=5).meta))
    waiter.start()
    time.sleep(0.1)
    start = time.monotonic()
    producer.put(b"wake", timeout_s=1)
    waiter.join(timeout=5)
    assert got == [b"wake"]
    assert time.monotonic() - start < 0.5


def test_a_signal_handler_interrupts_an_infinite_wait(rings) -> None:
    _, consumer = rings

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        start = time.monotonic()
        with pytest.raises(Interrupted):
            consumer.get()  # forever
        assert time.monotonic() - start < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- close -------------------------------------------------------------------


def _blocked(call, *args) -> tuple[threading.Thread, list[BaseException], list[float]]:
    errors: list[BaseException] = []
    finished: list[float] = []

    def run() -> None:
        try:
            call(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)
        finished.append(time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)  # let it block
    return thread, errors, finished


@pytest.mark.parametrize("closer", ["peer", "self"])
def test_close_wakes_a_blocked_get_in_another_thread(rings, closer) -> None:
    producer, consumer = rings
    thread, errors, finished = _blocked(consumer.get, 30)
    closed_at = time.monotonic()
    (producer if closer == "peer" else consumer).close()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert finished[0] - closed_at < 1.0
    assert isinstance(errors[0], RingClosedError) and isinstance(errors[0], EOFError)


@pytest.mark.parametrize("closer", ["peer", "self"])
def test_close_wakes_a_blocked_reserve_in_another_thread(make_rings, closer) -> None:
    producer, consumer = make_rings(nslots=1)
    producer.put(b"fill", timeout_s=1)
    thread, errors, finished = _blocked(producer.reserve, 30)
    closed_at = time.monotonic()
    (consumer if closer == "peer" else producer).close()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert finished[0] - closed_at < 1.0
    assert isinstance(errors[0], RingClosedError)


def test_consumer_drains_after_the_producer_closes(rings) -> None:
    producer, consumer = rings
    producer.put(b"1", timeout_s=1)
    producer.put(b"2", timeout_s=1)
    producer.close()
    assert consumer.closed
    assert consumer.get(timeout_s=1, zero_copy=False).meta == b"1"
    assert consumer.get(timeout_s=1, zero_copy=False).meta == b"2"
    with pytest.raises(RingClosedError, match="closed and drained"):
        consumer.get(timeout_s=1)
    with pytest.raises(EOFError):
        consumer.get(timeout_s=0)


def test_reserve_fails_at_once_after_the_consumer_closes(rings) -> None:
    producer, consumer = rings
    consumer.close()
    start = time.monotonic()
    with pytest.raises(RingClosedError, match="cannot reserve"):
        producer.reserve(timeout_s=10)
    assert time.monotonic() - start < 0.5


def test_use_after_local_close_raises_and_close_is_idempotent(rings) -> None:
    producer, consumer = rings
    producer.close()
    producer.close()
    assert producer.closed
    with pytest.raises(RingClosedError, match="closed by this process"):
        producer.put(b"x", timeout_s=0)
    consumer.close()
    with pytest.raises(RingClosedError):
        consumer.get(timeout_s=0)


def test_release_and_views_survive_closing_the_ring(rings) -> None:
    producer, consumer = rings
    producer.put(b"", [np.arange(100, dtype=np.int32)], timeout_s=1)
    message = consumer.get(timeout_s=1)
    consumer.close()  # the mapping stays while the view lives
    np.testing.assert_array_equal(message.arrays[0], np.arange(100))
    message.release()  # a no-op once closed


def test_context_manager_closes_the_ring_and_its_descriptor() -> None:
    with ShmRing.create(2, 4096, name="zephon-ring-test") as ring:
        fd = ring.fileno()
        assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:zephon-ring-test (deleted)"
        with ShmRing.attach(os.dup(ring.fileno())) as other:
            assert other.name == "zephon-ring-test"
            other_fd = other.fileno()
    assert ring.closed and other.closed
    for gone in (fd, other_fd):
        with pytest.raises(OSError):
            os.fstat(gone)
    with pytest.raises(ShmError, match="is closed"):
        ring.fileno()


def test_a_ring_has_no_name_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    with ShmRing.create(2, 4096, name="zephon-ring-nameless") as ring:
        assert not [n for n in set(os.listdir("/dev/shm")) - before if "nameless" in n]
        assert "/memfd:zephon-ring-nameless" in Path("/proc/self/maps").read_text()
    assert ring.closed


def test_rings_refuse_pickling(rings) -> None:
    with pytest.raises(TypeError, match=r"ring.fileno\(\).*ShmRing.attach\(fd\)"):
        pickle.dumps(rings[0])


# -- sizes and validation ------------------------------------------------------


def test_oversize_put_quotes_both_sizes_and_the_fix(make_rings) -> None:
    producer, consumer = make_rings(nslots=2, slot_bytes=8192)
    big = np.zeros(3000, dtype=np.float32)
    need = message_nbytes(3, [big])
    with pytest.raises(ValueError) as info:
        producer.put(b"abc", [big], timeout_s=1)
    text = str(info.value)
    assert f"needs {need} bytes" in text and "hold 8192 bytes" in text
    assert "raise slot_bytes" in text
    with pytest.raises(TimeoutError):  # nothing was written or reserved
        consumer.get(timeout_s=0)
    producer.put(b"small", timeout_s=0)  # the ring still works
    consumer.get(timeout_s=0).release()


def test_oversize_in_place_array_and_metadata(make_rings) -> None:
    producer, consumer = make_rings(nslots=2, slot_bytes=4096)
    with pytest.raises(ValueError, match="slots hold 4096 bytes"):
        with producer.reserve(timeout_s=1) as slot:
            slot.array(4096, np.uint8)  # the with block aborts the slot
    with producer.reserve(timeout_s=1) as slot:
        slot.array(1000, np.uint8)
        with pytest.raises(ValueError, match="slots hold 4096 bytes; raise slot_bytes"):
            slot.commit(b"m" * 4000)
        slot.commit(b"m" * 100)
    assert consumer.get(timeout_s=1, zero_copy=False).meta == b"m" * 100


def test_slot_bytes_is_rounded_up_to_pages_and_arguments_are_checked() -> None:
    with ShmRing.create(3, 5000) as ring:
        assert (ring.nslots, ring.slot_bytes) == (3, 8192)
    with pytest.raises(ValueError, match="nslots"):
        ShmRing.create(0, 4096)
    with pytest.raises(ValueError, match="slot_bytes"):
        ShmRing.create(1, 0)


def test_object_and_structured_dtypes_are_rejected(rings) -> None:
    producer, consumer = rings
    with pytest.raises(ValueError, match="plain numeric"):
        producer.put(b"", [np.array([object()])], timeout_s=1)
    with pytest.raises(ValueError, match="plain numeric"):
        producer.put(b"", [np.zeros(2, dtype=[("a", "i4")])], timeout_s=1)
    with pytest.raises(TimeoutError):
        consumer.get(timeout_s=0)


def test_attach_to_a_segment_with_a_bad_magic_is_a_ring_error() -> None:
    with create_segment(1 << 16, name="not-a-ring") as segment:
        segment.mmap[:8] = b"NOTARING"
        with pytest.raises(RingError, match="'not-a-ring' failed: .*bad magic"):
            ShmRing.attach(os.dup(segment.fileno()))


def test_attach_to_a_ring_of_another_layout_version_is_a_ring_error() -> None:
    with ShmRing.create(2, 4096) as ring:
        ring._segment.mmap[8:12] = struct.pack("<I", 99)
        with pytest.raises(RingError, match="layout version"):
            ShmRing.attach(os.dup(ring.fileno()))


def test_attach_to_a_truncated_ring_is_a_ring_error() -> None:
    with ShmRing.create(4, 8192) as ring:
        with create_segment(4096 * 3) as short:
            short.mmap[:] = ring._segment.mmap[: 4096 * 3]
            with pytest.raises(RingError, match="does not match the segment size"):
                ShmRing.attach(os.dup(short.fileno()))


def test_attach_to_a_bad_descriptor_is_a_shm_error(tmp_path) -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(ShmError, match=f"cannot attach 'pipe:.*' \\(fd {read_end}\\): it is empty"):
        ShmRing.attach(read_end)
    directory = os.open(tmp_path, os.O_RDONLY)
    with pytest.raises(ShmError, match=f"cannot map '{tmp_path}' \\(fd {directory}\\)"):
        ShmRing.attach(directory)
    for taken in (read_end, directory):  # attach took them over, and closed them on failure
        with pytest.raises(OSError):
            os.fstat(taken)
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    with pytest.raises(ShmError, match=f"cannot attach fd {closed}"):
        ShmRing.attach(closed)


def test_a_corrupt_frame_is_a_ring_error_and_the_slot_is_released(make_rings) -> None:
    producer, consumer = make_rings(nslots=1)
    with producer.reserve(timeout_s=1) as slot:
        slot.commit(b"meta")
        memoryview(slot._memory).cast("B")[0:4] = b"XXXX"  # clobber the frame after commit
    with pytest.raises(RingError, match="does not hold a valid message"):
        consumer.get(timeout_s=1)
    producer.put(b"ok", timeout_s=0)  # the bad slot was handed back
    assert consumer.get(timeout_s=0, zero_copy=False).meta == b"ok"


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_known_layout_is_still_checked_against_each_message_length(
    make_rings, zero_copy: bool
) -> None:
    """Layouts are parsed once and cached by their descriptor bytes; a later message with
    the same descriptors but a shorter committed length must still be rejected."""
    producer, consumer = make_rings(nslots=2)
    producer.put(b"a", [np.arange(4096, dtype=np.int64)], timeout_s=1)
    first = consumer.get(timeout_s=1, zero_copy=zero_copy)
    np.testing.assert_array_equal(first.arrays[0], np.arange(4096))
    first.release()
    slot = producer.reserve(timeout_s=1)
    np.copyto(slot.array(4096, np.int64), np.arange(4096))
    end = slot.commit(b"b")
    assert consumer.get(timeout_s=1, zero_copy=zero_copy).meta == b"b"
    # The same frame bytes again in the next slot, published as half as long.
    again = producer.reserve(timeout_s=1)
    again._memory[:end] = slot._memory[:end]
    producer._commit_slot(again.index, end // 2)
    again._done = True  # published by hand
    with pytest.raises(RingError, match="past the message"):
        consumer.get(timeout_s=1, zero_copy=zero_copy)


# -- in-place writing ----------------------------------------------------------


def test_in_place_slot_arrays_reach_the_consumer(rings) -> None:
    producer, consumer = rings
    rows = [np.arange(i, i + 128, dtype=np.int32) for i in range(16)]
    with producer.reserve(timeout_s=1) as slot:
        tokens = slot.array((16, 128), np.int32)
        np.stack(rows, out=tokens)
        mask = slot.array(16, np.uint8)
        mask[:] = 1
        scalar = slot.array((), np.float32)
        scalar[()] = 0.5
        slot.commit(b"batch")
    with consumer.get(timeout_s=1) as message:
        np.testing.assert_array_equal(message.arrays[0], np.stack(rows))
        np.testing.assert_array_equal(message.arrays[1], np.ones(16, np.uint8))
        assert message.arrays[2].shape == () and message.arrays[2] == np.float32(0.5)
        assert message.meta == b"batch"


def test_plan_layout_offsets_are_aligned_and_phased() -> None:
    sizes = [10, PHASED_ARRAY_MIN_BYTES, 0, 3 * 4096 + 5, 64]
    offsets = plan_layout(sizes)
    assert all(o % 64 == 0 and o >= 64 for o in offsets)
    for size, offset in zip(sizes, offsets, strict=True):
        if size >= PHASED_ARRAY_MIN_BYTES:
            assert offset % 4096 == PAYLOAD_PHASE
    ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))
    with pytest.raises(ValueError):
        plan_layout([-1])


def test_explicit_offsets_from_plan_layout(make_rings) -> None:
    producer, consumer = make_rings(slot_bytes=1 << 17)
    a, b = np.arange(20_000, dtype=np.float32), np.arange(7, dtype=np.int16)
    offsets = plan_layout([b.nbytes, a.nbytes])  # written in another order than allocated
    with producer.reserve(timeout_s=1) as slot:
        va = slot.array(a.shape, a.dtype, offset=offsets[1])
        vb = slot.array(b.shape, b.dtype, offset=offsets[0])
        va[:], vb[:] = a, b
        with pytest.raises(ValueError, match="overlaps"):
            slot.array(10, np.uint8, offset=offsets[1])
        with pytest.raises(ValueError, match="multiple of 64"):
            slot.array(10, np.uint8, offset=100)
        slot.commit(b"")
    with consumer.get(timeout_s=1) as message:
        assert_same(message.arrays, [a, b])
        assert slot_offset_of(consumer, message.arrays[0]) == offsets[1]


def test_metadata_goes_after_the_arrays_when_the_front_gap_is_too_small(rings) -> None:
    producer, consumer = rings
    meta = bytes(range(256)) * 12  # 3 KiB: does not fit in front of a phased array
    arrays = [np.arange(PHASED_ARRAY_MIN_BYTES // 4, dtype=np.int32)]
    producer.put(meta, arrays, timeout_s=1)
    with consumer.get(timeout_s=1) as message:
        assert message.meta == meta
        assert_same(message.arrays, arrays)
        assert message.nbytes > PAYLOAD_PHASE + arrays[0].nbytes + len(meta)


def test_abort_and_exceptions_skip_the_slot(make_rings) -> None:
    producer, consumer = make_rings(nslots=4)
    with pytest.raises(KeyError):
        with producer.reserve(timeout_s=1) as slot:
            slot.array(10, np.int32)[:] = 1
            raise KeyError("batch failed")
    slot = producer.reserve(timeout_s=1)
    slot.abort()
    slot.abort()
    with pytest.raises(RingError, match="never committed"):
        with producer.reserve(timeout_s=1):
            pass
    producer.put(b"real", timeout_s=1)
    assert consumer.get(timeout_s=1, zero_copy=False).meta == b"real"
    with pytest.raises(TimeoutError):
        consumer.get(timeout_s=0)


def test_a_slot_cannot_be_used_after_commit(rings) -> None:
    producer, consumer = rings
    slot = producer.reserve(timeout_s=1)
    slot.commit(b"once")
    with pytest.raises(RingError, match="already committed"):
        slot.commit(b"twice")
    with pytest.raises(RingError, match="already committed"):
        slot.array(1, np.uint8)
    consumer.get(timeout_s=1).release()


def test_raw_slot_buffer_is_writable_and_slot_sized(rings) -> None:
    producer, consumer = rings
    with producer.reserve(timeout_s=1) as slot:
        raw = slot.buffer
        assert raw.nbytes == producer.slot_bytes and not raw.readonly
        raw.release()
        slot.commit(b"")
    consumer.get(timeout_s=1).release()


def test_a_dropped_slot_writer_is_aborted_instead_of_stalling_the_ring(make_rings) -> None:
    producer, consumer = make_rings(nslots=1)
    producer.reserve(timeout_s=1).array(10, np.int32)[:] = 5  # writer dropped at once
    with pytest.raises(TimeoutError):
        consumer.get(timeout_s=0)  # skips the aborted slot, hands it back
    producer.put(b"after", timeout_s=0)
    assert consumer.get(timeout_s=0, zero_copy=False).meta == b"after"


def test_a_forked_copy_dropping_the_ring_does_not_close_it(rings) -> None:
    producer, consumer = rings
    pid = os.fork()
    if pid == 0:  # child: finalize the inherited objects, leave without atexit
        code = 0
        try:
            producer.__del__()  # what garbage collection would run
            consumer.__del__()
        except BaseException:  # noqa: BLE001 - report through the exit code
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not producer.closed and not consumer.closed
    producer.put(b"still open", timeout_s=0)
    assert consumer.get(timeout_s=0, zero_copy=False).meta == b"still open"
