"""Type stub of the native ring core (native/ring_module.c).

Every function takes the ring memory as a writable, contiguous buffer and
returns ring statuses as ints; zephon/shm/ring.py maps them to exceptions.
zephon/shm/pyring.py implements the same functions in pure Python.
"""

from typing_extensions import Buffer

OK: int
TIMEOUT: int
CLOSED: int
BAD_MAGIC: int
BAD_VERSION: int
BAD_SIZE: int
BAD_SLOT: int
BAD_ALIGN: int
SYSTEM: int
MAGIC: int
LAYOUT_VERSION: int
SLOT_ALIGN: int
PAYLOAD_PHASE: int
HEADER_FIXED_BYTES: int
SLOT_META_BYTES: int

def required_size(nslots: int, slot_bytes: int, /) -> int: ...
def init(buf: Buffer, nslots: int, slot_bytes: int, /) -> int: ...
def attach(buf: Buffer, /) -> tuple[int, int, int, int]: ...
def reserve(buf: Buffer, timeout_ns: int, /) -> tuple[int, int]: ...
def commit(buf: Buffer, slot: int, nbytes: int, /) -> int: ...
def acquire(buf: Buffer, timeout_ns: int, /) -> tuple[int, int, int]: ...
def release(buf: Buffer, slot: int, /) -> int: ...
def close(buf: Buffer, /) -> int: ...
def is_closed(buf: Buffer, /) -> bool: ...
