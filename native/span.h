/* A token span: tokens lo:hi of a token file as mapped, made int32 when they are read.
 *
 * zephon._tokens defines the type (Span, and spans() that makes a read's documents as spans
 * instead of copies); zephon._pack takes the type as an argument, cuts long spans into
 * pieces (split_pieces) and copies a span's tokens straight into a packed row
 * (assemble_rows). Both read the object through this struct. zephon/sources/token_span.py
 * is the same type in Python.
 *
 * A span holds a reference to the array it points into (a 1-D contiguous array of
 * little-endian unsigned ids of `itemsize` bytes, 2 or 4): an ndarray's data stays where
 * it is while it is referenced (numpy refuses to resize a referenced array), and a mapped
 * file's array holds the mapping open.
 */
#ifndef ZEPHON_SPAN_H
#define ZEPHON_SPAN_H

#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    PyObject *owner;      /* the array the tokens are in */
    const char *tokens;   /* its first item */
    Py_ssize_t lo, hi;    /* the span's items, 0 <= lo <= hi <= the array's length */
    int itemsize;         /* 2 or 4 */
} ZSpan;

/* The span's tokens as int32 into dst (hi - lo of them): each converted as numpy's
 * astype(int32) converts it (uint32 ids past 2**31 - 1 wrap). */
static inline void zspan_copy(const ZSpan *s, int32_t *dst) {
    Py_ssize_t n = s->hi - s->lo;
    if (s->itemsize == 2) {
        const uint16_t *from = (const uint16_t *)s->tokens + s->lo;
        for (Py_ssize_t t = 0; t < n; t++) {
            dst[t] = (int32_t)from[t];
        }
    } else {
        const uint32_t *from = (const uint32_t *)s->tokens + s->lo;
        for (Py_ssize_t t = 0; t < n; t++) {
            dst[t] = (int32_t)from[t];
        }
    }
}

/* A new span of `type` (whose instances are ZSpans) over items lo:hi of what `of` spans
 * the tokens of (the same owner), or NULL (raised). */
static inline PyObject *zspan_part(PyTypeObject *type, const ZSpan *of, Py_ssize_t lo,
                                   Py_ssize_t hi) {
    ZSpan *s = (ZSpan *)type->tp_alloc(type, 0);
    if (s == NULL) {
        return NULL;
    }
    s->owner = Py_NewRef(of->owner);
    s->tokens = of->tokens;
    s->lo = lo;
    s->hi = hi;
    s->itemsize = of->itemsize;
    return (PyObject *)s;
}

#endif
