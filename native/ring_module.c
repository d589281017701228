/* zephon._ring: the CPython binding of the native ring (ring.h).
 *
 * Every function takes the ring's memory as any writable, contiguous object
 * supporting the buffer protocol (the Python layer passes a numpy uint8 array
 * over an mmap) and returns ring status codes as plain ints: the Python layer
 * (zephon/shm/ring.py) maps them to exceptions in one place, for this core and
 * for the pure-Python one alike. This file only raises for misuse of the call
 * itself (wrong types, read-only buffer, out-of-range integers) or a pending
 * signal. Before touching the memory each call validates the header against
 * the buffer length, so no call can read or write outside the buffer.
 *
 * Blocking calls release the GIL and wait in slices of WAIT_SLICE_NS so that
 * Ctrl-C (PyErr_CheckSignals) interrupts an infinite wait.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <time.h>

#include "ring.h"

#define WAIT_SLICE_NS INT64_C(100000000) /* 100 ms */

/* Gets a writable buffer; when `validate`, checks it holds a valid ring.
 * Returns -1 with a Python error set, else the ring status (RING_OK or a
 * header problem, in which case the buffer is already released). */
static int get_ring(PyObject *obj, Py_buffer *view, int validate) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) != 0) {
        return -1;
    }
    if (!validate) {
        return RING_OK;
    }
    ring_status st = ring_attach(view->buf, (size_t)view->len, NULL);
    if (st != RING_OK) {
        PyBuffer_Release(view);
    }
    return (int)st;
}

static int to_slot(long long value, uint32_t *out) {
    if (value < 0 || value > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "slot index must be in [0, 2**32); got %lld", value);
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef enum { OP_RESERVE, OP_ACQUIRE } wait_op;

/* Runs a blocking op without the GIL, slice by slice, checking for signals
 * between slices. Returns -1 with an exception set when a signal handler
 * raised, else the final ring status. */
static int blocking_call(wait_op op, void *base, int64_t timeout_ns, uint32_t *slot,
                         uint64_t *nbytes) {
    int64_t deadline = timeout_ns > 0 ? monotonic_ns() + timeout_ns : 0;
    for (;;) {
        int64_t slice = timeout_ns;
        if (timeout_ns < 0 || timeout_ns > WAIT_SLICE_NS) {
            slice = WAIT_SLICE_NS;
        }
        if (timeout_ns > 0) {
            int64_t left = deadline - monotonic_ns();
            slice = left < slice ? (left > 0 ? left : 0) : slice;
        }
        ring_status st;
        Py_BEGIN_ALLOW_THREADS;
        if (op == OP_RESERVE) {
            st = ring_reserve(base, slice, slot);
        } else {
            st = ring_acquire(base, slice, slot, nbytes);
        }
        Py_END_ALLOW_THREADS;
        if (st != RING_TIMEOUT || timeout_ns == 0) {
            return (int)st;
        }
        if (timeout_ns > 0 && monotonic_ns() >= deadline) {
            return (int)st;
        }
        if (PyErr_CheckSignals() != 0) {
            return -1;
        }
    }
}

PyDoc_STRVAR(required_size_doc,
             "required_size(nslots, slot_bytes, /) -> int\n\n"
             "Bytes a ring of this geometry needs; 0 when the geometry is invalid.");

static PyObject *py_required_size(PyObject *Py_UNUSED(self), PyObject *args) {
    long long nslots, slot_bytes;
    if (!PyArg_ParseTuple(args, "LL:required_size", &nslots, &slot_bytes)) {
        return NULL;
    }
    if (nslots <= 0 || nslots > (long long)UINT32_MAX || slot_bytes <= 0) {
        return PyLong_FromLong(0);
    }
    return PyLong_FromUnsignedLongLong(ring_required_size((uint32_t)nslots, (uint64_t)slot_bytes));
}

PyDoc_STRVAR(init_doc, "init(buf, nslots, slot_bytes, /) -> status\n\nFormats a ring over buf.");

static PyObject *py_init(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    long long nslots, slot_bytes;
    if (!PyArg_ParseTuple(args, "OLL:init", &obj, &nslots, &slot_bytes)) {
        return NULL;
    }
    if (nslots <= 0 || nslots > (long long)UINT32_MAX || slot_bytes <= 0) {
        return PyLong_FromLong(RING_BAD_SIZE);
    }
    Py_buffer view;
    if (get_ring(obj, &view, 0) < 0) {
        return NULL;
    }
    ring_status st = ring_init(view.buf, (size_t)view.len, (uint32_t)nslots, (uint64_t)slot_bytes);
    PyBuffer_Release(&view);
    return PyLong_FromLong(st);
}

PyDoc_STRVAR(attach_doc, "attach(buf, /) -> (status, nslots, slot_bytes, slots_offset)\n\n"
                         "Validates the ring header in buf.");

static PyObject *py_attach(PyObject *Py_UNUSED(self), PyObject *obj) {
    Py_buffer view;
    if (get_ring(obj, &view, 0) < 0) {
        return NULL;
    }
    ring_info info = {0, 0, 0, 0};
    ring_status st = ring_attach(view.buf, (size_t)view.len, &info);
    PyBuffer_Release(&view);
    return Py_BuildValue("(iIKK)", (int)st, info.nslots, (unsigned long long)info.slot_bytes,
                         (unsigned long long)info.slots_offset);
}

PyDoc_STRVAR(reserve_doc, "reserve(buf, timeout_ns, /) -> (status, slot)\n\n"
                          "Producer: waits for a free slot (timeout_ns < 0: forever).");

static PyObject *py_reserve(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OL:reserve", &obj, &timeout_ns)) {
        return NULL;
    }
    Py_buffer view;
    int st = get_ring(obj, &view, 1);
    if (st < 0) {
        return NULL;
    }
    uint32_t slot = 0;
    if (st == RING_OK) {
        st = blocking_call(OP_RESERVE, view.buf, timeout_ns, &slot, NULL);
        PyBuffer_Release(&view);
        if (st < 0) {
            return NULL;
        }
    }
    return Py_BuildValue("(iI)", st, slot);
}

PyDoc_STRVAR(commit_doc, "commit(buf, slot, nbytes, /) -> status\n\n"
                         "Producer: publishes a reserved slot holding nbytes.");

static PyObject *py_commit(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    long long slot_arg, nbytes;
    uint32_t slot;
    if (!PyArg_ParseTuple(args, "OLL:commit", &obj, &slot_arg, &nbytes) ||
        to_slot(slot_arg, &slot) < 0) {
        return NULL;
    }
    if (nbytes < 0) {
        return PyLong_FromLong(RING_BAD_SIZE);
    }
    Py_buffer view;
    int st = get_ring(obj, &view, 1);
    if (st < 0) {
        return NULL;
    }
    if (st == RING_OK) {
        st = (int)ring_commit(view.buf, slot, (uint64_t)nbytes);
        PyBuffer_Release(&view);
    }
    return PyLong_FromLong(st);
}

PyDoc_STRVAR(acquire_doc, "acquire(buf, timeout_ns, /) -> (status, slot, nbytes)\n\n"
                          "Consumer: waits for the next message (timeout_ns < 0: forever).");

static PyObject *py_acquire(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OL:acquire", &obj, &timeout_ns)) {
        return NULL;
    }
    Py_buffer view;
    int st = get_ring(obj, &view, 1);
    if (st < 0) {
        return NULL;
    }
    uint32_t slot = 0;
    uint64_t nbytes = 0;
    if (st == RING_OK) {
        st = blocking_call(OP_ACQUIRE, view.buf, timeout_ns, &slot, &nbytes);
        PyBuffer_Release(&view);
        if (st < 0) {
            return NULL;
        }
    }
    return Py_BuildValue("(iIK)", st, slot, (unsigned long long)nbytes);
}

PyDoc_STRVAR(release_doc, "release(buf, slot, /) -> status\n\n"
                          "Consumer: hands an acquired slot back to the producer.");

static PyObject *py_release(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    long long slot_arg;
    uint32_t slot;
    if (!PyArg_ParseTuple(args, "OL:release", &obj, &slot_arg) || to_slot(slot_arg, &slot) < 0) {
        return NULL;
    }
    Py_buffer view;
    int st = get_ring(obj, &view, 1);
    if (st < 0) {
        return NULL;
    }
    if (st == RING_OK) {
        st = (int)ring_release(view.buf, slot);
        PyBuffer_Release(&view);
    }
    return PyLong_FromLong(st);
}

PyDoc_STRVAR(close_doc, "close(buf, /) -> status\n\n"
                        "Marks the ring closed and wakes both sides. Idempotent.");

static PyObject *py_close(PyObject *Py_UNUSED(self), PyObject *obj) {
    Py_buffer view;
    int st = get_ring(obj, &view, 1);
    if (st < 0) {
        return NULL;
    }
    if (st == RING_OK) {
        st = (int)ring_close(view.buf);
        PyBuffer_Release(&view);
    }
    return PyLong_FromLong(st);
}

PyDoc_STRVAR(is_closed_doc, "is_closed(buf, /) -> bool\n\n"
                            "Whether either side closed the ring (True for an invalid header).");

static PyObject *py_is_closed(PyObject *Py_UNUSED(self), PyObject *obj) {
    Py_buffer view;
    int st = get_ring(obj, &view, 1);
    if (st < 0) {
        return NULL;
    }
    if (st != RING_OK) {
        Py_RETURN_TRUE;
    }
    int closed = ring_is_closed(view.buf);
    PyBuffer_Release(&view);
    return PyBool_FromLong(closed);
}

static PyMethodDef ring_methods[] = {
    {"required_size", py_required_size, METH_VARARGS, required_size_doc},
    {"init", py_init, METH_VARARGS, init_doc},
    {"attach", py_attach, METH_O, attach_doc},
    {"reserve", py_reserve, METH_VARARGS, reserve_doc},
    {"commit", py_commit, METH_VARARGS, commit_doc},
    {"acquire", py_acquire, METH_VARARGS, acquire_doc},
    {"release", py_release, METH_VARARGS, release_doc},
    {"close", py_close, METH_O, close_doc},
    {"is_closed", py_is_closed, METH_O, is_closed_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon._ring",
    .m_doc = "Native core of Zephon's SPSC shared-memory ring (see native/ring.h).",
    .m_size = 0,
    .m_methods = ring_methods,
};

PyMODINIT_FUNC PyInit__ring(void) {
    PyObject *m = PyModule_Create(&ring_module);
    if (m == NULL) {
        return NULL;
    }
    struct {
        const char *name;
        long value;
    } constants[] = {
        {"OK", RING_OK},
        {"TIMEOUT", RING_TIMEOUT},
        {"CLOSED", RING_CLOSED},
        {"BAD_MAGIC", RING_BAD_MAGIC},
        {"BAD_VERSION", RING_BAD_VERSION},
        {"BAD_SIZE", RING_BAD_SIZE},
        {"BAD_SLOT", RING_BAD_SLOT},
        {"BAD_ALIGN", RING_BAD_ALIGN},
        {"SYSTEM", RING_SYSTEM},
        {"MAGIC", (long)RING_MAGIC}, /* < 2**63: fits a 64-bit long */
        {"LAYOUT_VERSION", RING_LAYOUT_VERSION},
        {"SLOT_ALIGN", RING_SLOT_ALIGN},
        {"PAYLOAD_PHASE", RING_PAYLOAD_PHASE},
        {"HEADER_FIXED_BYTES", RING_HEADER_FIXED_BYTES},
        {"SLOT_META_BYTES", RING_SLOT_META_BYTES},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++) {
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
