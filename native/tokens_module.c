/* zephon._tokens: documents copied out of a token file, in C (zephon/sources/token_file.py
 * does the same with numpy where this module is not built).
 *
 * gather_into(src, itemsize, los, his, outs) copies tokens los[k]:his[k] of src (a buffer
 * of little-endian unsigned tokens of itemsize bytes, 2 or 4: the token file as mapped)
 * into outs[k] (a writable, contiguous int32 buffer of exactly his[k] - los[k] items), each
 * token converted as numpy's astype(int32) converts it. One call for a read's documents,
 * with the GIL released while it copies, instead of a numpy conversion per document.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

PyDoc_STRVAR(gather_into_doc,
             "gather_into(src, itemsize, los, his, outs, /) -> None\n\n"
             "Copies tokens los[k]:his[k] of src (a buffer of unsigned tokens of itemsize\n"
             "bytes, 2 or 4) into outs[k] (a writable contiguous int32 buffer of his[k] - los[k]\n"
             "items), as astype(int32) converts them. los and his are lists of ints, outs a list\n"
             "of buffers, all of one length; every span must lie inside src.");

static PyObject *py_gather_into(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *src_obj, *los, *his, *outs;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "OnO!O!O!:gather_into", &src_obj, &itemsize, &PyList_Type, &los,
                          &PyList_Type, &his, &PyList_Type, &outs)) {
        return NULL;
    }
    if (itemsize != 2 && itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 2 or 4; got %zd", itemsize);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(outs);
    if (PyList_GET_SIZE(los) != n || PyList_GET_SIZE(his) != n) {
        PyErr_SetString(PyExc_ValueError, "los, his and outs must be of one length");
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t tokens = src.len / itemsize;
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    Py_ssize_t *starts = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_ssize_t));
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (views == NULL || starts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++, held++) {
        Py_ssize_t lo = PyLong_AsSsize_t(PyList_GET_ITEM(los, k));
        Py_ssize_t hi = PyLong_AsSsize_t(PyList_GET_ITEM(his, k));
        if ((lo == -1 || hi == -1) && PyErr_Occurred()) {
            goto done;
        }
        if (lo < 0 || hi < lo || hi > tokens) {
            PyErr_Format(PyExc_ValueError, "span %zd (%zd:%zd) is not inside the %zd tokens", k,
                         lo, hi, tokens);
            goto done;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(outs, k), &views[k],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        if (views[k].itemsize != 4 || views[k].len != (hi - lo) * 4) {
            PyErr_Format(PyExc_ValueError, "outs[%zd] must be int32 of %zd items", k, hi - lo);
            held++;  /* release this one too */
            goto done;
        }
        starts[k] = lo;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t *dst = views[k].buf;
        Py_ssize_t m = views[k].len / 4;
        if (itemsize == 2) {
            const uint16_t *from = (const uint16_t *)src.buf + starts[k];
            for (Py_ssize_t i = 0; i < m; i++) {
                dst[i] = (int32_t)from[i];
            }
        } else {
            const uint32_t *from = (const uint32_t *)src.buf + starts[k];
            for (Py_ssize_t i = 0; i < m; i++) {
                dst[i] = (int32_t)from[i];  /* wraps past 2**31 - 1, as astype does */
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (views != NULL) {
        for (Py_ssize_t k = 0; k < held; k++) {
            PyBuffer_Release(&views[k]);
        }
    }
    PyMem_Free(views);
    PyMem_Free(starts);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_into", py_gather_into, METH_VARARGS, gather_into_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._tokens",
    .m_doc = "Documents copied out of a token file (zephon.sources.token_file), in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&module); }
