/* zephon._state: the quick structural checks of checkpoint states (zephon/checkpoint/plain.py,
 * whose _plain and _writable are the same functions in Python).
 *
 * plain: a decoded state's, every dict key an exact str, and no non-empty dict or list nested
 * at max_depth or deeper. A leader decodes one state per rank each round, so this walk runs
 * over every rank's lanes.
 *
 * writable: a state about to be saved holds only exact checkpoint types (str keys; None,
 * bool, int in msgpack's range, float, str, bytes, list, dict) and no container at max_depth
 * or deeper. Every rank encodes its state every round.
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

/* 1: every key and value of container (an exact dict or list at depth) is writable. */
static int writable_walk(PyObject *container, int depth, int max_depth) {
    if (depth >= max_depth) {
        return 0;
    }
    PyObject *const *items;
    Py_ssize_t n, pos = 0;
    PyObject *key, *value;
    int is_dict = PyDict_CheckExact(container);
    if (!is_dict) {
        n = PyList_GET_SIZE(container);
        items = ((PyListObject *)container)->ob_item;
    }
    for (Py_ssize_t i = 0;; i++) {
        if (is_dict) {
            if (!PyDict_Next(container, &pos, &key, &value)) {
                break;
            }
            if (!PyUnicode_CheckExact(key)) {
                return 0;
            }
        } else {
            if (i >= n) {
                break;
            }
            value = items[i];
        }
        PyTypeObject *t = Py_TYPE(value);
        if (t == &PyDict_Type || t == &PyList_Type) {
            if (!writable_walk(value, depth + 1, max_depth)) {
                return 0;
            }
        } else if (t == &PyLong_Type) {
            int overflow;
            (void)PyLong_AsLongLongAndOverflow(value, &overflow);
            if (overflow < 0) {
                return 0;
            }
            if (overflow > 0) {
                (void)PyLong_AsUnsignedLongLong(value);
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    return 0;
                }
            }
        } else if (t != &PyUnicode_Type && t != &PyBytes_Type && t != &PyFloat_Type &&
                   t != &PyBool_Type && value != Py_None) {
            return 0;
        }
    }
    return 1;
}

PyDoc_STRVAR(writable_doc,
             "writable(state, max_depth, /) -> bool\n\n"
             "Whether state is an exact dict whose every key is an exact str and every value an\n"
             "exact checkpoint type (None, bool, int in [-2**63, 2**64 - 1], float, str, bytes,\n"
             "list, dict: no subclass), with no dict or list at depth max_depth or deeper\n"
             "(state itself is at depth 0): _writable in zephon/checkpoint/plain.py. max_depth\n"
             "is at most 1024.");

static PyObject *py_writable(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *state;
    int max_depth;
    if (!PyArg_ParseTuple(args, "Oi:writable", &state, &max_depth)) {
        return NULL;
    }
    if (max_depth < 0 || max_depth > 1024) {
        PyErr_Format(PyExc_ValueError, "max_depth must be in [0, 1024]; got %d", max_depth);
        return NULL;
    }
    if (!PyDict_CheckExact(state)) {
        Py_RETURN_FALSE;
    }
    return PyBool_FromLong(writable_walk(state, 0, max_depth));
}

static PyMethodDef methods[] = {
    {"plain", py_plain, METH_VARARGS, plain_doc},
    {"writable", py_writable, METH_VARARGS, writable_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_state",
    "The quick structural check of decoded checkpoint states (see zephon/checkpoint/plain.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__state(void) { return PyModule_Create(&module); }
