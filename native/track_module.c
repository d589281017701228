/* zephon._track: the count of delivered pieces that closes their offsets
 * (ChunkTrack.add_run in zephon/tracking/tracker.py, which is the same function in Python), for
 * chunks of at most 64 offsets; a restore runs it for every piece it drops. And the
 * contributors of a chunk's whole samples (zephon.records.whole_samples), made untracked
 * by the collector.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyDoc_STRVAR(close_run_doc,
             "close_run(delivered, total, bitmap, chunk_id, pieces, i, components=None, docs=None, /)\n"
             "    -> (i, bitmap, closed)\n\n"
             "ChunkTrack.add_run (zephon/tracking/tracker.py) for a chunk of at most 64 offsets:\n"
             "counts pieces[i], pieces[i+1], ... (contributors) while they are of chunk_id,\n"
             "updating the lists delivered and total in place; returns the index of the first\n"
             "piece not counted, the new bitmap of closed offsets and how many it closed. With\n"
             "docs (a dict), a last piece adds 1 to docs[components[offset]] (components: the\n"
             "chunk's component per offset, a list of ints).");

/* docs[key] += by for a dict docs. */
static int count_docs(PyObject *docs, PyObject *key, long by) {
    PyObject *had = PyDict_GetItemWithError(docs, key); /* borrowed */
    if (had == NULL && PyErr_Occurred()) {
        return -1;
    }
    long n = had == NULL ? 0 : PyLong_AsLong(had);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *v = PyLong_FromLong(n + by);
    if (v == NULL) {
        return -1;
    }
    int rc = PyDict_SetItem(docs, key, v);
    Py_DECREF(v);
    return rc;
}

/* Components below this are counted in a local array and added to docs once a call. */
#define LOCAL_COMPONENTS 64

/* The arguments are checked here as PyArg_ParseTuple("O!O!KlO!n|OO") would: a call per run
 * of pieces, where parsing a format was much of the call. */
static PyObject *py_close_run(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 6 || nargs > 8) {
        PyErr_Format(PyExc_TypeError, "close_run takes from 6 to 8 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *delivered = args[0], *total = args[1], *pieces = args[4];
    PyObject *components = nargs > 6 ? args[6] : Py_None, *docs = nargs > 7 ? args[7] : Py_None;
    if (!PyList_Check(delivered) || !PyList_Check(total) || !PyList_Check(pieces)) {
        PyErr_SetString(PyExc_TypeError, "close_run: delivered, total and pieces must be lists");
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_Format(PyExc_TypeError, "close_run: bitmap must be int, not %.50s",
                     Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    unsigned long long bitmap = PyLong_AsUnsignedLongLongMask(args[2]);
    if (bitmap == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    long chunk_id = PyLong_AsLong(args[3]);
    if (chunk_id == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t i = PyNumber_AsSsize_t(args[5], PyExc_OverflowError);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t size = PyList_GET_SIZE(delivered), n = PyList_GET_SIZE(pieces);
    if (size > 64 || PyList_GET_SIZE(total) != size || i < 0) {
        PyErr_SetString(PyExc_ValueError, "close_run takes at most 64 offsets and i >= 0");
        return NULL;
    }
    if (docs == Py_None) {
        docs = NULL;
    } else if (!PyDict_Check(docs) || !PyList_Check(components) ||
               PyList_GET_SIZE(components) != size) {
        PyErr_SetString(PyExc_TypeError,
                        "close_run: docs must be a dict and components a list of one int an offset");
        return NULL;
    }
    long closed = 0;
    long local[LOCAL_COMPONENTS];
    long top = 0; /* local[:top] are the counts so far; local[top:] is not set yet */
    for (; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i), **f;
        if (PyTuple_Check(p) && PyTuple_GET_SIZE(p) == 4) { /* a Contributor */
            f = &PyTuple_GET_ITEM(p, 0);
        } else if (PyList_Check(p) && PyList_GET_SIZE(p) == 4) { /* a row from a worker */
            f = PySequence_Fast_ITEMS(p);
        } else {
            PyErr_SetString(PyExc_TypeError, "a piece is not (chunk_id, offset, child, last)");
            return NULL;
        }
        long cid = PyLong_AsLong(f[0]);
        long offset = PyLong_AsLong(f[1]);
        long child = PyLong_AsLong(f[2]);
        int last = PyObject_IsTrue(f[3]);
        if (PyErr_Occurred() || last < 0) {
            return NULL;
        }
        if (cid != chunk_id) {
            break;
        }
        if (offset < 0 || offset >= size) {
            PyErr_Format(PyExc_IndexError, "offset %ld is outside a chunk of %zd", offset, size);
            return NULL;
        }
        long got = PyLong_AsLong(PyList_GET_ITEM(delivered, offset)) + 1;
        long want = last ? child + 1 : PyLong_AsLong(PyList_GET_ITEM(total, offset));
        if (PyErr_Occurred()) {
            return NULL;
        }
        PyObject *v = PyLong_FromLong(got);
        if (v == NULL || PyList_SetItem(delivered, offset, v) < 0) {
            return NULL;
        }
        if (last) {
            v = PyLong_FromLong(want);
            if (v == NULL || PyList_SetItem(total, offset, v) < 0) {
                return NULL;
            }
            if (docs != NULL) {
                PyObject *key = PyList_GET_ITEM(components, offset);
                long c = PyLong_AsLong(key);
                if (c == -1 && PyErr_Occurred()) {
                    return NULL;
                }
                if (c >= 0 && c < LOCAL_COMPONENTS) {
                    for (; top <= c; top++) {
                        local[top] = 0;
                    }
                    local[c]++;
                } else if (count_docs(docs, key, 1) < 0) {
                    return NULL;
                }
            }
        }
        unsigned long long bit = 1ULL << offset;
        if (got == want && !(bitmap & bit)) {
            bitmap |= bit;
            closed++;
        }
    }
    if (docs != NULL) {
        for (long c = 0; c < top; c++) {
            if (local[c] == 0) {
                continue;
            }
            PyObject *key = PyLong_FromLong(c);
            int rc = key == NULL ? -1 : count_docs(docs, key, local[c]);
            Py_XDECREF(key);
            if (rc < 0) {
                return NULL;
            }
        }
    }
    PyObject *out = PyTuple_New(3), *item;
    if (out == NULL) {
        return NULL;
    }
    /* (i, bitmap, closed), as Py_BuildValue("(nKl)") makes it, without parsing a format */
    if ((item = PyLong_FromSsize_t(i)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(out, 0, item);
    if ((item = PyLong_FromUnsignedLongLong(bitmap)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(out, 1, item);
    if ((item = PyLong_FromLong(closed)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(out, 2, item);
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(whole_samples_doc,
             "whole_samples(contributor_type, chunk_id, first, stop, /) -> list\n\n"
             "zephon.records.whole_samples: [(contributor_type(chunk_id, offset, 0, True),)\n"
             "for offset in range(first, stop)], each contributor and its tuple untracked by\n"
             "the cyclic collector (they hold ints only: no cycle can run through them).");

static PyObject *py_whole_samples(PyObject *Py_UNUSED(self), PyObject *args) {
    PyTypeObject *type;
    long long chunk_id, first, stop;
    if (!PyArg_ParseTuple(args, "O!LLL:whole_samples", &PyType_Type, &type, &chunk_id, &first,
                          &stop)) {
        return NULL;
    }
    if (!PyType_IsSubtype(type, &PyTuple_Type) || type->tp_itemsize != sizeof(PyObject *) ||
        type->tp_dictoffset != 0 || first < 0 || stop < first) {
        PyErr_SetString(PyExc_ValueError,
                        "whole_samples takes a tuple type without a __dict__ and 0 <= first <= stop");
        return NULL;
    }
    PyObject *out = PyList_New((Py_ssize_t)(stop - first));
    PyObject *cid = PyLong_FromLongLong(chunk_id), *zero = PyLong_FromLong(0);
    if (out == NULL || cid == NULL || zero == NULL) {
        goto fail;
    }
    for (long long k = first; k < stop; k++) {
        PyObject *c = type->tp_alloc(type, 4);
        PyObject *offset = PyLong_FromLongLong(k);
        if (c == NULL || offset == NULL) {
            Py_XDECREF(c);
            Py_XDECREF(offset);
            goto fail;
        }
        Py_INCREF(cid);
        Py_INCREF(zero);
        Py_INCREF(Py_True);
        PyTuple_SET_ITEM(c, 0, cid);
        PyTuple_SET_ITEM(c, 1, offset);
        PyTuple_SET_ITEM(c, 2, zero);
        PyTuple_SET_ITEM(c, 3, Py_True);
        PyObject_GC_UnTrack(c);
        PyObject *one = PyTuple_Pack(1, c);
        Py_DECREF(c);
        if (one == NULL) {
            goto fail;
        }
        PyObject_GC_UnTrack(one);
        PyList_SET_ITEM(out, (Py_ssize_t)(k - first), one);
    }
    Py_DECREF(cid);
    Py_DECREF(zero);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(cid);
    Py_XDECREF(zero);
    return NULL;
}

static PyMethodDef methods[] = {
    {"close_run", (PyCFunction)(void (*)(void))py_close_run, METH_FASTCALL, close_run_doc},
    {"whole_samples", py_whole_samples, METH_VARARGS, whole_samples_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._track",
    .m_doc = "ChunkTrack.add_run (zephon.tracking.tracker), zephon.records.whole_samples, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__track(void) { return PyModule_Create(&module); }
