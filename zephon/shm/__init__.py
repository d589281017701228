"""Shared memory between worker processes and the parent.

``ShmRing`` is a single-producer/single-consumer ring of slots in a shared memfd
(``zephon.shm.segment``: anonymous, passed to the other process as a file descriptor
with ``send_fds``/``recv_fds``, so no kill of any process leaves anything behind). Its
core is the C extension ``zephon._ring`` unless ``ZEPHON_PURE_PYTHON=1`` is set or the
extension is not built, in which case the pure-Python twin ``zephon.shm.pyring`` (same
layout, same semantics) runs. ``IMPLEMENTATION`` is ``"native"`` or ``"python"``
accordingly.
"""

from zephon.shm.fds import recv_fds, send_fds
from zephon.shm.frame import (
    FRAME_NBYTES,
    PAYLOAD_PHASE,
    PHASED_ARRAY_MIN_BYTES,
    message_nbytes,
    plan_layout,
)
from zephon.shm.message import Message
from zephon.shm.ring import IMPLEMENTATION, RingClosedError, ShmRing
from zephon.shm.segment import (
    Segment,
    attach_segment,
    available_memory_bytes,
    create_segment,
)
from zephon.shm.writer import SlotWriter

__all__ = [
    "FRAME_NBYTES",
    "IMPLEMENTATION",
    "PAYLOAD_PHASE",
    "PHASED_ARRAY_MIN_BYTES",
    "Message",
    "RingClosedError",
    "Segment",
    "ShmRing",
    "SlotWriter",
    "attach_segment",
    "available_memory_bytes",
    "create_segment",
    "message_nbytes",
    "plan_layout",
    "recv_fds",
    "send_fds",
]
