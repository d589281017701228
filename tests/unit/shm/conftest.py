"""Shared fixtures for the shared-memory ring tests.

CI runs this directory twice: as is (native core when built) and with
ZEPHON_PURE_PYTHON=1 (pure-Python core); test_shm_selection.py checks that the
core really matches the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from zephon.shm import ShmRing
from zephon.shm.segment import SHM_DIR


def own_segments() -> set[str]:
    prefix = f"zephon_{os.getpid()}_"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test must close and unlink the segments this process created."""
    before = own_segments()
    yield
    leaked = own_segments() - before
    for name in leaked:  # clean up so one leak does not fail every later test
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


RingPair = tuple[ShmRing, ShmRing]


@pytest.fixture
def make_rings() -> Iterator[Callable[..., RingPair]]:
    """Factory: (producer, consumer) over one new ring; both closed, segment unlinked."""
    made: list[ShmRing] = []

    def make(nslots: int = 4, slot_bytes: int = 256 * 1024) -> RingPair:
        producer = ShmRing.create(nslots, slot_bytes)
        made.append(producer)
        consumer = ShmRing.attach(producer.name)
        made.append(consumer)
        return producer, consumer

    yield make
    for ring in made:
        ring.close()
        if ring.owner:
            ring.unlink()


@pytest.fixture
def rings(make_rings: Callable[..., RingPair]) -> RingPair:
    return make_rings()
