/*
 * Zephon's single-producer / single-consumer shared-memory ring.
 *
 * A thin C ABI over memory the caller owns: Python creates, sizes and maps the
 * segment; these functions never call mmap, shm_open or malloc. Every function
 * takes the segment's base address and returns a ring_status; the Python layer
 * maps statuses to exceptions in one place (zephon/shm/ring.py).
 *
 * Concurrency model
 *   - exactly one producer and one consumer, usually in two processes;
 *   - no mutex anywhere: a process that dies mid-call must never leave a lock
 *     held. The producer owns `head` (messages published) and `reserved`; the
 *     consumer owns `tail` (slots handed back) and `acquired`. Ownership of a
 *     slot moves between the sides through release/acquire stores of
 *     head/tail, so the slot table and the payload need no atomics;
 *   - blocking waits sleep on a futex (shared, not FUTEX_PRIVATE, because the
 *     peer is another process) keyed on a 32-bit sequence word per direction,
 *     after a short bounded spin. The waker only issues FUTEX_WAKE when the
 *     waiter count says someone sleeps; ring_close always wakes both words.
 *
 * Slots may be committed and released out of order (a zero-copy consumer may
 * drop messages in any order): a per-slot state records it, and head/tail
 * only advance over a contiguous run of committed/released slots, so the ring
 * stays FIFO.
 *
 * Close semantics: ring_close sets a one-way flag visible to both sides and
 * wakes every waiter. After it, ring_reserve fails with RING_CLOSED at once;
 * ring_acquire still hands out every message committed before (the producer
 * closes at end of stream and the consumer drains) and returns RING_CLOSED
 * only when the ring is empty. ring_commit and ring_release keep working so
 * that a side can finish what it holds.
 *
 * Shared header layout (little-endian x86-64; byte offsets are part of the
 * layout version and are mirrored by the pure-Python core in
 * zephon/shm/pyring.py, which the tests check byte for byte):
 *
 *     0  u64 magic            "ZEPHRING"
 *     8  u32 version          RING_LAYOUT_VERSION
 *    12  u32 nslots
 *    16  u64 slot_bytes       multiple of RING_SLOT_ALIGN
 *    24  u64 slots_offset     offset of slot 0 from base, multiple of 4096
 *    32  u64 total_bytes      slots_offset + nslots * slot_bytes
 *    40  u32 closed           0/1
 *   128  u64 head             producer line: messages published
 *   136  u64 reserved         producer-private reservation count
 *   144  i64 producer_wait_ns producer-private average wait (spin tuning only)
 *   256  u64 tail             consumer line: slots handed back
 *   264  u64 acquired         consumer-private acquisition count
 *   272  i64 consumer_wait_ns consumer-private average wait (spin tuning only)
 *   384  u32 data_seq, u32 data_waiters     "a message was published"
 *   512  u32 space_seq, u32 space_waiters   "a slot was handed back"
 *   640  slot table: nslots x { u64 nbytes, u32 state, u32 pad }
 *
 * Payload placement and 4 KiB aliasing (why RING_PAYLOAD_PHASE exists): a
 * copy whose destination lies a few dozen bytes past its source modulo 4096
 * makes the CPU mistake later loads for dependents of earlier stores and can
 * run several times slower. Slots are page aligned, and a large fresh numpy
 * array (glibc mmap chunk) starts 16 bytes into a page, so payload placed at
 * slot offset 0 is the worst case for the consumer's copy-out. The Python
 * layout helper therefore puts every large array at an offset congruent to
 * RING_PAYLOAD_PHASE (2048) modulo 4096: half a page away from both 0 and
 * 16, so no common destination alignment lands in the aliasing window, and
 * the bytes in front of the first array hold the message header and (when it
 * fits) the metadata. tests/unit/shm/bench_aliasing.py measures copy speed
 * against placement (the figures are on the docs' Performance page, under
 * "Transport"): memcpy-based copies may show no penalty on a given CPU while a
 * SIMD loop does. The phase is insurance for CPUs and copy loops that do pay
 * the penalty, at a cost of at most 4 KiB per large array.
 */
#ifndef ZEPHON_RING_H
#define ZEPHON_RING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RING_MAGIC UINT64_C(0x474E49524850455A) /* "ZEPHRING" little-endian */
#define RING_LAYOUT_VERSION 1u
#define RING_SLOT_ALIGN 4096u
#define RING_PAYLOAD_PHASE 2048u
#define RING_HEADER_FIXED_BYTES 640u
#define RING_SLOT_META_BYTES 16u

typedef enum ring_status {
    RING_OK = 0,
    RING_TIMEOUT = 1,     /* nothing to reserve/acquire within the timeout */
    RING_CLOSED = 2,      /* a side called ring_close (acquire: and the ring is empty) */
    RING_BAD_MAGIC = 3,   /* the segment is not a ring */
    RING_BAD_VERSION = 4, /* a ring of another layout version */
    RING_BAD_SIZE = 5,    /* buffer too small, bad nslots/slot_bytes, nbytes > slot_bytes */
    RING_BAD_SLOT = 6,    /* slot index not held by the caller in the right state */
    RING_BAD_ALIGN = 7,   /* base address not 4096-aligned */
    RING_SYSTEM = 8       /* unexpected futex/clock error (errno is left set) */
} ring_status;

typedef struct ring_info {
    uint32_t nslots;
    uint64_t slot_bytes;
    uint64_t slots_offset;
    uint64_t total_bytes;
} ring_info;

/* Bytes a ring of this geometry needs, or 0 when the geometry is invalid
 * (nslots == 0, slot_bytes == 0 or not a multiple of RING_SLOT_ALIGN, overflow). */
uint64_t ring_required_size(uint32_t nslots, uint64_t slot_bytes);

/* Formats a ring over [base, base + size). The other side must not be attached yet. */
ring_status ring_init(void *base, size_t size, uint32_t nslots, uint64_t slot_bytes);

/* Validates the header of an existing ring; fills *info when info != NULL. */
ring_status ring_attach(const void *base, size_t size, ring_info *info);

/* Producer. timeout_ns < 0 waits forever, 0 polls once. */
ring_status ring_reserve(void *base, int64_t timeout_ns, uint32_t *slot_index);
ring_status ring_commit(void *base, uint32_t slot_index, uint64_t nbytes);

/* Consumer. timeout_ns < 0 waits forever, 0 polls once. */
ring_status ring_acquire(void *base, int64_t timeout_ns, uint32_t *slot_index, uint64_t *nbytes);
ring_status ring_release(void *base, uint32_t slot_index);

/* Either side: marks the ring closed and wakes every waiter. Idempotent. */
ring_status ring_close(void *base);
int ring_is_closed(const void *base);

/* Offset of a slot's first byte from base (valid after ring_attach). */
uint64_t ring_slot_offset(const void *base, uint32_t slot_index);

#ifdef __cplusplus
}
#endif

#endif /* ZEPHON_RING_H */
