/* zephon._track: the count of delivered pieces that closes their offsets
 * (ChunkTrack.add_run in zephon/tracking.py, which is the same function in Python), for
 * chunks of at most 64 offsets; a restore runs it for every piece it drops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyDoc_STRVAR(close_run_doc,
             "close_run(delivered, total, bitmap, chunk_id, pieces, i, /) -> (i, bitmap, closed)\n\n"
             "ChunkTrack.add_run (zephon/tracking.py) for a chunk of at most 64 offsets:\n"
             "counts pieces[i], pieces[i+1], ... (contributors) while they are of chunk_id,\n"
             "updating the lists delivered and total in place; returns the index of the first\n"
             "piece not counted, the new bitmap of closed offsets and how many it closed.");

static PyObject *py_close_run(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *delivered, *total, *pieces;
    unsigned long long bitmap;
    long chunk_id;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "O!O!KlO!n:close_run", &PyList_Type, &delivered, &PyList_Type,
                          &total, &bitmap, &chunk_id, &PyList_Type, &pieces, &i)) {
        return NULL;
    }
    Py_ssize_t size = PyList_GET_SIZE(delivered), n = PyList_GET_SIZE(pieces);
    if (size > 64 || PyList_GET_SIZE(total) != size || i < 0) {
        PyErr_SetString(PyExc_ValueError, "close_run takes at most 64 offsets and i >= 0");
        return NULL;
    }
    long closed = 0;
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
        }
        unsigned long long bit = 1ULL << offset;
        if (got == want && !(bitmap & bit)) {
            bitmap |= bit;
            closed++;
        }
    }
    return Py_BuildValue("(nKl)", i, bitmap, closed);
}

static PyMethodDef methods[] = {
    {"close_run", py_close_run, METH_VARARGS, close_run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._track",
    .m_doc = "ChunkTrack.add_run of zephon.tracking, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__track(void) { return PyModule_Create(&module); }
