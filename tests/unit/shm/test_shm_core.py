"""The two ring cores: same statuses, same header bytes, and they interoperate.

These tests call the cores directly, over anonymous shared mappings, and run
every available core in every run (the native one only when it is built).
"""

from __future__ import annotations

import importlib
import mmap
import struct
import threading
import time
from types import ModuleType

import pytest

from zephon.shm import pyring


def _native() -> ModuleType | None:
    try:
        return importlib.import_module("zephon._ring")
    except ImportError:
        return None


NATIVE = _native()
CORES = [pytest.param(pyring, id="python")]
if NATIVE is not None:
    CORES.append(pytest.param(NATIVE, id="native"))
needs_native = pytest.mark.skipif(NATIVE is None, reason="zephon._ring is not built")

SLOT = 4096


def new_ring(core: ModuleType, nslots: int = 4, slot_bytes: int = SLOT) -> mmap.mmap:
    mem = mmap.mmap(-1, core.required_size(nslots, slot_bytes))
    assert core.init(mem, nslots, slot_bytes) == core.OK
    return mem


@pytest.mark.parametrize("core", CORES)
def test_geometry_and_header_validation(core) -> None:
    assert core.required_size(0, SLOT) == 0
    assert core.required_size(1, SLOT - 1) == 0
    assert core.required_size(1, SLOT) == 2 * SLOT
    assert core.required_size(300, SLOT) == 2 * SLOT + 300 * SLOT  # table spills to a 2nd page
    mem = mmap.mmap(-1, 8 * SLOT)
    assert core.attach(mem)[0] == core.BAD_MAGIC
    assert core.init(mem, 8, SLOT) == core.BAD_SIZE  # needs 9 pages
    assert core.init(mem, 2, SLOT + 1) == core.BAD_SIZE
    assert core.init(memoryview(mem)[64:], 2, SLOT) == core.BAD_ALIGN
    assert core.init(mem, 2, SLOT) == core.OK
    assert core.attach(mem) == (core.OK, 2, SLOT, SLOT)
    assert core.attach(memoryview(mem)[: 2 * SLOT])[0] == core.BAD_SIZE
    mem[8:12] = struct.pack("<I", 2)
    assert core.attach(mem)[0] == core.BAD_VERSION
    assert core.reserve(mem, 0)[0] == core.BAD_VERSION  # every call checks the header


@pytest.mark.parametrize("core", CORES)
def test_statuses_of_misuse(core) -> None:
    mem = new_ring(core, nslots=2)
    assert core.commit(mem, 0, 1) == core.BAD_SLOT  # not reserved
    status, slot = core.reserve(mem, 0)
    assert (status, slot) == (core.OK, 0)
    assert core.commit(mem, 5, 1) == core.BAD_SLOT
    assert core.commit(mem, slot, SLOT + 1) == core.BAD_SIZE
    assert core.release(mem, slot) == core.BAD_SLOT  # not acquired
    assert core.commit(mem, slot, SLOT) == core.OK
    assert core.commit(mem, slot, SLOT) == core.BAD_SLOT  # twice
    assert core.acquire(mem, 0) == (core.OK, 0, SLOT)
    assert core.acquire(mem, 0)[0] == core.TIMEOUT
    assert core.release(mem, 0) == core.OK
    assert core.release(mem, 0) == core.BAD_SLOT  # twice


@pytest.mark.parametrize("core", CORES)
def test_full_empty_and_close(core) -> None:
    mem = new_ring(core, nslots=2)
    for expected_slot in (0, 1):
        status, slot = core.reserve(mem, 0)
        assert (status, slot) == (core.OK, expected_slot)
        assert core.commit(mem, slot, 8) == core.OK
    assert core.reserve(mem, 0)[0] == core.TIMEOUT
    start = time.monotonic()
    assert core.reserve(mem, 50_000_000)[0] == core.TIMEOUT
    assert 0.045 <= time.monotonic() - start < 0.5
    assert not core.is_closed(mem)
    assert core.close(mem) == core.OK
    assert core.close(mem) == core.OK
    assert core.is_closed(mem)
    assert core.reserve(mem, 0)[0] == core.CLOSED
    assert core.acquire(mem, 0) == (core.OK, 0, 8)  # the consumer drains first
    assert core.acquire(mem, -1) == (core.OK, 1, 8)
    assert core.acquire(mem, -1)[0] == core.CLOSED  # then sees the close, even "forever"
    assert core.release(mem, 1) == core.OK  # and may still hand slots back
    assert core.release(mem, 0) == core.OK


@pytest.mark.parametrize("core", CORES)
def test_slots_are_handed_out_in_ring_order_and_released_out_of_order(core) -> None:
    mem = new_ring(core, nslots=3)
    for _ in range(3):
        assert core.commit(mem, core.reserve(mem, 0)[1], 0) == core.OK
    slots = [core.acquire(mem, 0)[1] for _ in range(3)]
    assert slots == [0, 1, 2]
    assert core.release(mem, 2) == core.OK
    assert core.release(mem, 1) == core.OK
    assert core.reserve(mem, 0)[0] == core.TIMEOUT  # slot 0 is still held
    assert core.release(mem, 0) == core.OK
    assert [core.reserve(mem, 0) for _ in range(3)] == [(core.OK, i) for i in range(3)]


@pytest.mark.parametrize("core", CORES)
def test_out_of_order_commit_publishes_in_reservation_order(core) -> None:
    mem = new_ring(core, nslots=3)
    a, b = core.reserve(mem, 0)[1], core.reserve(mem, 0)[1]
    assert core.commit(mem, b, 2) == core.OK
    assert core.acquire(mem, 0)[0] == core.TIMEOUT  # b waits for a
    assert core.commit(mem, a, 1) == core.OK
    assert core.acquire(mem, 0) == (core.OK, a, 1)
    assert core.acquire(mem, 0) == (core.OK, b, 2)


@needs_native
@pytest.mark.parametrize("nslots,slot_bytes", [(1, SLOT), (4, 3 * SLOT), (300, SLOT)])
def test_both_cores_write_the_same_header_bytes(nslots, slot_bytes) -> None:
    native, python = new_ring(NATIVE, nslots, slot_bytes), new_ring(pyring, nslots, slot_bytes)
    offset = pyring.attach(native)[3]
    assert native[:offset] == python[:offset]
    assert native[:8] == b"ZEPHRING"
    for name in ("OK", "TIMEOUT", "CLOSED", "BAD_MAGIC", "BAD_VERSION", "BAD_SIZE", "BAD_SLOT"):
        assert getattr(NATIVE, name) == getattr(pyring, name)
    for name in ("MAGIC", "LAYOUT_VERSION", "SLOT_ALIGN", "PAYLOAD_PHASE", "HEADER_FIXED_BYTES"):
        assert getattr(NATIVE, name) == getattr(pyring, name)


def _pairs() -> list:
    cores = [p.values[0] for p in CORES]
    return [
        pytest.param(p, c, id=f"{p.__name__.split('.')[-1]}-to-{c.__name__.split('.')[-1]}")
        for p in cores
        for c in cores
    ]


@pytest.mark.parametrize("producer_core,consumer_core", _pairs())
def test_cores_interoperate_on_one_mapping(producer_core, consumer_core) -> None:
    nslots, count = 3, 1500
    mem = new_ring(producer_core, nslots)
    slots_offset = consumer_core.attach(mem)[3]
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for i in range(count):
                status, slot = producer_core.reserve(mem, 5_000_000_000)
                assert status == producer_core.OK
                start = slots_offset + slot * SLOT
                mem[start : start + 8] = struct.pack("<Q", i)
                assert producer_core.commit(mem, slot, 8 + i % 100) == producer_core.OK
            producer_core.close(mem)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=produce)
    thread.start()
    for i in range(count):
        status, slot, nbytes = consumer_core.acquire(mem, 5_000_000_000)
        assert status == consumer_core.OK and nbytes == 8 + i % 100
        start = slots_offset + slot * SLOT
        assert struct.unpack("<Q", mem[start : start + 8])[0] == i
        assert consumer_core.release(mem, slot) == consumer_core.OK
    assert consumer_core.acquire(mem, 5_000_000_000)[0] == consumer_core.CLOSED
    thread.join(timeout=10)
    assert not errors, errors


@needs_native
def test_a_python_commit_wakes_a_native_sleeper_through_the_futex() -> None:
    mem = new_ring(NATIVE)
    woke: list[float] = []
    thread = threading.Thread(
        target=lambda: woke.append((NATIVE.acquire(mem, 5_000_000_000), time.monotonic()))
    )
    thread.start()
    time.sleep(0.3)  # asleep in FUTEX_WAIT by now
    committed_at = time.monotonic()
    assert pyring.commit(mem, pyring.reserve(mem, 0)[1], 4) == pyring.OK
    thread.join(timeout=5)
    (status, _slot, nbytes), woke_at = woke[0]
    assert (status, nbytes) == (NATIVE.OK, 4)
    # Without the wake the native side would only notice at its next 100 ms slice.
    assert woke_at - committed_at < 0.08


@needs_native
def test_native_binding_rejects_bad_arguments() -> None:
    mem = new_ring(NATIVE)
    with pytest.raises(BufferError):
        NATIVE.reserve(b"\0" * 8192, 0)  # read-only buffer
    with pytest.raises(ValueError, match="slot index"):
        NATIVE.commit(mem, -1, 0)
    with pytest.raises(TypeError):
        NATIVE.acquire(mem, "soon")
    assert NATIVE.init(mem, 0, SLOT) == NATIVE.BAD_SIZE
    assert NATIVE.commit(mem, 0, -5) == NATIVE.BAD_SIZE


@needs_native
@pytest.mark.parametrize("gap_s", [0.002, 0.0])
def test_a_native_waiter_sleeps_on_a_slow_peer_and_keeps_up_with_a_fast_one(gap_s) -> None:
    """The spin before a futex sleep is short, and only grows while waits are short: a
    consumer waiting on a peer that publishes every 2 ms must not burn its core."""
    mem = new_ring(NATIVE, nslots=2)
    count = 150
    got: list[int] = []
    cpu: list[float] = []

    def consume() -> None:
        c0 = time.thread_time()
        for _ in range(count):
            status, slot, nbytes = NATIVE.acquire(mem, 5_000_000_000)
            assert status == NATIVE.OK
            got.append(nbytes)
            assert NATIVE.release(mem, slot) == NATIVE.OK
        cpu.append(time.thread_time() - c0)

    thread = threading.Thread(target=consume)
    t0 = time.monotonic()
    thread.start()
    for i in range(count):
        status, slot = NATIVE.reserve(mem, 5_000_000_000)
        assert status == NATIVE.OK
        assert NATIVE.commit(mem, slot, i + 1) == NATIVE.OK
        if gap_s:
            time.sleep(gap_s)
    thread.join(timeout=30)
    wall = time.monotonic() - t0
    assert got == list(range(1, count + 1))
    if gap_s:
        # Spinning through the gaps would cost about the whole wall time.
        assert cpu[0] < 0.25 * wall, (cpu[0], wall)
