"""Shared-memory transport between worker processes and the parent.

``ShmRing`` is a single-producer/single-consumer ring of slots in a ``/dev/shm``
segment. Its core is the C extension ``zephon._ring`` unless
``ZEPHON_PURE_PYTHON=1`` is set or the extension is not built, in which case the
pure-Python twin ``zephon.shm.pyring`` (same layout, same semantics) runs.
``IMPLEMENTATION`` is ``"native"`` or ``"python"`` accordingly.
"""

from zephon.shm.ring import (
    FRAME_NBYTES,
    IMPLEMENTATION,
    PAYLOAD_PHASE,
    PHASED_ARRAY_MIN_BYTES,
    Message,
    RingClosedError,
    ShmRing,
    SlotWriter,
    message_nbytes,
    plan_layout,
)
from zephon.shm.segment import (
    Segment,
    attach_segment,
    create_segment,
    sweep_stale_segments,
)

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
    "create_segment",
    "message_nbytes",
    "plan_layout",
    "sweep_stale_segments",
]
