/* zephon._tokens: documents copied out of a token file, in C (zephon/sources/token_file.py
 * does the same with numpy where this module is not built), or taken as spans of it.
 *
 * documents(src, itemsize, bounds, indices, key) -> list of {key: int32 array} | None
 * copies document indices[k] (tokens bounds[i]:bounds[i + 1] of src, a buffer of
 * little-endian unsigned tokens of itemsize bytes, 2 or 4: the token file as mapped; bounds
 * the file's N + 1 int64 token offsets) into a new int32 array each, every token converted
 * as numpy's astype(int32) converts it, and returns them as one-key dicts, as
 * TokenFileSource.read does. An index that is not an int in [0, N) gives None (no error):
 * the caller's own check then names it. One call for a read's documents (the arrays are
 * made with the GIL held, the tokens copied with it released), instead of an array, a
 * numpy conversion and a dict per document in Python.
 *
 * Span(tokens, lo, hi): tokens lo:hi of tokens (a 1-D contiguous ndarray of little-endian
 * unsigned ids, 2 or 4 bytes each: a token file as mapped), made into an int32 array when
 * read (span[0]); see span.h. spans(tokens, bounds, indices) -> list of Span | None: document
 * indices[k] as a span (no copy), None where documents() gives None.
 * zephon/sources/token_span.py is the same in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "span.h"

typedef struct {
    int32_t *dst;
    Py_ssize_t lo, n;
} Copy;

/* indices[k] as a document number in [0, docs), or -1 when it is not one (no error set);
 * -2 with an error set when reading it failed otherwise. */
static Py_ssize_t document_number(PyObject *index, Py_ssize_t docs) {
    Py_ssize_t i;
    if (PyLong_Check(index)) {
        i = PyLong_AsSsize_t(index);
    } else {
        PyObject *as_int = PyNumber_Index(index);
        if (as_int == NULL) {
            PyErr_Clear();
            return -1;
        }
        i = PyLong_AsSsize_t(as_int);
        Py_DECREF(as_int);
    }
    if (i == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -2;
        }
        PyErr_Clear();
        return -1;
    }
    return (i < 0 || i >= docs) ? -1 : i;
}

/* A file's N + 1 int64 document bounds into view: 0, or -1 (raised; view released). */
static int get_bounds(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (view->len % 8 || view->len < 8) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_SetString(PyExc_ValueError, "bounds must hold N + 1 int64 offsets");
        return -1;
    }
    return 0;
}

/* The token spans of documents indices[0..n) (offsets: the N + 1 bounds of a file of
 * `tokens` tokens) into spans (2 * n int64s: lo, hi of each): 0; 1 where an index is not a
 * document number (no error set); -1 (raised) where reading one failed or a span is not
 * inside the tokens. */
static int document_spans(PyObject **indices, Py_ssize_t n, const int64_t *offsets,
                          Py_ssize_t docs, Py_ssize_t tokens, int64_t *spans) {
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = document_number(indices[k], docs);
        if (i < 0) {
            return i == -1 ? 1 : -1;
        }
        int64_t lo = offsets[i], hi = offsets[i + 1];
        if (lo < 0 || hi < lo || hi > tokens) {
            PyErr_Format(PyExc_ValueError,
                         "document %zd (tokens %lld:%lld) is not inside the %zd tokens", i,
                         (long long)lo, (long long)hi, tokens);
            return -1;
        }
        spans[2 * k] = lo;
        spans[2 * k + 1] = hi;
    }
    return 0;
}

PyDoc_STRVAR(documents_doc,
             "documents(src, itemsize, bounds, indices, key, /) -> list[dict] | None\n\n"
             "Document indices[k] of a token file (tokens bounds[i]:bounds[i + 1] of src, a\n"
             "buffer of little-endian unsigned tokens of itemsize bytes, 2 or 4; bounds a\n"
             "buffer of N + 1 int64 offsets) as {key: a new int32 array}, each token\n"
             "converted as astype(int32) converts it. None when an index is not an int in\n"
             "[0, N). Raises ValueError for a span outside src.");

static PyObject *py_documents(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *src_obj, *bounds_obj, *indices_obj, *key;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "OnOOU:documents", &src_obj, &itemsize, &bounds_obj,
                          &indices_obj, &key)) {
        return NULL;
    }
    if (itemsize != 2 && itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 2 or 4; got %zd", itemsize);
        return NULL;
    }
    PyObject *indices = PySequence_Fast(indices_obj, "indices must be a sequence");
    if (indices == NULL) {
        return NULL;
    }
    Py_buffer src = {0}, bounds = {0};
    PyObject *out = NULL, *result = NULL;
    Copy *copies = NULL;
    int64_t *spans = NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    if (get_bounds(bounds_obj, &bounds) < 0) {
        goto done;
    }
    const int64_t *offsets = bounds.buf;
    Py_ssize_t docs = bounds.len / 8 - 1, tokens = src.len / itemsize;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(indices);
    PyObject **items = PySequence_Fast_ITEMS(indices);
    copies = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Copy));
    spans = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(int64_t));
    out = PyList_New(n);
    if (copies == NULL || spans == NULL || out == NULL) {
        if (copies == NULL || spans == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    int got = document_spans(items, n, offsets, docs, tokens, spans);
    if (got != 0) {
        if (got == 1) {
            result = Py_NewRef(Py_None);
        }
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t lo = spans[2 * k], hi = spans[2 * k + 1];
        npy_intp dims[1] = {(npy_intp)(hi - lo)};
        PyObject *array = PyArray_SimpleNew(1, dims, NPY_INT32);
        if (array == NULL) {
            goto done;
        }
        PyObject *doc = PyDict_New();
        if (doc == NULL || PyDict_SetItem(doc, key, array) < 0) {
            Py_XDECREF(doc);
            Py_DECREF(array);
            goto done;
        }
        copies[k].dst = PyArray_DATA((PyArrayObject *)array);
        Py_DECREF(array);  /* the dict holds it */
        copies[k].lo = (Py_ssize_t)lo;
        copies[k].n = (Py_ssize_t)(hi - lo);
        PyList_SET_ITEM(out, k, doc);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t *dst = copies[k].dst;
        Py_ssize_t m = copies[k].n;
        if (k + 1 < n) { /* the next document's first lines, while this one is copied */
            const char *next = (const char *)src.buf + copies[k + 1].lo * itemsize;
            __builtin_prefetch(next);
            __builtin_prefetch(next + 64);
            __builtin_prefetch(copies[k + 1].dst, 1);
        }
        if (itemsize == 2) {
            const uint16_t *from = (const uint16_t *)src.buf + copies[k].lo;
            for (Py_ssize_t t = 0; t < m; t++) {
                dst[t] = (int32_t)from[t];
            }
        } else {
            const uint32_t *from = (const uint32_t *)src.buf + copies[k].lo;
            for (Py_ssize_t t = 0; t < m; t++) {
                dst[t] = (int32_t)from[t];  /* wraps past 2**31 - 1, as astype does */
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(out);
done:
    Py_XDECREF(out);
    PyMem_Free(copies);
    PyMem_Free(spans);
    if (bounds.obj) {
        PyBuffer_Release(&bounds);
    }
    if (src.obj) {
        PyBuffer_Release(&src);
    }
    Py_DECREF(indices);
    return result;
}

/* ------------------------------------------------------------------------------ Span */

static PyTypeObject SpanType;

/* The items of tokens, an ndarray that spans may point into (1-D, C-contiguous, unsigned
 * ids of 2 or 4 bytes in this machine's order, which the caller keeps little-endian), or -1
 * (raised). */
static Py_ssize_t span_items(PyObject *tokens) {
    if (!PyArray_Check(tokens)) {
        PyErr_Format(PyExc_TypeError, "tokens must be a numpy array; got %.80s",
                     Py_TYPE(tokens)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)tokens;
    PyArray_Descr *d = PyArray_DESCR(a);
    if (PyArray_NDIM(a) != 1 || !PyArray_IS_C_CONTIGUOUS(a) || d->kind != 'u' ||
        (PyArray_ITEMSIZE(a) != 2 && PyArray_ITEMSIZE(a) != 4) || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_SetString(PyExc_ValueError,
                        "tokens must be a 1-D contiguous array of uint16 or uint32 ids");
        return -1;
    }
    return PyArray_DIM(a, 0);
}

static PyObject *new_span(PyObject *tokens, Py_ssize_t lo, Py_ssize_t hi) {
    ZSpan *s = PyObject_New(ZSpan, &SpanType);
    if (s == NULL) {
        return NULL;
    }
    s->owner = Py_NewRef(tokens);
    s->tokens = PyArray_BYTES((PyArrayObject *)tokens);
    s->itemsize = (int)PyArray_ITEMSIZE((PyArrayObject *)tokens);
    s->lo = lo;
    s->hi = hi;
    return (PyObject *)s;
}

static PyObject *span_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwargs) {
    static char *names[] = {"tokens", "lo", "hi", NULL};
    PyObject *tokens;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onn:Span", names, &tokens, &lo, &hi)) {
        return NULL;
    }
    Py_ssize_t n = span_items(tokens);
    if (n < 0) {
        return NULL;
    }
    if (lo < 0 || hi < lo || hi > n) {
        PyErr_Format(PyExc_ValueError, "span %zd:%zd is not inside the %zd tokens", lo, hi, n);
        return NULL;
    }
    return new_span(tokens, lo, hi);
}

static void span_dealloc(PyObject *self) {
    Py_XDECREF(((ZSpan *)self)->owner);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t span_length(PyObject *Py_UNUSED(self)) {
    return 1; /* one column, as a piece's arrays: the tokens */
}

static PyObject *span_item(PyObject *self, Py_ssize_t i) {
    if (i != 0) {
        PyErr_SetString(PyExc_IndexError, "a span has one column, its tokens (span[0])");
        return NULL;
    }
    ZSpan *s = (ZSpan *)self;
    npy_intp dims[1] = {(npy_intp)(s->hi - s->lo)};
    PyObject *array = PyArray_SimpleNew(1, dims, NPY_INT32);
    if (array != NULL) {
        zspan_copy(s, PyArray_DATA((PyArrayObject *)array));
    }
    return array;
}

static PyObject *span_repr(PyObject *self) {
    ZSpan *s = (ZSpan *)self;
    return PyUnicode_FromFormat("Span(%zd:%zd, uint%d)", s->lo, s->hi, s->itemsize * 8);
}

static PyMemberDef span_members[] = {
    {"tokens", T_OBJECT_EX, offsetof(ZSpan, owner), READONLY, "the array spanned"},
    {"lo", T_PYSSIZET, offsetof(ZSpan, lo), READONLY, "the span's first token"},
    {"hi", T_PYSSIZET, offsetof(ZSpan, hi), READONLY, "the token after the span's last"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods span_as_sequence = {
    .sq_length = span_length,
    .sq_item = span_item,
};

PyDoc_STRVAR(span_doc,
             "Span(tokens, lo, hi)\n\n"
             "Tokens lo:hi of tokens (a 1-D contiguous array of uint16 or uint32 ids: a token\n"
             "file as mapped), as a piece's arrays: one column, span[0] the tokens as a new\n"
             "int32 array; zephon._pack copies them straight into a packed row.");

static PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zephon._tokens.Span",
    .tp_basicsize = sizeof(ZSpan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = span_doc,
    .tp_new = span_new,
    .tp_dealloc = span_dealloc,
    .tp_repr = span_repr,
    .tp_members = span_members,
    .tp_as_sequence = &span_as_sequence,
};

PyDoc_STRVAR(spans_doc,
             "spans(tokens, bounds, indices, /) -> list[Span] | None\n\n"
             "Document indices[k] of a token file (tokens bounds[i]:bounds[i + 1] of tokens,\n"
             "the file as mapped; bounds a buffer of N + 1 int64 offsets) as a Span, without\n"
             "copying it. None when an index is not an int in [0, N). Raises ValueError for a\n"
             "span outside tokens.");

static PyObject *py_spans(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *tokens, *bounds_obj, *indices_obj;
    if (!PyArg_ParseTuple(args, "OOO:spans", &tokens, &bounds_obj, &indices_obj)) {
        return NULL;
    }
    Py_ssize_t items = span_items(tokens);
    if (items < 0) {
        return NULL;
    }
    PyObject *indices = PySequence_Fast(indices_obj, "indices must be a sequence");
    if (indices == NULL) {
        return NULL;
    }
    Py_buffer bounds = {0};
    PyObject *out = NULL, *result = NULL;
    int64_t *bounds_of = NULL;
    if (get_bounds(bounds_obj, &bounds) < 0) {
        goto done;
    }
    const int64_t *offsets = bounds.buf;
    Py_ssize_t docs = bounds.len / 8 - 1, n = PySequence_Fast_GET_SIZE(indices);
    bounds_of = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(int64_t));
    out = PyList_New(n);
    if (bounds_of == NULL || out == NULL) {
        if (bounds_of == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    int got = document_spans(PySequence_Fast_ITEMS(indices), n, offsets, docs, items, bounds_of);
    if (got != 0) {
        if (got == 1) {
            result = Py_NewRef(Py_None);
        }
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *span = new_span(tokens, (Py_ssize_t)bounds_of[2 * k],
                                  (Py_ssize_t)bounds_of[2 * k + 1]);
        if (span == NULL) {
            goto done;
        }
        PyList_SET_ITEM(out, k, span);
    }
    result = Py_NewRef(out);
done:
    Py_XDECREF(out);
    PyMem_Free(bounds_of);
    if (bounds.obj) {
        PyBuffer_Release(&bounds);
    }
    Py_DECREF(indices);
    return result;
}

static PyMethodDef methods[] = {
    {"documents", py_documents, METH_VARARGS, documents_doc},
    {"spans", py_spans, METH_VARARGS, spans_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._tokens",
    .m_doc = "Documents copied out of a token file (zephon.sources.token_file), or spans of it, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__tokens(void) {
    import_array();
    if (PyType_Ready(&SpanType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Span", (PyObject *)&SpanType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
