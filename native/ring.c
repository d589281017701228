/* Zephon SPSC shared-memory ring: see ring.h for the protocol and the layout. */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RING_CPU_RELAX() _mm_pause()
#else
#define RING_CPU_RELAX() atomic_signal_fence(memory_order_seq_cst)
#endif

/* Before sleeping, a waiter spins (with PAUSE) for a while: at least
 * RING_SPIN_ROUNDS rounds (about 3 us), and longer -- twice its recent typical
 * wait, never more than RING_SPIN_MAX_NS -- while its waits have been short.
 * A peer that publishes every few microseconds is then caught without a futex
 * sleep and wake-up (a syscall for the waker and an inter-processor wake-up
 * for the sleeper, tens of microseconds on a VM); a peer that takes longer,
 * such as a worker that needs most of a millisecond per batch, costs only the
 * short spin before the futex sleep. The typical wait is a per-side moving
 * average kept in that side's private header line. */
#define RING_SPIN_ROUNDS 256
#define RING_SPIN_MAX_NS 20000
#define RING_SPIN_CLOCK_EVERY 32

enum slot_state {
    SLOT_FREE = 0,
    SLOT_RESERVED = 1,  /* producer holds it */
    SLOT_COMMITTED = 2, /* written; published once head passes it */
    SLOT_ACQUIRED = 3,  /* consumer holds it */
    SLOT_RELEASED = 4   /* consumer is done; free once tail passes it */
};

typedef struct ring_slot_meta {
    uint64_t nbytes;
    uint32_t state;
    uint32_t pad;
} ring_slot_meta;

typedef struct ring_header {
    /* immutable after ring_init */
    uint64_t magic;
    uint32_t version;
    uint32_t nslots;
    uint64_t slot_bytes;
    uint64_t slots_offset;
    uint64_t total_bytes;
    _Atomic uint32_t closed;
    uint32_t pad0;
    /* producer line (128-byte spacing also defeats the adjacent-line prefetcher) */
    _Alignas(128) _Atomic uint64_t head;
    uint64_t reserved;
    int64_t producer_wait_ns; /* producer-private: moving average of its waits */
    /* consumer line */
    _Alignas(128) _Atomic uint64_t tail;
    uint64_t acquired;
    int64_t consumer_wait_ns; /* consumer-private: moving average of its waits */
    /* futex words: the consumer sleeps on data_seq, the producer on space_seq */
    _Alignas(128) _Atomic uint32_t data_seq;
    _Atomic uint32_t data_waiters;
    _Alignas(128) _Atomic uint32_t space_seq;
    _Atomic uint32_t space_waiters;
    _Alignas(128) ring_slot_meta slots[];
} ring_header;

/* The layout is shared with other processes and with zephon/shm/pyring.py. */
_Static_assert(sizeof(_Atomic uint64_t) == 8 && ATOMIC_LLONG_LOCK_FREE == 2,
               "64-bit atomics must be lock-free to live in shared memory");
_Static_assert(sizeof(_Atomic uint32_t) == 4 && ATOMIC_INT_LOCK_FREE == 2,
               "32-bit atomics must be lock-free to live in shared memory");
_Static_assert(offsetof(ring_header, magic) == 0, "layout");
_Static_assert(offsetof(ring_header, version) == 8, "layout");
_Static_assert(offsetof(ring_header, nslots) == 12, "layout");
_Static_assert(offsetof(ring_header, slot_bytes) == 16, "layout");
_Static_assert(offsetof(ring_header, slots_offset) == 24, "layout");
_Static_assert(offsetof(ring_header, total_bytes) == 32, "layout");
_Static_assert(offsetof(ring_header, closed) == 40, "layout");
_Static_assert(offsetof(ring_header, head) == 128, "layout");
_Static_assert(offsetof(ring_header, reserved) == 136, "layout");
_Static_assert(offsetof(ring_header, producer_wait_ns) == 144, "layout");
_Static_assert(offsetof(ring_header, tail) == 256, "layout");
_Static_assert(offsetof(ring_header, acquired) == 264, "layout");
_Static_assert(offsetof(ring_header, consumer_wait_ns) == 272, "layout");
_Static_assert(offsetof(ring_header, data_seq) == 384, "layout");
_Static_assert(offsetof(ring_header, data_waiters) == 388, "layout");
_Static_assert(offsetof(ring_header, space_seq) == 512, "layout");
_Static_assert(offsetof(ring_header, space_waiters) == 516, "layout");
_Static_assert(offsetof(ring_header, slots) == RING_HEADER_FIXED_BYTES, "layout");
_Static_assert(sizeof(ring_slot_meta) == RING_SLOT_META_BYTES, "layout");

static uint64_t round_up(uint64_t x, uint64_t align) { return (x + align - 1) / align * align; }

static uint64_t slots_offset_for(uint32_t nslots) {
    return round_up(RING_HEADER_FIXED_BYTES + (uint64_t)nslots * RING_SLOT_META_BYTES,
                    RING_SLOT_ALIGN);
}

uint64_t ring_required_size(uint32_t nslots, uint64_t slot_bytes) {
    if (nslots == 0 || slot_bytes == 0 || slot_bytes % RING_SLOT_ALIGN != 0) {
        return 0;
    }
    uint64_t offset = slots_offset_for(nslots);
    if (slot_bytes > (UINT64_MAX - offset) / nslots) {
        return 0;
    }
    return offset + (uint64_t)nslots * slot_bytes;
}

/* ---- futex --------------------------------------------------------------- */

static long futex_wait(_Atomic uint32_t *word, uint32_t expected, const struct timespec *rel) {
    /* Shared (not FUTEX_PRIVATE_FLAG): the waker is another process. */
    return syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, rel, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Publishes "something changed" on a futex word; wakes only if someone sleeps.
 * All seq_cst: a waiter increments `waiters`, then reads `seq`, then checks its
 * condition; the waker changes the condition, bumps `seq`, then reads
 * `waiters`. Either the waker sees the waiter (and wakes it), or the waiter's
 * FUTEX_WAIT sees the bumped `seq` (and returns at once). */
static void signal_word(_Atomic uint32_t *seq, _Atomic uint32_t *waiters) {
    atomic_fetch_add(seq, 1);
    if (atomic_load(waiters) != 0) {
        futex_wake_all(seq);
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        return -1;
    }
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- waits --------------------------------------------------------------- */

typedef enum wait_side { WAIT_SPACE, WAIT_DATA } wait_side;

enum { PENDING = -1 };

/* The producer's reserve fails as soon as the ring is closed; the consumer's
 * acquire drains what was committed first. */
static int check(ring_header *h, wait_side side) {
    if (side == WAIT_SPACE) {
        if (atomic_load(&h->closed)) {
            return RING_CLOSED;
        }
        uint64_t tail = atomic_load_explicit(&h->tail, memory_order_acquire);
        return h->reserved - tail < h->nslots ? RING_OK : PENDING;
    }
    uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
    if (h->acquired < head) {
        return RING_OK;
    }
    return atomic_load(&h->closed) ? RING_CLOSED : PENDING;
}

/* Folds one wait into the side's moving average (weight 1/8). */
static void note_wait(int64_t *average, int64_t started, int64_t waited_until) {
    if (started < 0 || waited_until < 0) {
        return;
    }
    int64_t waited = waited_until - started;
    *average += (waited - *average) / 8;
}

static ring_status wait_for(ring_header *h, wait_side side, int64_t timeout_ns) {
    int st = check(h, side);
    if (st != PENDING || timeout_ns == 0) {
        return st == PENDING ? RING_TIMEOUT : (ring_status)st;
    }
    int64_t *average = side == WAIT_DATA ? &h->consumer_wait_ns : &h->producer_wait_ns;
    int64_t started = now_ns();
    int64_t spin_ns = *average * 2;
    if (spin_ns > RING_SPIN_MAX_NS || (timeout_ns > 0 && spin_ns > timeout_ns)) {
        spin_ns = 0; /* recent waits were long: only the short spin */
    }
    for (int i = 1;; i++) {
        RING_CPU_RELAX();
        st = check(h, side);
        if (st != PENDING) {
            note_wait(average, started, now_ns());
            return (ring_status)st;
        }
        if (i >= RING_SPIN_ROUNDS && i % RING_SPIN_CLOCK_EVERY == 0) {
            int64_t now = now_ns();
            if (now < 0 || started < 0 || now - started >= spin_ns) {
                break;
            }
        }
    }
    _Atomic uint32_t *seq = side == WAIT_DATA ? &h->data_seq : &h->space_seq;
    _Atomic uint32_t *waiters = side == WAIT_DATA ? &h->data_waiters : &h->space_waiters;
    int64_t deadline = 0;
    if (timeout_ns > 0) {
        int64_t now = now_ns();
        if (now < 0) {
            return RING_SYSTEM;
        }
        deadline = timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
    }
    for (;;) {
        atomic_fetch_add(waiters, 1);
        uint32_t observed = atomic_load(seq);
        st = check(h, side);
        if (st != PENDING) {
            atomic_fetch_sub(waiters, 1);
            note_wait(average, started, now_ns());
            return (ring_status)st;
        }
        struct timespec rel;
        const struct timespec *relp = NULL;
        if (timeout_ns > 0) {
            int64_t now = now_ns();
            if (now < 0) {
                atomic_fetch_sub(waiters, 1);
                return RING_SYSTEM;
            }
            int64_t left = deadline - now;
            if (left <= 0) {
                atomic_fetch_sub(waiters, 1);
                return RING_TIMEOUT;
            }
            rel.tv_sec = left / 1000000000;
            rel.tv_nsec = left % 1000000000;
            relp = &rel;
        }
        long rc = futex_wait(seq, observed, relp);
        int err = errno;
        atomic_fetch_sub(waiters, 1);
        if (rc != 0 && err != EAGAIN && err != EINTR && err != ETIMEDOUT) {
            errno = err;
            return RING_SYSTEM;
        }
        /* Woken, value changed, interrupted or timed out: re-check (the next
         * round returns TIMEOUT when the deadline has passed). */
    }
}

/* ---- lifecycle ----------------------------------------------------------- */

ring_status ring_init(void *base, size_t size, uint32_t nslots, uint64_t slot_bytes) {
    if ((uintptr_t)base % RING_SLOT_ALIGN != 0) {
        return RING_BAD_ALIGN;
    }
    uint64_t total = ring_required_size(nslots, slot_bytes);
    if (total == 0 || total > size) {
        return RING_BAD_SIZE;
    }
    ring_header *h = base;
    uint64_t offset = slots_offset_for(nslots);
    memset(base, 0, (size_t)offset);
    h->version = RING_LAYOUT_VERSION;
    h->nslots = nslots;
    h->slot_bytes = slot_bytes;
    h->slots_offset = offset;
    h->total_bytes = total;
    /* The magic goes last: a header with a valid magic is a complete header. */
    atomic_thread_fence(memory_order_release);
    h->magic = RING_MAGIC;
    atomic_thread_fence(memory_order_seq_cst);
    return RING_OK;
}

ring_status ring_attach(const void *base, size_t size, ring_info *info) {
    if ((uintptr_t)base % RING_SLOT_ALIGN != 0) {
        return RING_BAD_ALIGN;
    }
    if (size < RING_HEADER_FIXED_BYTES) {
        return RING_BAD_SIZE;
    }
    const ring_header *h = base;
    if (h->magic != RING_MAGIC) {
        return RING_BAD_MAGIC;
    }
    atomic_thread_fence(memory_order_acquire);
    if (h->version != RING_LAYOUT_VERSION) {
        return RING_BAD_VERSION;
    }
    uint64_t total = ring_required_size(h->nslots, h->slot_bytes);
    if (total == 0 || h->slots_offset != slots_offset_for(h->nslots) ||
        h->total_bytes != total || total > size) {
        return RING_BAD_SIZE;
    }
    if (info != NULL) {
        info->nslots = h->nslots;
        info->slot_bytes = h->slot_bytes;
        info->slots_offset = h->slots_offset;
        info->total_bytes = h->total_bytes;
    }
    return RING_OK;
}

ring_status ring_close(void *base) {
    ring_header *h = base;
    atomic_store(&h->closed, 1u);
    /* Unconditional wakes: a waiter registered after we read its count would
     * still see the bumped sequence word, but waking costs nothing here. */
    atomic_fetch_add(&h->data_seq, 1);
    atomic_fetch_add(&h->space_seq, 1);
    futex_wake_all(&h->data_seq);
    futex_wake_all(&h->space_seq);
    return RING_OK;
}

int ring_is_closed(const void *base) {
    const ring_header *h = base;
    return atomic_load(&((ring_header *)h)->closed) != 0;
}

uint64_t ring_slot_offset(const void *base, uint32_t slot_index) {
    const ring_header *h = base;
    return h->slots_offset + (uint64_t)slot_index * h->slot_bytes;
}

/* ---- producer ------------------------------------------------------------ */

ring_status ring_reserve(void *base, int64_t timeout_ns, uint32_t *slot_index) {
    ring_header *h = base;
    ring_status st = wait_for(h, WAIT_SPACE, timeout_ns);
    if (st != RING_OK) {
        return st;
    }
    uint32_t i = (uint32_t)(h->reserved % h->nslots);
    h->slots[i].state = SLOT_RESERVED;
    h->slots[i].nbytes = 0;
    h->reserved += 1;
    *slot_index = i;
    return RING_OK;
}

ring_status ring_commit(void *base, uint32_t slot_index, uint64_t nbytes) {
    ring_header *h = base;
    if (slot_index >= h->nslots || h->slots[slot_index].state != SLOT_RESERVED) {
        return RING_BAD_SLOT;
    }
    if (nbytes > h->slot_bytes) {
        return RING_BAD_SIZE;
    }
    h->slots[slot_index].nbytes = nbytes;
    h->slots[slot_index].state = SLOT_COMMITTED;
    /* Publish the longest committed run from head: slots in [head, reserved)
     * belong to the producer, so reading their state is race-free. */
    uint64_t head = atomic_load_explicit(&h->head, memory_order_relaxed);
    uint64_t start = head;
    while (head < h->reserved && h->slots[head % h->nslots].state == SLOT_COMMITTED) {
        head++;
    }
    if (head != start) {
        atomic_store(&h->head, head); /* seq_cst: also orders the payload writes */
        signal_word(&h->data_seq, &h->data_waiters);
    }
    return RING_OK;
}

/* ---- consumer ------------------------------------------------------------ */

ring_status ring_acquire(void *base, int64_t timeout_ns, uint32_t *slot_index, uint64_t *nbytes) {
    ring_header *h = base;
    ring_status st = wait_for(h, WAIT_DATA, timeout_ns);
    if (st != RING_OK) {
        return st;
    }
    uint32_t i = (uint32_t)(h->acquired % h->nslots);
    if (h->slots[i].state != SLOT_COMMITTED) {
        return RING_BAD_SLOT; /* the shared header was corrupted */
    }
    h->slots[i].state = SLOT_ACQUIRED;
    h->acquired += 1;
    *slot_index = i;
    *nbytes = h->slots[i].nbytes;
    return RING_OK;
}

ring_status ring_release(void *base, uint32_t slot_index) {
    ring_header *h = base;
    if (slot_index >= h->nslots || h->slots[slot_index].state != SLOT_ACQUIRED) {
        return RING_BAD_SLOT;
    }
    h->slots[slot_index].state = SLOT_RELEASED;
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    uint64_t start = tail;
    while (tail < h->acquired && h->slots[tail % h->nslots].state == SLOT_RELEASED) {
        h->slots[tail % h->nslots].state = SLOT_FREE;
        tail++;
    }
    if (tail != start) {
        atomic_store(&h->tail, tail); /* seq_cst: the producer may now reuse the slots */
        signal_word(&h->space_seq, &h->space_waiters);
    }
    return RING_OK;
}
