/* zephon._pack: where pack's pieces go, in C (zephon/operators/placement.py is the same
 * function in Python; the tests compare them).
 *
 * place_into(strategy, fill, segments, lengths, cap, max_segments, target, evict, full,
 *            instance, emitted, opened) -> number of bins emitted
 * places pieces of `lengths` (int64), in order, into bins whose token counts are `fill`
 * and piece counts `segments` (int64 buffers, one per bin, updated in place):
 *   strategy 0 (first fit): the lowest bin with room for the piece;
 *   strategy 1 (best fit): the bin with the least room that still fits it, lowest on ties.
 * When no bin has room, the fullest bin (lowest on ties) is emptied first: evict[k] is that
 * bin (int32, -1 when none was). The piece goes to target[k] (int32); when that bin is then
 * full (cap tokens, or max_segments pieces when max_segments > 0) it is emptied too and
 * full[k] is 1 (uint8). An emptied bin starts again at 0 tokens and 0 pieces. Every length
 * must be in [0, cap]. The GIL is released while it runs.
 *
 * What a bin holds from one emptying to the next is an instance, numbered s * num_bins + b
 * for the s-th filling of bin b in this call (s = 0: what it held when the call began).
 * instance[k] (int64) is piece k's; emitted (int64, room for 2 per piece) lists the
 * instances emptied, in order; opened[b] (int64) is bin b's s at the end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

enum { FIRST_FIT = 0, BEST_FIT = 1 };

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get(Buf *b, PyObject *obj, Py_ssize_t itemsize, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) != 0) {
        return -1;
    }
    b->held = 1;
    if (b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s must be a buffer of %zd-byte items; got %zd-byte",
                     what, itemsize, b->view.itemsize);
        return -1;
    }
    return 0;
}

static void release(Buf *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

static Py_ssize_t place(int strategy, int64_t *fill, int64_t *segments, Py_ssize_t num_bins,
                        const int64_t *lengths, Py_ssize_t count, int64_t cap,
                        int64_t max_segments, int32_t *target, int32_t *evict, uint8_t *full,
                        int64_t *instance, int64_t *emitted, int64_t *opened) {
    Py_ssize_t n_emitted = 0;
    for (Py_ssize_t b = 0; b < num_bins; b++) {
        opened[b] = 0;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t n = lengths[k], room = cap - n;
        Py_ssize_t b = -1;
        if (strategy == FIRST_FIT) {
            for (Py_ssize_t i = 0; i < num_bins; i++) {
                if (fill[i] <= room) {
                    b = i;
                    break;
                }
            }
        } else {
            for (Py_ssize_t i = 0; i < num_bins; i++) {
                if (fill[i] <= room && (b < 0 || fill[i] > fill[b])) {
                    b = i;
                }
            }
        }
        evict[k] = -1;
        if (b < 0) { /* nothing fits: the fullest bin goes, lowest index on ties */
            b = 0;
            for (Py_ssize_t i = 1; i < num_bins; i++) {
                if (fill[i] > fill[b]) {
                    b = i;
                }
            }
            evict[k] = (int32_t)b;
            emitted[n_emitted++] = opened[b] * num_bins + b;
            opened[b] += 1;
            fill[b] = 0;
            segments[b] = 0;
        }
        target[k] = (int32_t)b;
        instance[k] = opened[b] * num_bins + b;
        fill[b] += n;
        segments[b] += 1;
        full[k] = fill[b] == cap || (max_segments > 0 && segments[b] >= max_segments);
        if (full[k]) {
            emitted[n_emitted++] = opened[b] * num_bins + b;
            opened[b] += 1;
            fill[b] = 0;
            segments[b] = 0;
        }
    }
    return n_emitted;
}

PyDoc_STRVAR(place_into_doc,
             "place_into(strategy, fill, segments, lengths, cap, max_segments, target, evict,\n"
             "           full, instance, emitted, opened, /) -> int\n\n"
             "Places pieces of the given lengths into bins (see the module docstring).");

static PyObject *py_place_into(PyObject *Py_UNUSED(self), PyObject *args) {
    int strategy;
    long long cap, max_segments;
    PyObject *fill_obj, *seg_obj, *len_obj, *target_obj, *evict_obj, *full_obj, *inst_obj,
        *emit_obj, *open_obj;
    if (!PyArg_ParseTuple(args, "iOOOLLOOOOOO:place_into", &strategy, &fill_obj, &seg_obj,
                          &len_obj, &cap, &max_segments, &target_obj, &evict_obj, &full_obj,
                          &inst_obj, &emit_obj, &open_obj)) {
        return NULL;
    }
    if (strategy != FIRST_FIT && strategy != BEST_FIT) {
        PyErr_Format(PyExc_ValueError, "strategy must be 0 (first fit) or 1 (best fit); got %d",
                     strategy);
        return NULL;
    }
    if (cap < 1 || max_segments < 0) {
        PyErr_Format(PyExc_ValueError, "need cap >= 1 and max_segments >= 0; got %lld and %lld",
                     cap, max_segments);
        return NULL;
    }
    Buf fill = {0}, seg = {0}, lens = {0}, target = {0}, evict = {0}, full = {0}, inst = {0},
        emit = {0}, open = {0};
    PyObject *result = NULL;
    if (get(&fill, fill_obj, 8, 1, "fill") < 0 || get(&seg, seg_obj, 8, 1, "segments") < 0 ||
        get(&lens, len_obj, 8, 0, "lengths") < 0 || get(&target, target_obj, 4, 1, "target") < 0 ||
        get(&evict, evict_obj, 4, 1, "evict") < 0 || get(&full, full_obj, 1, 1, "full") < 0 ||
        get(&inst, inst_obj, 8, 1, "instance") < 0 || get(&emit, emit_obj, 8, 1, "emitted") < 0 ||
        get(&open, open_obj, 8, 1, "opened") < 0) {
        goto done;
    }
    Py_ssize_t num_bins = fill.view.len / 8, count = lens.view.len / 8;
    if (num_bins < 1 || seg.view.len != fill.view.len) {
        PyErr_SetString(PyExc_ValueError, "fill and segments must be one item per bin (>= 1)");
        goto done;
    }
    if (target.view.len != 4 * count || evict.view.len != 4 * count || full.view.len != count ||
        inst.view.len != 8 * count) {
        PyErr_SetString(PyExc_ValueError,
                        "target, evict, full and instance must be one item per piece");
        goto done;
    }
    if (emit.view.len < 16 * count || open.view.len != fill.view.len) {
        PyErr_SetString(PyExc_ValueError,
                        "emitted must hold 2 items per piece and opened one per bin");
        goto done;
    }
    const int64_t *lengths = lens.view.buf;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (lengths[k] < 0 || lengths[k] > cap) {
            PyErr_Format(PyExc_ValueError, "piece %zd has length %lld, outside [0, cap=%lld]", k,
                         (long long)lengths[k], cap);
            goto done;
        }
    }
    Py_ssize_t n_emitted;
    Py_BEGIN_ALLOW_THREADS;
    n_emitted = place(strategy, fill.view.buf, seg.view.buf, num_bins, lengths, count, cap,
                      max_segments, target.view.buf, evict.view.buf, full.view.buf,
                      inst.view.buf, emit.view.buf, open.view.buf);
    Py_END_ALLOW_THREADS;
    result = PyLong_FromSsize_t(n_emitted);
done:
    release(&fill);
    release(&seg);
    release(&lens);
    release(&target);
    release(&evict);
    release(&full);
    release(&inst);
    release(&emit);
    release(&open);
    return result;
}

static PyMethodDef methods[] = {
    {"place_into", py_place_into, METH_VARARGS, place_into_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._pack",
    .m_doc = "Where pack's pieces go (zephon.operators.placement), in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
