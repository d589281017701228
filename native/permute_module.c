/* zephon._permute: the Feistel permutation of zephon/work_sources/permutation.py in C, and
 * the interleaving of a mixture's components (zephon/work_sources/interleave.py).
 *
 * permute_into(positions, out, n, half_bits, round_keys) writes to `out` (a writable,
 * contiguous uint64 buffer) the image of every element of `positions` (a contiguous
 * uint64 buffer of the same length, each < n) under the balanced Feistel network of
 * len(round_keys) rounds over 2*half_bits bits, cycle-walked back into range(n). It is
 * the very function the Python module computes (the tests compare them); only faster:
 * one pass per element instead of a few dozen numpy calls per cycle-walk step. The
 * GIL is released while it runs.
 *
 * mixture_rebuild(...) and mixture_picks(...) interleave one lane of a mixture by worst-case
 * fair weighted fair queueing (WF2Q+): each pick serves, among the components whose start
 * tag has been reached by the virtual time, the one with the lowest finish tag, over two
 * heaps; a component's next sample is the permutation above (its keys derived from the
 * seed as mix64 does) and its token count a read of its lengths buffer. The arrays belong
 * to the Python caller; see interleave.py for the same functions in Python and what every
 * argument means.
 *
 * mixture_counts(f64, i64, token_units) packs a lane's counts for its checkpoint state
 * (zephon/work_sources/lane_state.py's pack_counts and pack_carry are the same in Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MAX_ROUNDS 64

static inline uint64_t fmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static inline uint64_t feistel(uint64_t x, unsigned half_bits, const uint64_t *keys,
                               int rounds) {
    const uint64_t mask = (UINT64_C(1) << half_bits) - 1;
    uint64_t left = x >> half_bits, right = x & mask;
    for (int r = 0; r < rounds; r++) {
        uint64_t next = left ^ (fmix64(right ^ keys[r]) & mask);
        left = right;
        right = next;
    }
    return (left << half_bits) | right;
}

PyDoc_STRVAR(permute_into_doc,
             "permute_into(positions, out, n, half_bits, round_keys, /) -> None\n\n"
             "Images of the uint64 positions (each < n) under the cycle-walked Feistel\n"
             "permutation, written to out (a writable uint64 buffer of the same length).");

static PyObject *py_permute_into(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *src_obj, *dst_obj, *keys_obj;
    unsigned long long n;
    int half_bits;
    if (!PyArg_ParseTuple(args, "OOKiO:permute_into", &src_obj, &dst_obj, &n, &half_bits,
                          &keys_obj)) {
        return NULL;
    }
    if (half_bits < 1 || half_bits > 32) {
        PyErr_Format(PyExc_ValueError, "half_bits must be in [1, 32]; got %d", half_bits);
        return NULL;
    }
    if (half_bits < 32 && n > (UINT64_C(1) << (2 * half_bits))) {
        PyErr_Format(PyExc_ValueError, "n=%llu does not fit in 2*%d bits", n, half_bits);
        return NULL;
    }
    PyObject *keys_seq = PySequence_Fast(keys_obj, "round_keys must be a sequence of ints");
    if (keys_seq == NULL) {
        return NULL;
    }
    Py_ssize_t rounds = PySequence_Fast_GET_SIZE(keys_seq);
    if (rounds < 1 || rounds > MAX_ROUNDS) {
        Py_DECREF(keys_seq);
        PyErr_Format(PyExc_ValueError, "need 1 to %d round keys; got %zd", MAX_ROUNDS, rounds);
        return NULL;
    }
    uint64_t keys[MAX_ROUNDS];
    for (Py_ssize_t r = 0; r < rounds; r++) {
        keys[r] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(keys_seq, r));
        if (keys[r] == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(keys_seq);
            return NULL;
        }
    }
    Py_DECREF(keys_seq);

    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) !=
        0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.itemsize != 8 || dst.itemsize != 8 || src.len != dst.len) {
        PyErr_SetString(PyExc_ValueError,
                        "positions and out must be uint64 buffers of the same length");
        goto done;
    }
    const uint64_t *in = src.buf;
    uint64_t *out = dst.buf;
    Py_ssize_t count = src.len / 8;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (in[i] >= n) {
            PyErr_Format(PyExc_ValueError, "position %llu is not below n=%llu",
                         (unsigned long long)in[i], n);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t x = in[i];
        do {
            x = feistel(x, (unsigned)half_bits, keys, (int)rounds);
        } while (x >= n);
        out[i] = x;
    }
    Py_END_ALLOW_THREADS;
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* ---------------------------------------------------------------- mixture_picks */

#define GOLDEN UINT64_C(0x9E3779B97F4A7C15)
#define PICK_ROUNDS 6 /* permutation.NUM_ROUNDS */

#define FLAG_SHUFFLE 1
#define FLAG_TOKEN_UNITS 2
#define FLAG_STOP_ON_EXHAUST 4

#define CODE_SIZE_MASK 0x0F
#define CODE_SIGNED 0x10
#define CODE_OFFSETS 0x20

/* permutation.mix64(a, b, c): the argument count, then each argument, through fmix64. */
static inline uint64_t mix64_3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t h = fmix64(UINT64_C(3) * GOLDEN);
    h = fmix64((h + GOLDEN) ^ a);
    h = fmix64((h + GOLDEN) ^ b);
    return fmix64((h + GOLDEN) ^ c);
}

static inline unsigned half_bits_of(uint64_t n) {
    unsigned bits = 0;
    for (uint64_t m = n - 1; m; m >>= 1) {
        bits++;
    }
    if (bits < 2) {
        bits = 2;
    }
    return (bits + 1) / 2;
}

/* The dataset index of sample `within` of a dataset epoch of n samples under `key`. */
static inline uint64_t permuted(uint64_t within, uint64_t n, uint64_t key) {
    if (n == 1) {
        return 0;
    }
    unsigned hb = half_bits_of(n);
    uint64_t keys[PICK_ROUNDS];
    for (int r = 0; r < PICK_ROUNDS; r++) {
        keys[r] = mix64_3(key, (uint64_t)r, hb);
    }
    uint64_t x = within;
    do {
        x = feistel(x, hb, keys, PICK_ROUNDS);
    } while (x >= n);
    return x;
}

/* Heap order on one key row: the lower key first, ties to the lower component. */
static inline int before(const double *key, int32_t a, int32_t b) {
    return key[a] < key[b] || (key[a] == key[b] && a < b);
}

static void sift_down(int32_t *heap, Py_ssize_t len, Py_ssize_t i, const double *key) {
    int32_t item = heap[i];
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= len) {
            break;
        }
        if (child + 1 < len && before(key, heap[child + 1], heap[child])) {
            child++;
        }
        if (!before(key, heap[child], item)) {
            break;
        }
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = item;
}

static void heap_push(int32_t *heap, Py_ssize_t *len, int32_t item, const double *key) {
    Py_ssize_t i = (*len)++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!before(key, item, heap[parent])) {
            break;
        }
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = item;
}

static int32_t heap_pop(int32_t *heap, Py_ssize_t *len, const double *key) {
    int32_t top = heap[0];
    (*len)--;
    if (*len > 0) {
        heap[0] = heap[*len];
        sift_down(heap, *len, 0, key);
    }
    return top;
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t items,
                      int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        return -1;
    }
    if (view->itemsize != itemsize || view->len < items * itemsize) {
        PyErr_Format(PyExc_ValueError,
                     "mixture_picks: %s must hold %zd items of %zd bytes; got %zd bytes of "
                     "items of %zd",
                     what, items, itemsize, view->len, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ length tables
 *
 * A length table holds every component's lengths buffer for the life of the work source
 * that made it (and of the lanes that share it), so that a pick reads a count without
 * asking numpy for a buffer. It is a capsule over this struct.
 */

typedef struct {
    Py_ssize_t ncomp;
    Py_buffer *views;   /* [ncomp]; views[c].obj == NULL where there are no lengths */
    uint8_t *codes;     /* [ncomp] */
    Py_ssize_t *counts; /* [ncomp] samples covered */
    uint64_t *keys;     /* [ncomp] each component's permutation key (from its name) */
} LengthTable;

#define TABLE_NAME "zephon._permute.LengthTable"

static void table_free(PyObject *capsule) {
    LengthTable *t = PyCapsule_GetPointer(capsule, TABLE_NAME);
    if (t == NULL) {
        PyErr_Clear();
        return;
    }
    for (Py_ssize_t c = 0; c < t->ncomp; c++) {
        if (t->views[c].obj != NULL) {
            PyBuffer_Release(&t->views[c]);
        }
    }
    PyMem_Free(t->views);
    PyMem_Free(t->codes);
    PyMem_Free(t->counts);
    PyMem_Free(t->keys);
    PyMem_Free(t);
}

PyDoc_STRVAR(length_table_doc,
             "length_table(lengths, codes, keys, /) -> capsule\n\n"
             "Holds each component's lengths buffer (lengths[c], None for none) and its\n"
             "permutation key (uint64 keys[c]) for the mixture functions; codes[c] says how\n"
             "to read the lengths (see interleave.py).");

static PyObject *py_length_table(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lengths, *codes_obj, *keys_obj;
    if (!PyArg_ParseTuple(args, "O!OO:length_table", &PyTuple_Type, &lengths, &codes_obj,
                          &keys_obj)) {
        return NULL;
    }
    Py_ssize_t ncomp = PyTuple_GET_SIZE(lengths);
    Py_buffer cb, kb;
    if (get_buffer(keys_obj, &kb, 8, ncomp, 0, "keys") != 0) {
        return NULL;
    }
    if (get_buffer(codes_obj, &cb, 1, ncomp, 0, "codes") != 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    LengthTable *t = PyMem_Calloc(1, sizeof(*t));
    if (t == NULL) {
        PyBuffer_Release(&cb);
        PyBuffer_Release(&kb);
        return PyErr_NoMemory();
    }
    size_t slots = (size_t)(ncomp ? ncomp : 1);
    t->views = PyMem_Calloc(slots, sizeof(Py_buffer));
    t->codes = PyMem_Calloc(slots, 1);
    t->counts = PyMem_Calloc(slots, sizeof(Py_ssize_t));
    t->keys = PyMem_Calloc(slots, sizeof(uint64_t));
    PyObject *capsule = NULL;
    if (t->views == NULL || t->codes == NULL || t->counts == NULL || t->keys == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    t->ncomp = ncomp;
    memcpy(t->keys, kb.buf, (size_t)ncomp * sizeof(uint64_t));
    for (Py_ssize_t c = 0; c < ncomp; c++) {
        uint8_t code = ((const uint8_t *)cb.buf)[c];
        PyObject *item = PyTuple_GET_ITEM(lengths, c);
        if (code == 0) {
            continue;
        }
        Py_ssize_t size = (code & CODE_OFFSETS) ? 8 : (code & CODE_SIZE_MASK);
        if (size != 1 && size != 2 && size != 4 && size != 8) {
            PyErr_Format(PyExc_ValueError, "length_table: bad code %d for component %zd",
                         (int)code, c);
            goto fail;
        }
        if (get_buffer(item, &t->views[c], size, 0, 0, "a component's lengths") != 0) {
            t->views[c].obj = NULL;
            goto fail;
        }
        t->codes[c] = code;
        t->counts[c] = t->views[c].len / size - ((code & CODE_OFFSETS) ? 1 : 0);
    }
    PyBuffer_Release(&cb);
    PyBuffer_Release(&kb);
    capsule = PyCapsule_New(t, TABLE_NAME, table_free);
    if (capsule == NULL) {
        cb.obj = NULL;
        kb.obj = NULL;
        goto fail;
    }
    return capsule;
fail:
    if (cb.obj != NULL) {
        PyBuffer_Release(&cb);
    }
    if (kb.obj != NULL) {
        PyBuffer_Release(&kb);
    }
    for (Py_ssize_t c = 0; c < ncomp && t->views != NULL; c++) {
        if (t->views[c].obj != NULL) {
            PyBuffer_Release(&t->views[c]);
        }
    }
    PyMem_Free(t->views);
    PyMem_Free(t->codes);
    PyMem_Free(t->counts);
    PyMem_Free(t->keys);
    PyMem_Free(t);
    return NULL;
}

/* The token count of sample `index` of component c from its lengths (or offsets) buffer. */
static inline int64_t length_of(const char *buf, uint8_t code, uint64_t index) {
    unsigned size = code & CODE_SIZE_MASK;
    if (code & CODE_OFFSETS) {
        const int64_t *off = (const int64_t *)buf;
        return off[index + 1] - off[index];
    }
    const char *at = buf + (size_t)index * size;
    if (code & CODE_SIGNED) {
        switch (size) {
        case 1: return *(const int8_t *)at;
        case 2: return *(const int16_t *)at;
        case 4: return *(const int32_t *)at;
        default: return *(const int64_t *)at;
        }
    }
    switch (size) {
    case 1: return *(const uint8_t *)at;
    case 2: return *(const uint16_t *)at;
    case 4: return *(const uint32_t *)at;
    default: return (int64_t) * (const uint64_t *)at;
    }
}

/* The rows of the caller's arrays (interleave.py names them). */
typedef struct {
    Py_ssize_t ncomp;
    double *weights, *carry, *start, *finish;
    int64_t *recv, *positions, *tokens, *limits, *sizes, *next_index, *next_length;
    int32_t *eligible, *waiting;
    uint64_t lane, num_lanes, seed;
    long flags;
    const LengthTable *table;
} Lane;

static int lane_buffers(Lane *ln, PyObject *f64, PyObject *i64, PyObject *heaps,
                        Py_buffer views[3]) {
    Py_ssize_t n = ln->ncomp;
    if (get_buffer(f64, &views[0], 8, 4 * n, 1, "f64") != 0) {
        return 0;
    }
    if (get_buffer(i64, &views[1], 8, 7 * n, 1, "i64") != 0) {
        return 1;
    }
    if (get_buffer(heaps, &views[2], 4, 2 * n, 1, "heaps") != 0) {
        return 2;
    }
    double *f = views[0].buf;
    int64_t *i = views[1].buf;
    int32_t *h = views[2].buf;
    ln->weights = f, ln->carry = f + n, ln->start = f + 2 * n, ln->finish = f + 3 * n;
    ln->recv = i, ln->positions = i + n, ln->tokens = i + 2 * n, ln->limits = i + 3 * n;
    ln->sizes = i + 4 * n, ln->next_index = i + 5 * n, ln->next_length = i + 6 * n;
    ln->eligible = h, ln->waiting = h + n;
    return 3;
}

static inline int64_t units_of(const Lane *ln, int64_t length) {
    return (ln->flags & FLAG_TOKEN_UNITS) ? (length > 0 ? length : 1) : 1;
}

/* Component c's next sample (dataset index and token count) from its position. */
static int next_sample(Lane *ln, int32_t c) {
    uint64_t n = (uint64_t)ln->sizes[c];
    uint64_t p = (uint64_t)ln->positions[c];
    if (n == 0 || p > (UINT64_MAX - ln->lane) / ln->num_lanes) {
        PyErr_Format(PyExc_ValueError,
                     "mixture: component %d has %llu samples at position %llu", (int)c,
                     (unsigned long long)n, (unsigned long long)p);
        return -1;
    }
    uint64_t g = ln->lane + p * ln->num_lanes;
    uint64_t within = g % n;
    uint64_t index = (ln->flags & FLAG_SHUFFLE)
                         ? permuted(within, n, mix64_3(ln->seed, ln->table->keys[c], g / n))
                         : within;
    int64_t length = 1;
    uint8_t code = ln->table->codes[c];
    if (code) {
        if ((uint64_t)ln->table->counts[c] != n) {
            PyErr_Format(PyExc_ValueError,
                         "mixture: the lengths of component %d cover %zd samples; its "
                         "dataset has %llu",
                         (int)c, ln->table->counts[c], (unsigned long long)n);
            return -1;
        }
        length = length_of(ln->table->views[c].buf, code, index);
        if (length < 0) {
            PyErr_Format(PyExc_ValueError,
                         "mixture: sample %llu of component %d has length %lld",
                         (unsigned long long)index, (int)c, (long long)length);
            return -1;
        }
    }
    ln->next_index[c] = (int64_t)index;
    ln->next_length[c] = length;
    return 0;
}

/* Start and finish tags of c from what it received: S = (received - carry) / w, and
 * F = S + (units of its next sample) / w. */
static inline void tag(Lane *ln, int32_t c) {
    double w = ln->weights[c];
    ln->start[c] = ((double)ln->recv[c] - ln->carry[c]) / w;
    ln->finish[c] = ln->start[c] + (double)units_of(ln, ln->next_length[c]) / w;
}

static inline int drawable(const Lane *ln, Py_ssize_t c) {
    return ln->weights[c] > 0 &&
           (ln->limits[c] < 0 || ln->positions[c] < ln->limits[c]);
}

/* The drawable components' weights, summed in component order. */
static double weight_sum(const Lane *ln) {
    double total = 0.0;
    for (Py_ssize_t c = 0; c < ln->ncomp; c++) {
        if (drawable(ln, c)) {
            total += ln->weights[c];
        }
    }
    return total;
}

static int parse_lane(Lane *ln, PyObject *table, PyObject *lane, PyObject *num_lanes,
                      PyObject *seed, PyObject *flags) {
    ln->table = PyCapsule_GetPointer(table, TABLE_NAME);
    if (ln->table == NULL) {
        return -1;
    }
    ln->ncomp = ln->table->ncomp;
    ln->lane = PyLong_AsUnsignedLongLong(lane);
    ln->num_lanes = PyLong_AsUnsignedLongLong(num_lanes);
    ln->seed = PyLong_AsUnsignedLongLong(seed);
    ln->flags = PyLong_AsLong(flags);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (ln->num_lanes == 0 || ln->lane >= ln->num_lanes) {
        PyErr_Format(PyExc_ValueError, "mixture: lane %llu is not below num_lanes %llu",
                     (unsigned long long)ln->lane, (unsigned long long)ln->num_lanes);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(mixture_rebuild_doc,
             "mixture_rebuild(f64, i64, heaps, table, lane, num_lanes, seed, flags, vtime, /)\n"
             "    -> (eligible, waiting, weight_sum)\n\n"
             "Tags and heaps of every drawable component (next samples where next_length <\n"
             "0); see zephon.work_sources.interleave.");

static PyObject *py_mixture_rebuild(PyObject *Py_UNUSED(self), PyObject *const *args,
                                    Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "mixture_rebuild takes 9 arguments; got %zd", nargs);
        return NULL;
    }
    Lane ln;
    if (parse_lane(&ln, args[3], args[4], args[5], args[6], args[7]) != 0) {
        return NULL;
    }
    double vtime = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer views[3];
    int got = lane_buffers(&ln, args[0], args[1], args[2], views);
    PyObject *result = NULL;
    if (got == 3) {
        Py_ssize_t n_elig = 0, n_wait = 0;
        int ok = 1;
        for (Py_ssize_t c = 0; c < ln.ncomp; c++) {
            if (!drawable(&ln, c)) {
                continue;
            }
            if (ln.next_length[c] < 0 && next_sample(&ln, (int32_t)c) != 0) {
                ok = 0;
                break;
            }
            tag(&ln, (int32_t)c);
            if (ln.start[c] <= vtime) {
                heap_push(ln.eligible, &n_elig, (int32_t)c, ln.finish);
            } else {
                heap_push(ln.waiting, &n_wait, (int32_t)c, ln.start);
            }
        }
        if (ok) {
            result = Py_BuildValue("nnd", n_elig, n_wait, weight_sum(&ln));
        }
    }
    for (int i = 0; i < got; i++) {
        PyBuffer_Release(&views[i]);
    }
    return result;
}

PyDoc_STRVAR(mixture_picks_doc,
             "mixture_picks(f64, i64, heaps, table, out, k, eligible, waiting, vtime,\n"
             "              weight_sum, lane, num_lanes, seed, chunk_id, flags, /)\n"
             "    -> (picked, eligible, waiting, vtime, weight_sum, exhausted, chunk_seed)\n\n"
             "Up to k picks of one lane of a mixture; zephon.work_sources.interleave has the\n"
             "same function in Python and documents the arguments.");

static PyObject *py_mixture_picks(PyObject *Py_UNUSED(self), PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 15) {
        PyErr_Format(PyExc_TypeError, "mixture_picks takes 15 arguments; got %zd", nargs);
        return NULL;
    }
    Lane ln;
    if (parse_lane(&ln, args[3], args[10], args[11], args[12], args[14]) != 0) {
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[5]);
    Py_ssize_t n_elig = PyLong_AsSsize_t(args[6]);
    Py_ssize_t n_wait = PyLong_AsSsize_t(args[7]);
    double vtime = PyFloat_AsDouble(args[8]);
    double wsum = PyFloat_AsDouble(args[9]);
    uint64_t chunk_id = PyLong_AsUnsignedLongLong(args[13]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (k < 0 || n_elig < 0 || n_wait < 0 || n_elig + n_wait > ln.ncomp) {
        PyErr_Format(PyExc_ValueError,
                     "mixture_picks: need k >= 0 and eligible + waiting <= %zd components; "
                     "got k=%zd, eligible=%zd, waiting=%zd",
                     ln.ncomp, k, n_elig, n_wait);
        return NULL;
    }
    Py_buffer views[4];
    int got = lane_buffers(&ln, args[0], args[1], args[2], views);
    PyObject *result = NULL;
    if (got == 3) {
        if (get_buffer(args[4], &views[3], 8, 3 * k, 1, "out") == 0) {
            got = 4;
        }
    }
    if (got == 4) {
        int64_t *out_c = views[3].buf, *out_i = out_c + k, *out_l = out_i + k;
        Py_ssize_t picked = 0;
        long exhausted = -1;
        int ok = 1;
        while (picked < k && n_elig + n_wait > 0) {
            while (n_wait > 0 && ln.start[ln.waiting[0]] <= vtime) {
                int32_t c = heap_pop(ln.waiting, &n_wait, ln.start);
                heap_push(ln.eligible, &n_elig, c, ln.finish);
            }
            if (n_elig == 0) {
                vtime = ln.start[ln.waiting[0]]; /* nothing eligible: time jumps ahead */
                continue;
            }
            int32_t c = heap_pop(ln.eligible, &n_elig, ln.finish);
            int64_t length = ln.next_length[c];
            int64_t units = units_of(&ln, length);
            out_c[picked] = c;
            out_i[picked] = ln.next_index[c];
            out_l[picked] = length;
            picked++;
            ln.positions[c] += 1;
            ln.recv[c] += units;
            if (ln.table->codes[c]) {
                ln.tokens[c] += length;
            }
            vtime += (double)units / wsum;
            if (ln.limits[c] >= 0 && ln.positions[c] >= ln.limits[c]) {
                ln.next_length[c] = -1;
                wsum = weight_sum(&ln);
                if (ln.flags & FLAG_STOP_ON_EXHAUST) {
                    exhausted = c;
                    break;
                }
                continue;
            }
            if (next_sample(&ln, c) != 0) {
                ok = 0;
                break;
            }
            tag(&ln, c);
            heap_push(ln.waiting, &n_wait, c, ln.start);
        }
        if (ok) {
            uint64_t chunk_seed = mix64_3(ln.seed, ln.lane, chunk_id);
            result = Py_BuildValue("nnnddlK", picked, n_elig, n_wait, vtime, wsum, exhausted,
                                   (unsigned long long)chunk_seed);
        }
    }
    for (int i = 0; i < got; i++) {
        PyBuffer_Release(&views[i]);
    }
    return result;
}

PyDoc_STRVAR(record_words_doc,
             "record_words(key, cursors, /) -> list of (state_hi, state_lo, inc_hi, inc_lo)\n\n"
             "Per cursor (four ints, taken modulo 2**64): word w (0..3) is h after\n"
             "h = fmix64(key ^ (w + 1)), then h = fmix64((h + GOLDEN) ^ field) per field;\n"
             "the last word is made odd (a PCG64 increment). zephon.operators.random_map\n"
             "has the numpy twin.");

static PyObject *py_record_words(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long key;
    PyObject *cursors_obj;
    if (!PyArg_ParseTuple(args, "KO:record_words", &key, &cursors_obj)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(cursors_obj, "cursors must be a sequence of 4-tuples");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t start[4];
    for (int w = 0; w < 4; w++) {
        start[w] = fmix64((uint64_t)key ^ (uint64_t)(w + 1));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cur = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i),
                                        "a cursor must be a sequence of 4 ints");
        if (cur == NULL) {
            goto fail;
        }
        if (PySequence_Fast_GET_SIZE(cur) != 4) {
            Py_DECREF(cur);
            PyErr_SetString(PyExc_ValueError, "a cursor must have 4 fields");
            goto fail;
        }
        uint64_t f[4];
        for (int k = 0; k < 4; k++) {
            f[k] = (uint64_t)PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(cur, k));
        }
        Py_DECREF(cur);
        if (PyErr_Occurred()) {
            goto fail;
        }
        PyObject *t = PyTuple_New(4);
        if (t == NULL) {
            goto fail;
        }
        for (int w = 0; w < 4; w++) {
            uint64_t h = start[w];
            for (int k = 0; k < 4; k++) {
                h = fmix64((h + GOLDEN) ^ f[k]);
            }
            if (w == 3) {
                h |= 1;
            }
            PyObject *v = PyLong_FromUnsignedLongLong(h);
            if (v == NULL) {
                Py_DECREF(t);
                goto fail;
            }
            PyTuple_SET_ITEM(t, w, v);
        }
        PyList_SET_ITEM(out, i, t);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* ------------------------------------------------------------------ a lane's state */

/* values (n int64s) as lane_state.pack_ints packs them: b"\x00" when all are 0, else the
 * fewest bytes w (1, 2, 4 or 8) of a signed int holding each, then every value's byte 0,
 * every value's byte 1, ... (little-endian two's complement). */
static PyObject *pack_ints(const int64_t *values, Py_ssize_t n) {
    int64_t lo = 0, hi = 0;
    for (Py_ssize_t c = 0; c < n; c++) {
        lo = values[c] < lo ? values[c] : lo;
        hi = values[c] > hi ? values[c] : hi;
    }
    if (lo == 0 && hi == 0) {
        return PyBytes_FromStringAndSize("\0", 1);
    }
    int width = 8;
    for (int w = 1; w < 8; w *= 2) {
        int64_t bound = (int64_t)1 << (8 * w - 1);
        if (-bound <= lo && hi < bound) {
            width = w;
            break;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, 1 + width * n);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *to = (unsigned char *)PyBytes_AS_STRING(out);
    to[0] = (unsigned char)width;
    for (int b = 0; b < width; b++) {
        for (Py_ssize_t c = 0; c < n; c++) {
            to[1 + b * n + c] = (unsigned char)(((uint64_t)values[c] >> (8 * b)) & 0xFF);
        }
    }
    return out;
}

PyDoc_STRVAR(mixture_counts_doc,
             "mixture_counts(f64, i64, token_units, /) -> (positions, tokens, received, carry)\n\n"
             "A lane's counts as its checkpoint state holds them, from the interleave's arrays\n"
             "(interleave.py names their rows): pack_ints of the positions, of the tokens and of\n"
             "what was dealt since the weights last changed (the tokens, with token_units, else\n"
             "the positions, minus received), and the carried credits as float32 bytes (b''\n"
             "while they are all 0). lane_state.pack_counts and pack_carry are the same.");

static PyObject *py_mixture_counts(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *f64_obj, *i64_obj;
    int token_units;
    if (!PyArg_ParseTuple(args, "OOp:mixture_counts", &f64_obj, &i64_obj, &token_units)) {
        return NULL;
    }
    Py_buffer f64 = {0}, i64 = {0};
    PyObject *result = NULL, *packed[4] = {NULL, NULL, NULL, NULL};
    int64_t *since = NULL;
    if (PyObject_GetBuffer(i64_obj, &i64, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(f64_obj, &f64, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
        PyBuffer_Release(&i64);
        return NULL;
    }
    if (i64.ndim != 2 || f64.ndim != 2 || i64.itemsize != 8 || f64.itemsize != 8 ||
        i64.shape[0] < 3 || f64.shape[0] < 2 || i64.shape[1] != f64.shape[1]) {
        PyErr_SetString(PyExc_ValueError,
                        "mixture_counts takes the interleave's f64 and i64 arrays (2-D, a column "
                        "per component)");
        goto done;
    }
    Py_ssize_t n = i64.shape[1];
    const int64_t *rows = i64.buf, *recv = rows, *pos = rows + n, *tok = rows + 2 * n;
    const double *carry = (const double *)f64.buf + n;
    since = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (since == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t c = 0; c < n; c++) {
        since[c] = (token_units ? tok[c] : pos[c]) - recv[c];
    }
    int zero = 1;
    for (Py_ssize_t c = 0; c < n; c++) {
        zero &= carry[c] == 0.0;
    }
    if (zero) {
        packed[3] = PyBytes_FromStringAndSize(NULL, 0);
    } else if ((packed[3] = PyBytes_FromStringAndSize(NULL, 4 * n)) != NULL) {
        char *to = PyBytes_AS_STRING(packed[3]);
        for (Py_ssize_t c = 0; c < n; c++) {
            float f = (float)carry[c];
            uint32_t bits;
            memcpy(&bits, &f, 4);
            for (int b = 0; b < 4; b++) { /* little-endian, as astype("<f4") */
                to[4 * c + b] = (char)((bits >> (8 * b)) & 0xFF);
            }
        }
    }
    packed[0] = pack_ints(pos, n);
    packed[1] = pack_ints(tok, n);
    packed[2] = pack_ints(since, n);
    if (packed[0] && packed[1] && packed[2] && packed[3]) {
        result = PyTuple_Pack(4, packed[0], packed[1], packed[2], packed[3]);
    }
done:
    for (int j = 0; j < 4; j++) {
        Py_XDECREF(packed[j]);
    }
    PyMem_Free(since);
    PyBuffer_Release(&f64);
    PyBuffer_Release(&i64);
    return result;
}

static PyMethodDef methods[] = {
    {"permute_into", py_permute_into, METH_VARARGS, permute_into_doc},
    {"length_table", py_length_table, METH_VARARGS, length_table_doc},
    {"record_words", py_record_words, METH_VARARGS, record_words_doc},
    {"mixture_rebuild", (PyCFunction)(void (*)(void))py_mixture_rebuild, METH_FASTCALL,
     mixture_rebuild_doc},
    {"mixture_picks", (PyCFunction)(void (*)(void))py_mixture_picks, METH_FASTCALL,
     mixture_picks_doc},
    {"mixture_counts", py_mixture_counts, METH_VARARGS, mixture_counts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._permute",
    .m_doc = "The Feistel permutation of zephon.work_sources.permutation and the "
             "mixture interleaving of zephon.work_sources.interleave, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__permute(void) { return PyModule_Create(&module); }
