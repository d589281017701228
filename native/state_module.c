/* zephon._state: the quick structural check of a decoded checkpoint state
 * (zephon/checkpoint/plain.py, _plain, which is the same function in Python): every dict key
 * an exact str, and no non-empty dict or list nested at max_depth or deeper. A leader
 * decodes one state per rank each round, so this walk runs over every rank's lanes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* 1: plain; 0: not. Only exact dicts and lists are containers, as in the Python version. */
static int walk(PyObject *value, int depth, int max_depth) {
    if (PyDict_CheckExact(value)) {
        if (depth >= max_depth) {
            return PyDict_GET_SIZE(value) == 0;
        }
        Py_ssize_t pos = 0;
        PyObject *key, *child;
        while (PyDict_Next(value, &pos, &key, &child)) {
            if (!PyUnicode_CheckExact(key)) {
                return 0;
            }
            if ((PyDict_CheckExact(child) || PyList_CheckExact(child)) &&
                !walk(child, depth + 1, max_depth)) {
                return 0;
            }
        }
        return 1;
    }
    /* an exact list */
    Py_ssize_t n = PyList_GET_SIZE(value);
    if (depth >= max_depth) {
        return n == 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *child = PyList_GET_ITEM(value, i);
        if ((PyDict_CheckExact(child) || PyList_CheckExact(child)) &&
            !walk(child, depth + 1, max_depth)) {
            return 0;
        }
    }
    return 1;
}

PyDoc_STRVAR(plain_doc,
             "plain(state, max_depth, /) -> bool\n\n"
             "Whether every key of every dict in state (a dict) is a str and no non-empty dict\n"
             "or list lies at depth max_depth or deeper (state itself is at depth 0): _plain\n"
             "in zephon/checkpoint/plain.py. max_depth is at most 1024.");

static PyObject *py_plain(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *state;
    int max_depth;
    if (!PyArg_ParseTuple(args, "O!i:plain", &PyDict_Type, &state, &max_depth)) {
        return NULL;
    }
    if (max_depth < 0 || max_depth > 1024) {
        PyErr_Format(PyExc_ValueError, "max_depth must be in [0, 1024]; got %d", max_depth);
        return NULL;
    }
    if (!PyDict_CheckExact(state)) {
        Py_RETURN_FALSE; /* a dict subclass is not a decoded state */
    }
    return PyBool_FromLong(walk(state, 0, max_depth));
}

static PyMethodDef methods[] = {
    {"plain", py_plain, METH_VARARGS, plain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_state",
    "The quick structural check of decoded checkpoint states (see zephon/checkpoint/plain.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__state(void) { return PyModule_Create(&module); }
