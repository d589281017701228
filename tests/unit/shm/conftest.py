"""Shared fixtures for the shared-memory ring tests.

CI runs this directory twice: as is (native core when built) and with
ZEPHON_PURE_PYTHON=1 (pure-Python core); test_shm_selection.py checks that the
core really matches the environment.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import own_memfds
from zephon.shm import ShmRing


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test must close the segments it made or attached: a descriptor left open
    keeps the memory alive for as long as this process lives."""
    before = own_memfds()
    yield
    gc.collect()  # rings and segments only dropped are closed by garbage collection
    leaked = own_memfds() - before
    for entry in leaked:  # clean up so one leak does not fail every later test
        os.close(int(entry.split(" ", 1)[0]))
    assert not leaked, f"test left shared-memory segments open: {sorted(leaked)}"


RingPair = tuple[ShmRing, ShmRing]


@pytest.fixture
def make_rings() -> Iterator[Callable[..., RingPair]]:
    """Factory: (producer, consumer) over one new ring; both closed afterwards."""
    made: list[ShmRing] = []

    def make(nslots: int = 4, slot_bytes: int = 256 * 1024) -> RingPair:
        producer = ShmRing.create(nslots, slot_bytes)
        made.append(producer)
        consumer = ShmRing.attach(os.dup(producer.fileno()))  # attach takes over the fd
        made.append(consumer)
        return producer, consumer

    yield make
    for ring in made:
        ring.close()


@pytest.fixture
def rings(make_rings: Callable[..., RingPair]) -> RingPair:
    return make_rings()
