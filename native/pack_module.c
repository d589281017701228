/* zephon._pack: where pack's pieces go, in C (zephon/operators/pack/placement.py is the same
 * function in Python; the tests compare them).
 *
 * place_into(strategy, fill, segments, lengths, cap, max_segments, target, evict, full,
 *            instance, head, emitted, opened) -> number of bins emitted
 * places pieces of `lengths` (int64), in order, into bins whose token counts are `fill`
 * and piece counts `segments` (int64 buffers, one per bin, updated in place):
 *   strategy 0 (first fit): the lowest bin with room for the piece;
 *   strategy 1 (best fit): the bin with the least room that still fits it, lowest on ties.
 * When no bin has room, the fullest bin (lowest on ties) is emptied first: evict[k] is that
 * bin (int32, -1 when none was). The piece goes to target[k] (int32); when that bin is then
 * full (cap tokens, or max_segments pieces when max_segments > 0) it is emptied too and
 * full[k] is 1 (uint8). An emptied bin starts again at 0 tokens and 0 pieces. Every length
 * must be in [0, cap]. head[k] (int64) is the piece's length.
 *   strategy 2 (concat then split): one bin (num_bins must be 1); a piece that does not fit
 * is cut: its first head[k] tokens (the bin's room) fill the bin, which is emptied, then
 * every further cap tokens fill a bin of their own (emptied), and what is left (if any)
 * starts the next filling as its first piece. Lengths may exceed cap; full[k] is 1 when the
 * bin is empty after the piece. evict[k] is -1 and target[k] 0.
 * The GIL is released while it runs.
 *
 * assemble_rows(rows, column, out, pad, seg, pos, span): packed rows (RowAssembler.assemble),
 * row i of a 2-D out from the pieces rows[i]: each piece's arrays' item column copied in
 * order (arrays that are a token span of type span: its tokens widened to int32), pad after
 * them, each token's piece number and position.
 *
 * row_formats(rows, columns, ndarray, lazy): the buffer format of each of the first columns
 * items of the arrays of every piece of rows, where for each column they are all 1-D
 * contiguous arrays (exactly ndarray) of one format (arrays that are not a tuple count as
 * lazy's format for column 0 and for no other); else None. What batch asks before it
 * allocates the rows.
 *
 * parts(rows): the contributors of the pieces of rows one after another and their
 * per-component token counts summed (zephon/operators/pack/assembly.py's parts is the same in
 * Python): a packed row's, or a batch's of packed rows.
 *
 * split_pieces(piece, contributor, ndarray, span, datas, contribs, mixes, key, max_len): the
 * fused split -> pack stage's pieces of pre-tokenized samples or token spans (span.h)
 * (zephon/operators/pack/fused.py's _Pieces is the same in Python), or None where a sample is
 * off that common path.
 *
 * bin_rows(pieces, instance, emitted, opened, held) -> (rows, new): pack's bookkeeping
 * around place_into (bin_rows in zephon/operators/pack/pack.py is the same in Python): the
 * pieces of each emptied instance, and each bin's pieces at the end (held, updated).
 *
 * What a bin holds from one emptying to the next is an instance, numbered s * num_bins + b
 * for the s-th filling of bin b in this call (s = 0: what it held when the call began).
 * instance[k] (int64) is the one piece k goes to (its first tokens, when it is cut; the
 * rest go to the instances after it, in order); emitted (int64, room for 2 per piece, plus
 * sum(lengths) / cap for strategy 2) lists the instances emptied, in order; opened[b]
 * (int64) is bin b's s at the end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "span.h"

enum { FIRST_FIT = 0, BEST_FIT = 1, CONCAT_THEN_SPLIT = 2 };

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
                        int64_t *instance, int64_t *head, int64_t *emitted, int64_t *opened) {
    Py_ssize_t n_emitted = 0;
    for (Py_ssize_t b = 0; b < num_bins; b++) {
        opened[b] = 0;
    }
    if (strategy == CONCAT_THEN_SPLIT) { /* one bin: fill[0] < cap between pieces */
        for (Py_ssize_t k = 0; k < count; k++) {
            int64_t n = lengths[k], room = cap - fill[0];
            target[k] = 0;
            evict[k] = -1;
            instance[k] = opened[0];
            if (n <= room) {
                head[k] = n;
                fill[0] += n;
                segments[0] += 1;
                full[k] = fill[0] == cap || (max_segments > 0 && segments[0] >= max_segments);
            } else {
                int64_t rest = n - room;
                head[k] = room;
                emitted[n_emitted++] = opened[0]++;
                for (; rest >= cap; rest -= cap) {
                    emitted[n_emitted++] = opened[0]++;
                }
                fill[0] = rest;
                segments[0] = rest > 0;
                full[k] = rest == 0 || max_segments == 1;
                if (rest == 0) {
                    continue;
                }
            }
            if (full[k]) {
                emitted[n_emitted++] = opened[0]++;
                fill[0] = 0;
                segments[0] = 0;
            }
        }
        return n_emitted;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t n = lengths[k], room = cap - n;
        head[k] = n;
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
             "           full, instance, head, emitted, opened, /) -> int\n\n"
             "Places pieces of the given lengths into bins (see the module docstring).");

static PyObject *py_place_into(PyObject *Py_UNUSED(self), PyObject *args) {
    int strategy;
    long long cap, max_segments;
    PyObject *fill_obj, *seg_obj, *len_obj, *target_obj, *evict_obj, *full_obj, *inst_obj,
        *head_obj, *emit_obj, *open_obj;
    if (!PyArg_ParseTuple(args, "iOOOLLOOOOOOO:place_into", &strategy, &fill_obj, &seg_obj,
                          &len_obj, &cap, &max_segments, &target_obj, &evict_obj, &full_obj,
                          &inst_obj, &head_obj, &emit_obj, &open_obj)) {
        return NULL;
    }
    if (strategy != FIRST_FIT && strategy != BEST_FIT && strategy != CONCAT_THEN_SPLIT) {
        PyErr_Format(PyExc_ValueError,
                     "strategy must be 0 (first fit), 1 (best fit) or 2 (concat then split); "
                     "got %d",
                     strategy);
        return NULL;
    }
    if (cap < 1 || max_segments < 0) {
        PyErr_Format(PyExc_ValueError, "need cap >= 1 and max_segments >= 0; got %lld and %lld",
                     cap, max_segments);
        return NULL;
    }
    Buf fill = {0}, seg = {0}, lens = {0}, target = {0}, evict = {0}, full = {0}, inst = {0},
        head = {0}, emit = {0}, open = {0};
    PyObject *result = NULL;
    if (get(&fill, fill_obj, 8, 1, "fill") < 0 || get(&seg, seg_obj, 8, 1, "segments") < 0 ||
        get(&lens, len_obj, 8, 0, "lengths") < 0 || get(&target, target_obj, 4, 1, "target") < 0 ||
        get(&evict, evict_obj, 4, 1, "evict") < 0 || get(&full, full_obj, 1, 1, "full") < 0 ||
        get(&inst, inst_obj, 8, 1, "instance") < 0 || get(&head, head_obj, 8, 1, "head") < 0 ||
        get(&emit, emit_obj, 8, 1, "emitted") < 0 ||
        get(&open, open_obj, 8, 1, "opened") < 0) {
        goto done;
    }
    Py_ssize_t num_bins = fill.view.len / 8, count = lens.view.len / 8;
    if (num_bins < 1 || seg.view.len != fill.view.len) {
        PyErr_SetString(PyExc_ValueError, "fill and segments must be one item per bin (>= 1)");
        goto done;
    }
    if (target.view.len != 4 * count || evict.view.len != 4 * count || full.view.len != count ||
        inst.view.len != 8 * count || head.view.len != 8 * count) {
        PyErr_SetString(PyExc_ValueError,
                        "target, evict, full, instance and head must be one item per piece");
        goto done;
    }
    if (strategy == CONCAT_THEN_SPLIT && num_bins != 1) {
        PyErr_Format(PyExc_ValueError, "concat then split fills one bin; got %zd", num_bins);
        goto done;
    }
    const int64_t *lengths = lens.view.buf;
    int64_t cut_rows = 0; /* the most bins strategy 2 may empty beyond 2 per piece */
    for (Py_ssize_t k = 0; k < count; k++) {
        if (lengths[k] < 0 || (strategy != CONCAT_THEN_SPLIT && lengths[k] > cap)) {
            PyErr_Format(PyExc_ValueError, "piece %zd has length %lld, outside [0, cap=%lld]", k,
                         (long long)lengths[k], cap);
            goto done;
        }
        if (strategy == CONCAT_THEN_SPLIT) {
            cut_rows += lengths[k] / cap;
        }
    }
    if (emit.view.len / 8 < 2 * count + cut_rows || open.view.len != fill.view.len) {
        PyErr_SetString(PyExc_ValueError,
                        "emitted must hold 2 items per piece (plus sum(lengths) / cap for "
                        "concat then split) and opened one per bin");
        goto done;
    }
    Py_ssize_t n_emitted;
    Py_BEGIN_ALLOW_THREADS;
    n_emitted = place(strategy, fill.view.buf, seg.view.buf, num_bins, lengths, count, cap,
                      max_segments, target.view.buf, evict.view.buf, full.view.buf,
                      inst.view.buf, head.view.buf, emit.view.buf, open.view.buf);
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
    release(&head);
    release(&emit);
    release(&open);
    return result;
}


/* A writable int32 row of cap items from obj into view: 1; obj None: 0; else -1 (raised). */
static int int32_row(PyObject *obj, Py_buffer *view, Py_ssize_t cap, const char *name) {
    if (obj == Py_None) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (view->itemsize != 4 || view->len != cap * 4) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be int32 and as long as out", name);
        return -1;
    }
    return 1;
}

/* The arrays of piece k (a Piece: a tuple (contributors, mix, arrays, length)), borrowed;
 * NULL (raised) where it is not one. */
static PyObject *piece_arrays(PyObject *piece, Py_ssize_t k) {
    if (!PyTuple_Check(piece) || PyTuple_GET_SIZE(piece) != 4) {
        PyErr_Format(PyExc_TypeError, "piece %zd must be a Piece (a tuple of 4)", k);
        return NULL;
    }
    return PyTuple_GET_ITEM(piece, 2);
}

/* Item column of the arrays of each of pieces (a tuple or list of Pieces, whose arrays are
 * sequences, or token spans of span_type) into dst (cap items of item bytes), pad after;
 * segs/poss (cap int32s each, or NULL) get piece numbers and positions. The tokens copied,
 * or -1 (raised). */
static Py_ssize_t assemble_row(PyObject *pieces, Py_ssize_t column, char *dst, Py_ssize_t item,
                               Py_ssize_t cap, const char *pad, int32_t *segs, int32_t *poss,
                               PyTypeObject *span_type) {
    Py_ssize_t total = 0, n = PySequence_Fast_GET_SIZE(pieces);
    PyObject **items = PySequence_Fast_ITEMS(pieces);
    int32_t id = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t m;
        PyObject *arrays = piece_arrays(items[k], k);
        if (arrays == NULL) {
            return -1;
        }
        if (span_type != NULL && Py_TYPE(arrays) == span_type) {
            /* a token span: its tokens straight from the file, widened to int32 */
            const ZSpan *span = (const ZSpan *)arrays;
            m = span->hi - span->lo;
            if (column != 0 || item != 4 || total + m > cap) {
                PyErr_Format(PyExc_ValueError,
                             "span %zd (%zd tokens) does not fit column %zd of a row of %zd "
                             "items of size %zd after %zd (a span is one int32 column)",
                             k, m, column, cap, item, total);
                return -1;
            }
            zspan_copy(span, (int32_t *)(dst + total * item));
        } else {
            Py_buffer part;
            PyObject *array = PySequence_GetItem(arrays, column);
            if (array == NULL) {
                return -1;
            }
            int got = PyObject_GetBuffer(array, &part, PyBUF_C_CONTIGUOUS);
            Py_DECREF(array);
            if (got < 0) {
                return -1;
            }
            m = part.len / item;
            if (part.itemsize != item || part.ndim != 1 || total + m > cap) {
                PyBuffer_Release(&part);
                PyErr_Format(PyExc_ValueError,
                             "part %zd (item size %zd, %zd items) does not fit a row of %zd "
                             "items of size %zd after %zd",
                             k, part.itemsize, m, cap, item, total);
                return -1;
            }
            memcpy(dst + total * item, part.buf, (size_t)part.len);
            PyBuffer_Release(&part);
        }
        if (m > 0) {
            id++;
            if (segs) {
                int32_t *to = segs + total;
                for (Py_ssize_t i = 0; i < m; i++) {
                    to[i] = id;
                }
            }
            if (poss) {
                int32_t *to = poss + total;
                for (Py_ssize_t i = 0; i < m; i++) {
                    to[i] = (int32_t)i;
                }
            }
        }
        total += m;
    }
    int zero = 1;
    for (Py_ssize_t b = 0; b < item; b++) {
        zero &= pad[b] == 0;
    }
    if (zero) {
        memset(dst + total * item, 0, (size_t)((cap - total) * item));
    } else {
        for (Py_ssize_t i = total; i < cap; i++) {
            memcpy(dst + i * item, pad, (size_t)item);
        }
    }
    if (segs) {
        memset(segs + total, 0, (size_t)(cap - total) * 4);
    }
    if (poss) {
        memset(poss + total, 0, (size_t)(cap - total) * 4);
    }
    return total;
}

/* Asks for the first cache lines of every token span of rows at once: the spans are
 * documents at random places of a file, and their first reads would otherwise wait one
 * after another (the hardware prefetcher follows a span once it is being read). */
static void prefetch_spans(PyObject *rows, PyTypeObject *span_type) {
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); r++) {
        PyObject *pieces = PyList_GET_ITEM(rows, r);
        if (!PyList_Check(pieces) && !PyTuple_Check(pieces)) {
            return;
        }
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(pieces); k++) {
            PyObject *piece = PySequence_Fast_ITEMS(pieces)[k];
            if (!PyTuple_Check(piece) || PyTuple_GET_SIZE(piece) != 4 ||
                Py_TYPE(PyTuple_GET_ITEM(piece, 2)) != span_type) {
                continue;
            }
            const ZSpan *span = (const ZSpan *)PyTuple_GET_ITEM(piece, 2);
            const char *at = span->tokens + span->lo * span->itemsize;
            __builtin_prefetch(at);
            __builtin_prefetch(at + 64);
        }
    }
}

/* Whether span is zephon._tokens.Span (whose instances are ZSpans): 1, or 0 (raised). */
static int zspan_type_ok(PyObject *span) {
    if (!PyType_Check(span) || strcmp(((PyTypeObject *)span)->tp_name, "zephon._tokens.Span") ||
        ((PyTypeObject *)span)->tp_basicsize != (Py_ssize_t)sizeof(ZSpan)) {
        PyErr_SetString(PyExc_TypeError, "span must be zephon._tokens.Span");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(assemble_rows_doc,
             "assemble_rows(rows, column, out, pad, seg, pos, span=None, /) -> None\n\n"
             "Packed rows (RowAssembler in zephon/operators/pack/assembly.py is the same in numpy):\n"
             "rows is a list of rows, each a tuple or list of Pieces, whose arrays are each a\n"
             "sequence whose item column is a 1-D contiguous array, or a token span of type span\n"
             "(None: no span type), whose tokens are widened to int32; out is a 2-D contiguous\n"
             "writable array of\n"
             "len(rows) rows. Row i's pieces' arrays are copied, in order, into row i of out\n"
             "(every part of out's item size; row_formats checks their formats) and the rest of\n"
             "that row is filled with pad (the bytes of one item). seg and pos, int32 arrays of\n"
             "out's shape or None, get each token's piece number (1, 2, ...; an empty piece\n"
             "takes none) and position within its piece, 0 after the pieces.");

static PyObject *py_assemble_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *rows, *out_obj, *seg_obj, *pos_obj, *span_obj = Py_None;
    Py_ssize_t column;
    Py_buffer pad;
    if (!PyArg_ParseTuple(args, "O!nOy*OO|O:assemble_rows", &PyList_Type, &rows, &column, &out_obj,
                          &pad, &seg_obj, &pos_obj, &span_obj)) {
        return NULL;
    }
    PyTypeObject *span_type = NULL;
    if (span_obj != Py_None) {
        if (!zspan_type_ok(span_obj)) {
            PyBuffer_Release(&pad);
            return NULL;
        }
        span_type = (PyTypeObject *)span_obj;
    }
    PyObject *result = NULL;
    Py_buffer out = {0}, seg = {0}, pos = {0};
    int have_seg = 0, have_pos = 0;
    Py_ssize_t nrows = PyList_GET_SIZE(rows);
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
        goto done;
    }
    Py_ssize_t item = out.itemsize;
    if (item <= 0 || out.ndim != 2 || out.shape[0] != nrows || pad.len != item) {
        PyErr_SetString(PyExc_ValueError,
                        "out must be 2-D with a row per row of rows, and pad one item of it");
        goto done;
    }
    Py_ssize_t cap = out.shape[1];
    if ((have_seg = int32_row(seg_obj, &seg, nrows * cap, "seg")) < 0 ||
        (have_pos = int32_row(pos_obj, &pos, nrows * cap, "pos")) < 0) {
        goto done;
    }
    if (span_type != NULL) {
        prefetch_spans(rows, span_type);
    }
    for (Py_ssize_t r = 0; r < nrows; r++) {
        PyObject *pieces = PyList_GET_ITEM(rows, r);
        if (!PyList_Check(pieces) && !PyTuple_Check(pieces)) {
            PyErr_Format(PyExc_TypeError, "row %zd of rows must be a tuple or list of pieces", r);
            goto done;
        }
        int32_t *segs = have_seg ? (int32_t *)seg.buf + r * cap : NULL;
        int32_t *poss = have_pos ? (int32_t *)pos.buf + r * cap : NULL;
        if (assemble_row(pieces, column, (char *)out.buf + r * cap * item, item, cap, pad.buf,
                         segs, poss, span_type) < 0) {
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pad);
    if (out.obj) {
        PyBuffer_Release(&out);
    }
    if (have_seg > 0) {
        PyBuffer_Release(&seg);
    }
    if (have_pos > 0) {
        PyBuffer_Release(&pos);
    }
    return result;
}

/* The buffer format of 1-D contiguous array a (exactly of type ndarray) copied into out
 * (FORMAT_CHARS bytes): 1; 0 where a is not one (or its format is longer); no error set. */
#define FORMAT_CHARS 32
static int array_format(PyObject *a, PyObject *ndarray, char *out) {
    if ((PyObject *)Py_TYPE(a) != ndarray) {
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(a, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *format = view.format ? view.format : "B";
    int ok = view.ndim == 1 && strlen(format) < FORMAT_CHARS;
    if (ok) {
        strcpy(out, format);
    }
    PyBuffer_Release(&view);
    return ok;
}

PyDoc_STRVAR(row_formats_doc,
             "row_formats(rows, columns, ndarray, lazy, /) -> tuple[str, ...] | None\n\n"
             "rows is a list of rows, each a tuple or list of Pieces, whose arrays are a tuple\n"
             "of arrays (or arrays made when read, which are not a tuple). For each of the first\n"
             "columns items of the pieces' arrays: the buffer format they share where every one\n"
             "is a 1-D contiguous array of type ndarray (arrays that are not a tuple count as\n"
             "format lazy for column 0 and fail any other); None where any is not, a piece is\n"
             "not a Piece, or a row is empty.");

static PyObject *py_row_formats(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *rows, *ndarray, *lazy;
    Py_ssize_t columns;
    if (!PyArg_ParseTuple(args, "O!nOU:row_formats", &PyList_Type, &rows, &columns, &ndarray,
                          &lazy)) {
        return NULL;
    }
    if (columns < 1) {
        PyErr_SetString(PyExc_ValueError, "columns must be at least 1");
        return NULL;
    }
    const char *lazy_format = PyUnicode_AsUTF8(lazy);
    if (lazy_format == NULL) {
        return NULL;
    }
    if (strlen(lazy_format) >= FORMAT_CHARS) {
        Py_RETURN_NONE;
    }
    /* seen[j]: column j's format (empty until the first piece) */
    char (*seen)[FORMAT_CHARS] = PyMem_Calloc((size_t)columns, FORMAT_CHARS);
    if (seen == NULL) {
        return PyErr_NoMemory();
    }
    char format[FORMAT_CHARS];
    PyObject *formats = NULL;
    Py_ssize_t nrows = PyList_GET_SIZE(rows);
    if (nrows == 0) {
        goto none;
    }
    for (Py_ssize_t r = 0; r < nrows; r++) {
        PyObject *pieces = PyList_GET_ITEM(rows, r);
        if (!PyList_Check(pieces) && !PyTuple_Check(pieces)) {
            goto none;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(pieces);
        PyObject **items = PySequence_Fast_ITEMS(pieces);
        if (n == 0) {
            goto none;
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            if (!PyTuple_Check(items[k]) || PyTuple_GET_SIZE(items[k]) != 4) {
                goto none;
            }
            PyObject *arrays = PyTuple_GET_ITEM(items[k], 2);
            int whole = PyTuple_Check(arrays);
            if (!whole && columns > 1) {
                goto none;
            }
            if (whole && PyTuple_GET_SIZE(arrays) < columns) {
                goto none;
            }
            for (Py_ssize_t j = 0; j < columns; j++) {
                if (whole) {
                    if (!array_format(PyTuple_GET_ITEM(arrays, j), ndarray, format)) {
                        goto none;
                    }
                } else {
                    strcpy(format, lazy_format);
                }
                if (seen[j][0] == 0) {
                    strcpy(seen[j], format);
                } else if (strcmp(seen[j], format) != 0) {
                    goto none;
                }
            }
        }
    }
    formats = PyTuple_New(columns);
    for (Py_ssize_t j = 0; formats != NULL && j < columns; j++) {
        PyObject *f = PyUnicode_FromString(seen[j]);
        if (f == NULL) {
            Py_CLEAR(formats);
            break;
        }
        PyTuple_SET_ITEM(formats, j, f);
    }
    PyMem_Free(seen);
    return formats;
none:
    PyMem_Free(seen);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(parts_doc,
             "parts(rows, /) -> (contributors, mix)\n\n"
             "rows is a list of rows, each a tuple or list of Pieces, each a tuple (contributors,\n"
             "mix, arrays, length) whose contributors is a tuple or list and mix a dict of\n"
             "component -> tokens. Returns every piece's contributors in one list, in order, and the mixes\n"
             "summed per component (a new dict, components in the order first seen).");

static PyObject *py_parts(PyObject *Py_UNUSED(self), PyObject *rows) {
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "parts takes a list of rows");
        return NULL;
    }
    PyObject *contributors = PyList_New(0), *mix = PyDict_New();
    if (!contributors || !mix) {
        goto fail;
    }
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); r++) {
        PyObject *pieces = PyList_GET_ITEM(rows, r);
        if (!PyList_Check(pieces) && !PyTuple_Check(pieces)) {
            PyErr_Format(PyExc_TypeError, "row %zd must be a tuple or list of pieces", r);
            goto fail;
        }
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(pieces); k++) {
            PyObject *piece = PySequence_Fast_ITEMS(pieces)[k];
            if (!PyTuple_Check(piece) || PyTuple_GET_SIZE(piece) != 4) {
                PyErr_Format(PyExc_TypeError, "piece %zd must be a Piece (a tuple of 4)", k);
                goto fail;
            }
            PyObject *contribs = PyTuple_GET_ITEM(piece, 0), *m = PyTuple_GET_ITEM(piece, 1);
            if (!PyTuple_Check(contribs) && !PyList_Check(contribs)) {
                PyErr_Format(PyExc_TypeError, "piece %zd's contributors must be a tuple or list",
                             k);
                goto fail;
            }
            if (!PyDict_Check(m)) {
                PyErr_Format(PyExc_TypeError, "piece %zd's component tokens must be a dict", k);
                goto fail;
            }
            Py_ssize_t c = PySequence_Fast_GET_SIZE(contribs);
            PyObject **items = PySequence_Fast_ITEMS(contribs);
            for (Py_ssize_t i = 0; i < c; i++) {
                if (PyList_Append(contributors, items[i]) < 0) {
                    goto fail;
                }
            }
            Py_ssize_t pos = 0;
            PyObject *comp, *tokens;
            while (PyDict_Next(m, &pos, &comp, &tokens)) {
                PyObject *seen = PyDict_GetItemWithError(mix, comp); /* borrowed */
                if (seen == NULL && PyErr_Occurred()) {
                    goto fail;
                }
                PyObject *sum = seen == NULL ? Py_NewRef(tokens) : PyNumber_Add(seen, tokens);
                if (sum == NULL) {
                    goto fail;
                }
                int bad = PyDict_SetItem(mix, comp, sum);
                Py_DECREF(sum);
                if (bad < 0) {
                    goto fail;
                }
            }
        }
    }
    return Py_BuildValue("(NN)", contributors, mix);
fail:
    Py_XDECREF(contributors);
    Py_XDECREF(mix);
    return NULL;
}

/* A new instance of tuple type `type` holding the n items (new references stolen). */
static PyObject *new_tuple_of(PyTypeObject *type, PyObject **items, Py_ssize_t n) {
    PyObject *t = type->tp_alloc(type, n);
    if (t == NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(items[i]);
        }
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            Py_DECREF(t);
            for (Py_ssize_t j = i + 1; j < n; j++) {
                Py_XDECREF(items[j]);
            }
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

static int tuple_type_ok(PyTypeObject *type) {
    return PyType_IsSubtype(type, &PyTuple_Type) && type->tp_itemsize == sizeof(PyObject *) &&
           type->tp_dictoffset == 0;
}

/* The length of ids where it is exactly of type ndarray and 1-D; -1 (no error) otherwise. */
static Py_ssize_t one_d_length(PyObject *ids, PyObject *ndarray) {
    if ((PyObject *)Py_TYPE(ids) != ndarray) {
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(ids, &view, PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t n = view.ndim == 1 ? view.shape[0] : -1;
    PyBuffer_Release(&view);
    return n;
}

/* Whether contributors `whole` (a tuple or list) is one whole sample: one contributor whose
 * child is 0 and whose last flag equals True. -1 on error. */
static int one_whole_sample(PyObject *whole) {
    if (!PyTuple_Check(whole) && !PyList_Check(whole)) {
        return 0;
    }
    if (PySequence_Fast_GET_SIZE(whole) != 1) {
        return 0;
    }
    PyObject *c = PySequence_Fast_ITEMS(whole)[0];
    if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 4) {
        return 0;
    }
    PyObject *child = PyTuple_GET_ITEM(c, 2);
    if (!PyLong_Check(child) || PyLong_AsLong(child) != 0) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
        }
        return 0;
    }
    return PyObject_RichCompareBool(PyTuple_GET_ITEM(c, 3), Py_True, Py_EQ);
}

PyDoc_STRVAR(split_pieces_doc,
             "split_pieces(piece, contributor, ndarray, span, datas, contribs, mixes, key,\n"
             "max_len, /) -> list | None\n\n"
             "The fused split -> pack stage's pieces of pre-tokenized samples (_Pieces in\n"
             "zephon/operators/pack/fused.py is the same in Python): sample k is datas[k][key], a\n"
             "1-D array of type exactly ndarray, or datas[k] itself, a token span of type span\n"
             "(zephon._tokens.Span, or None: no spans), with contributors contribs[k] and mix mixes[k]. Up to\n"
             "max_len tokens it is one piece(contribs[k], mixes[k], (array,) or the span, n);\n"
             "longer, it must be one whole sample of one component, and is cut every max_len\n"
             "tokens into pieces ((contributor(chunk, offset, j, j == last),), {component:\n"
             "tokens}, (array[lo:hi],) or a span of those tokens, tokens). None (no error)\n"
             "where a sample is not one of those: the Python code then says what is wrong.");

static PyObject *py_split_pieces(PyObject *Py_UNUSED(self), PyObject *args) {
    PyTypeObject *piece_type, *contrib_type;
    PyObject *ndarray, *span, *datas, *contribs, *mixes, *key;
    Py_ssize_t max_len;
    if (!PyArg_ParseTuple(args, "O!O!OOO!OO!On:split_pieces", &PyType_Type, &piece_type,
                          &PyType_Type, &contrib_type, &ndarray, &span, &PyList_Type, &datas,
                          &contribs, &PyList_Type, &mixes, &key, &max_len)) {
        return NULL;
    }
    if (span != Py_None && !zspan_type_ok(span)) {
        return NULL;
    }
    PyTypeObject *span_type = span == Py_None ? NULL : (PyTypeObject *)span;
    if (!tuple_type_ok(piece_type) || !tuple_type_ok(contrib_type) || max_len < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "split_pieces takes tuple types without a __dict__ and max_len >= 1");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(contribs, "contribs must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(datas);
    if (PySequence_Fast_GET_SIZE(fast) != n || PyList_GET_SIZE(mixes) != n) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "datas, contribs and mixes must be of one length");
        return NULL;
    }
    PyObject **wholes = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *data = PyList_GET_ITEM(datas, k), *ids;
        Py_ssize_t len;
        int is_span = span_type != NULL && Py_TYPE(data) == span_type;
        if (is_span) {
            ids = data;
            len = ((ZSpan *)data)->hi - ((ZSpan *)data)->lo;
        } else {
            if (!PyDict_CheckExact(data)) {
                goto off_path;
            }
            ids = PyDict_GetItemWithError(data, key); /* borrowed */
            if (ids == NULL) {
                if (PyErr_Occurred()) {
                    goto fail;
                }
                goto off_path;
            }
            len = one_d_length(ids, ndarray);
            if (len < 0) {
                goto off_path;
            }
        }
        PyObject *whole = wholes[k], *mix = PyList_GET_ITEM(mixes, k);
        if (len <= max_len) {
            PyObject *arrays = is_span ? Py_NewRef(ids) : PyTuple_Pack(1, ids);
            PyObject *items[4] = {Py_NewRef(whole), Py_NewRef(mix), arrays, PyLong_FromSsize_t(len)};
            PyObject *piece = new_tuple_of(piece_type, items, 4);
            if (piece == NULL || PyList_Append(out, piece) < 0) {
                Py_XDECREF(piece);
                goto fail;
            }
            Py_DECREF(piece);
            continue;
        }
        int ok = one_whole_sample(whole);
        if (ok < 0) {
            goto fail;
        }
        if (!ok || !PyDict_Check(mix) || PyDict_GET_SIZE(mix) != 1) {
            goto off_path;
        }
        Py_ssize_t pos = 0;
        PyObject *component, *weight;
        PyDict_Next(mix, &pos, &component, &weight);
        PyObject *c0 = PySequence_Fast_ITEMS(whole)[0];
        PyObject *chunk_id = PyTuple_GET_ITEM(c0, 0), *offset = PyTuple_GET_ITEM(c0, 1);
        Py_ssize_t pieces = (len + max_len - 1) / max_len;
        for (Py_ssize_t j = 0; j < pieces; j++) {
            Py_ssize_t lo = j * max_len, hi = lo + max_len < len ? lo + max_len : len;
            PyObject *citems[4] = {Py_NewRef(chunk_id), Py_NewRef(offset), PyLong_FromSsize_t(j),
                                   PyBool_FromLong(j == pieces - 1)};
            PyObject *contributor = new_tuple_of(contrib_type, citems, 4);
            PyObject *one = contributor ? PyTuple_Pack(1, contributor) : NULL;
            Py_XDECREF(contributor);
            PyObject *tokens = PyLong_FromSsize_t(hi - lo);
            PyObject *part_mix = tokens ? PyDict_New() : NULL;
            if (part_mix != NULL && PyDict_SetItem(part_mix, component, tokens) < 0) {
                Py_CLEAR(part_mix);
            }
            PyObject *arrays;
            if (is_span) {
                const ZSpan *of = (const ZSpan *)ids;
                arrays = zspan_part(span_type, of, of->lo + lo, of->lo + hi);
            } else {
                PyObject *part = PySequence_GetSlice(ids, lo, hi);
                arrays = part ? PyTuple_Pack(1, part) : NULL;
                Py_XDECREF(part);
            }
            PyObject *items[4] = {one, part_mix, arrays, tokens};
            if (one == NULL || part_mix == NULL || arrays == NULL || tokens == NULL) {
                Py_XDECREF(one);
                Py_XDECREF(part_mix);
                Py_XDECREF(arrays);
                Py_XDECREF(tokens);
                goto fail;
            }
            PyObject *piece = new_tuple_of(piece_type, items, 4);
            if (piece == NULL || PyList_Append(out, piece) < 0) {
                Py_XDECREF(piece);
                goto fail;
            }
            Py_DECREF(piece);
        }
    }
    Py_DECREF(fast);
    return out;
off_path:
    Py_DECREF(fast);
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

/* n int64s of buffer obj into view (1), or -1 (raised). */
static int int64s(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (view->itemsize != 8 || view->len % 8) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be int64", name);
        return -1;
    }
    return 1;
}

/* a + b as a new list (either may be NULL: empty). */
static PyObject *joined(PyObject *a, PyObject *b) {
    if (a != NULL && b != NULL) {
        return PySequence_Concat(a, b);
    }
    if (a == NULL && b == NULL) {
        return PyList_New(0);
    }
    return Py_NewRef(a != NULL ? a : b);
}

/* placed[key] into *out (borrowed; NULL where absent): 0, or -1 (raised). */
static int placed_at(PyObject *placed, int64_t key, PyObject **out) {
    PyObject *k = PyLong_FromLongLong(key);
    if (k == NULL) {
        return -1;
    }
    *out = PyDict_GetItemWithError(placed, k);
    Py_DECREF(k);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

PyDoc_STRVAR(bin_rows_doc,
             "bin_rows(pieces, instance, emitted, opened, held, /) -> (rows, new)\n\n"
             "Pack's bookkeeping around place_into (bin_rows in zephon/operators/pack/pack.py is the\n"
             "same in Python). pieces[k] went to instance[k]; held[b] is the list of pieces bin\n"
             "b held when the call began (its instance b). rows: for each instance of emitted,\n"
             "the pieces it held (what it held before, then this call's, in order). held is\n"
             "updated in place: bin b ends with instance opened[b] * len(held) + b (its pieces\n"
             "before the call, only if opened[b] is 0, then this call's). new: the bins' lists\n"
             "that this call's pieces went into.");

static PyObject *py_bin_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *pieces, *instance_obj, *emitted_obj, *opened_obj, *held;
    if (!PyArg_ParseTuple(args, "O!OOOO!:bin_rows", &PyList_Type, &pieces, &instance_obj,
                          &emitted_obj, &opened_obj, &PyList_Type, &held)) {
        return NULL;
    }
    Py_buffer instance = {0}, emitted = {0}, opened = {0};
    PyObject *placed = NULL, *rows = NULL, *news = NULL, *result = NULL;
    if (int64s(instance_obj, &instance, "instance") < 0) {
        return NULL;
    }
    if (int64s(emitted_obj, &emitted, "emitted") < 0) {
        goto done;
    }
    if (int64s(opened_obj, &opened, "opened") < 0) {
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(pieces), num_bins = PyList_GET_SIZE(held);
    if (instance.len / 8 != n || opened.len / 8 != num_bins) {
        PyErr_SetString(PyExc_ValueError, "one instance per piece and one opened per bin");
        goto done;
    }
    for (Py_ssize_t b = 0; b < num_bins; b++) {
        if (!PyList_Check(PyList_GET_ITEM(held, b))) {
            PyErr_SetString(PyExc_TypeError, "held must be a list of lists");
            goto done;
        }
    }
    const int64_t *inst = instance.buf, *emit = emitted.buf, *open = opened.buf;
    placed = PyDict_New();
    rows = PyList_New(emitted.len / 8);
    news = PyList_New(0);
    if (placed == NULL || rows == NULL || news == NULL) {
        goto done;
    }
    PyObject *last_key = NULL, *last_list = NULL; /* runs of one instance: no lookup */
    int64_t last = -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (last_list == NULL || inst[k] != last) {
            last = inst[k];
            last_key = PyLong_FromLongLong(last);
            if (last_key == NULL) {
                goto done;
            }
            last_list = PyDict_GetItemWithError(placed, last_key); /* borrowed */
            if (last_list == NULL) {
                if (PyErr_Occurred() || (last_list = PyList_New(0)) == NULL ||
                    PyDict_SetItem(placed, last_key, last_list) < 0) {
                    Py_XDECREF(last_list);
                    Py_DECREF(last_key);
                    goto done;
                }
                Py_DECREF(last_list); /* the dict holds it */
            }
            Py_DECREF(last_key);
        }
        if (PyList_Append(last_list, PyList_GET_ITEM(pieces, k)) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t r = 0; r < emitted.len / 8; r++) {
        int64_t key = emit[r];
        PyObject *fresh;
        if (placed_at(placed, key, &fresh) < 0) {
            goto done;
        }
        PyObject *old = key >= 0 && key < num_bins ? PyList_GET_ITEM(held, key) : NULL;
        PyObject *row = joined(old, fresh);
        if (row == NULL) {
            goto done;
        }
        PyList_SET_ITEM(rows, r, row);
    }
    for (Py_ssize_t b = 0; b < num_bins; b++) {
        PyObject *fresh;
        if (placed_at(placed, open[b] * num_bins + b, &fresh) < 0) {
            goto done;
        }
        PyObject *kept = joined(open[b] == 0 ? PyList_GET_ITEM(held, b) : NULL, fresh);
        if (kept == NULL) {
            goto done;
        }
        if (fresh != NULL && PyList_Append(news, kept) < 0) {
            Py_DECREF(kept);
            goto done;
        }
        PyList_SetItem(held, b, kept); /* steals kept */
    }
    result = PyTuple_Pack(2, rows, news);
done:
    Py_XDECREF(placed);
    Py_XDECREF(rows);
    Py_XDECREF(news);
    if (instance.obj) {
        PyBuffer_Release(&instance);
    }
    if (emitted.obj) {
        PyBuffer_Release(&emitted);
    }
    if (opened.obj) {
        PyBuffer_Release(&opened);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"place_into", py_place_into, METH_VARARGS, place_into_doc},
    {"assemble_rows", py_assemble_rows, METH_VARARGS, assemble_rows_doc},
    {"row_formats", py_row_formats, METH_VARARGS, row_formats_doc},
    {"parts", py_parts, METH_O, parts_doc},
    {"split_pieces", py_split_pieces, METH_VARARGS, split_pieces_doc},
    {"bin_rows", py_bin_rows, METH_VARARGS, bin_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._pack",
    .m_doc = "Where pack's pieces go (zephon.operators.pack.placement), in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
