"""A ring maps a slot's pages in one call the first time a process uses it (``madvise``
populate, sized by the last message committed): the messages are the same bytes with it,
and without it (a kernel that does not know the advice)."""

from __future__ import annotations

import numpy as np
import pytest

import zephon.shm.ring as ring_module
from zephon.shm import ShmRing


@pytest.mark.parametrize("populate", [True, False])
def test_messages_are_the_same_with_the_slots_mapped_at_once_or_not(
    populate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ring_module, "_can_populate", populate and ring_module._can_populate)
    rng = np.random.default_rng(0)
    ring = ShmRing.create(3, 1 << 20)
    try:
        for k in range(7):  # every slot used twice and more, the last message smaller
            shape = (100, 1000) if k < 6 else (10, 10)
            a = rng.integers(0, 255, shape, dtype=np.uint8)
            ring.put(f"m{k}".encode(), [a])
            for zero_copy in (False, True):
                if zero_copy:
                    ring.put(f"m{k}".encode(), [a])
                msg = ring.get(timeout_s=1, zero_copy=zero_copy)
                assert bytes(msg.meta) == f"m{k}".encode()
                np.testing.assert_array_equal(msg.arrays[0], a)
                msg.release()
        mapped = list(ring._mapped)
        if ring_module._can_populate:
            assert all(mapped)  # each slot mapped once it was used after a commit
        else:
            assert not any(mapped)
    finally:
        ring.close()
