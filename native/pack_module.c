/* zephon._pack: the drop phase of a restore's replay by length, in C, and the count of
 * delivered pieces that closes their offsets (ChunkTrack.add_run), which a restore runs for
 * every piece it drops.
 *
 * drop_until_target(held, fill, cap, max_len, keys, components, texts, counts, target,
 *                   contributor, dropped) is the loop of TokenizeSplitPack.forward
 * (zephon/operators/fused.py) for as long as every bin pack emits is one the replay
 * filter drops: sample k (tokens counts[k], cut into pieces of at most max_len) goes piece
 * by piece, first fit, into the bins `held` (a list of lists) whose fill is `fill` (a list
 * of ints, updated in place); a bin that gets full, or the fullest bin (lowest index on
 * ties) when nothing fits, is emptied and its pieces' contributors appended to `dropped`.
 * A piece waits in its bin as the bare tuple
 *     (keys[k], child, is_last, start, stop, components[k], texts[k], counts[k]);
 * a real piece (a 4-tuple whose first item is its list of contributors) may already be
 * there. It stops right after dropping the bin whose first contributor is `target`
 * ((chunk_id, offset, child)), or after the last sample, and returns
 *     (k, child, drops, found)
 * where (k, child) is the first piece not placed yet, drops the number of bins dropped
 * that were not the target, and found the target bin's first contributor (None if it was
 * not reached). Python carries on from there: the same function, one piece at a time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_BINS 4096

/* tuple.__new__(cls, (a, b, c, d)) for a tuple subclass such as Contributor: what
 * tuple's own constructor does for a subclass, without building an argument tuple. */
static PyObject *new_contributor(PyObject *cls, PyObject *a, PyObject *b, PyObject *c,
                                 PyObject *d) {
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *out = type->tp_alloc(type, 4);
    if (out == NULL) {
        return NULL;
    }
    PyObject *items[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(out, i, items[i]);
    }
    return out;
}

static int equals_long(PyObject *obj, long want) {
    long got = PyLong_AsLong(obj);
    if (got == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return got == want;
}

/* Empties bin b into `dropped`; 1 if its first contributor is the target (then *found is
 * a new reference to it), 0 if not, -1 on error. */
static int drop_bin(PyObject *held, long *fill, Py_ssize_t b, PyObject *contributor,
                    PyObject *dropped, const long target[3], PyObject **found) {
    PyObject *pieces = PyList_GET_ITEM(held, b);
    Py_INCREF(pieces);
    PyObject *empty = PyList_New(0);
    if (empty == NULL) {
        Py_DECREF(pieces);
        return -1;
    }
    PyList_SET_ITEM(held, b, empty);
    Py_DECREF(pieces); /* the reference the list held */
    fill[b] = 0;
    Py_ssize_t first = PyList_GET_SIZE(dropped);
    Py_ssize_t n = PyList_GET_SIZE(pieces);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i);
        if (!PyTuple_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "a bin holds something other than a piece tuple");
            goto fail;
        }
        if (PyTuple_GET_SIZE(p) == 4) { /* a real piece: its contributors */
            Py_ssize_t end = PyList_GET_SIZE(dropped);
            if (PyList_SetSlice(dropped, end, end, PyTuple_GET_ITEM(p, 0)) < 0) {
                goto fail;
            }
            continue;
        }
        if (PyTuple_GET_SIZE(p) != 8 || !PyTuple_Check(PyTuple_GET_ITEM(p, 0)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(p, 0)) != 2) {
            PyErr_SetString(PyExc_TypeError, "a bare piece is not (key, child, last, ...)");
            goto fail;
        }
        PyObject *key = PyTuple_GET_ITEM(p, 0);
        PyObject *c = new_contributor(contributor, PyTuple_GET_ITEM(key, 0),
                                      PyTuple_GET_ITEM(key, 1), PyTuple_GET_ITEM(p, 1),
                                      PyTuple_GET_ITEM(p, 2));
        if (c == NULL) {
            goto fail;
        }
        int rc = PyList_Append(dropped, c);
        Py_DECREF(c);
        if (rc < 0) {
            goto fail;
        }
    }
    Py_DECREF(pieces);
    if (PyList_GET_SIZE(dropped) == first) {
        PyErr_SetString(PyExc_RuntimeError, "pack emitted an empty bin; this is a Zephon bug");
        return -1;
    }
    PyObject *c = PyList_GET_ITEM(dropped, first);
    if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) < 3) {
        PyErr_SetString(PyExc_TypeError, "a contributor is not a (chunk_id, offset, child, last)");
        return -1;
    }
    if (equals_long(PyTuple_GET_ITEM(c, 0), target[0]) &&
        equals_long(PyTuple_GET_ITEM(c, 1), target[1]) &&
        equals_long(PyTuple_GET_ITEM(c, 2), target[2])) {
        Py_INCREF(c);
        *found = c;
        return 1;
    }
    return 0;
fail:
    Py_DECREF(pieces);
    return -1;
}

static PyObject *finish(PyObject *fill_obj, const long *fill, Py_ssize_t nb, Py_ssize_t k,
                        long child, long drops, PyObject *found) {
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *v = PyLong_FromLong(fill[b]);
        if (v == NULL || PyList_SetItem(fill_obj, b, v) < 0) {
            Py_XDECREF(found);
            return NULL;
        }
    }
    if (found == NULL) {
        Py_INCREF(Py_None);
        found = Py_None;
    }
    return Py_BuildValue("(nllN)", k, child, drops, found);
}

PyDoc_STRVAR(drop_until_target_doc,
             "drop_until_target(held, fill, cap, max_len, keys, components, texts, counts,\n"
             "                  target, contributor, dropped, /) -> (k, child, drops, found)\n\n"
             "Places samples by length into pack's bins, dropping every bin it empties, until\n"
             "the bin that starts with target is dropped (see the module docstring).");

static PyObject *py_drop_until_target(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *held, *fill_obj, *keys, *comps, *texts, *counts, *contributor, *dropped;
    long cap, max_len, target[3];
    if (!PyArg_ParseTuple(args, "O!O!llO!O!O!O!(lll)OO!:drop_until_target", &PyList_Type,
                          &held, &PyList_Type, &fill_obj, &cap, &max_len, &PyList_Type, &keys,
                          &PyList_Type, &comps, &PyList_Type, &texts, &PyList_Type, &counts,
                          &target[0], &target[1], &target[2], &contributor, &PyList_Type,
                          &dropped)) {
        return NULL;
    }
    Py_ssize_t nb = PyList_GET_SIZE(held), n_docs = PyList_GET_SIZE(counts);
    if (nb < 1 || nb > MAX_BINS || PyList_GET_SIZE(fill_obj) != nb) {
        PyErr_Format(PyExc_ValueError, "held and fill must list the same 1..%d bins", MAX_BINS);
        return NULL;
    }
    if (PyList_GET_SIZE(keys) != n_docs || PyList_GET_SIZE(comps) != n_docs ||
        PyList_GET_SIZE(texts) != n_docs) {
        PyErr_SetString(PyExc_ValueError, "keys, components, texts and counts differ in length");
        return NULL;
    }
    if (max_len < 1 || cap < max_len) {
        PyErr_Format(PyExc_ValueError, "need 1 <= max_len <= cap; got max_len=%ld cap=%ld",
                     max_len, cap);
        return NULL;
    }
    if (!PyType_Check(contributor) || !PyType_IsSubtype((PyTypeObject *)contributor,
                                                        &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "contributor must be a tuple subclass");
        return NULL;
    }
    long fill[MAX_BINS];
    for (Py_ssize_t b = 0; b < nb; b++) {
        fill[b] = PyLong_AsLong(PyList_GET_ITEM(fill_obj, b));
        if (fill[b] == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (!PyList_Check(PyList_GET_ITEM(held, b))) {
            PyErr_SetString(PyExc_TypeError, "held must be a list of lists");
            return NULL;
        }
    }
    long drops = 0;
    PyObject *found = NULL;
    for (Py_ssize_t k = 0; k < n_docs; k++) {
        PyObject *n_obj = PyList_GET_ITEM(counts, k);
        long n = PyLong_AsLong(n_obj);
        if (n == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "a token count is negative (%ld)", n);
            return NULL;
        }
        long last = n <= max_len ? 0 : (n - 1) / max_len;
        for (long child = 0; child <= last; child++) {
            long start = child * max_len, stop = child == last ? n : start + max_len;
            long room = cap - (stop - start);
            Py_ssize_t b = 0;
            while (b < nb && fill[b] > room) {
                b++;
            }
            if (b == nb) { /* nothing fits: the fullest goes, lowest index on ties */
                b = 0;
                for (Py_ssize_t i = 1; i < nb; i++) {
                    if (fill[i] > fill[b]) {
                        b = i;
                    }
                }
                int rc = drop_bin(held, fill, b, contributor, dropped, target, &found);
                if (rc < 0) {
                    return NULL;
                }
                if (rc == 1) {
                    return finish(fill_obj, fill, nb, k, child, drops, found);
                }
                drops++;
            }
            PyObject *child_obj = PyLong_FromLong(child);
            PyObject *start_obj = PyLong_FromLong(start);
            PyObject *stop_obj = PyLong_FromLong(stop);
            PyObject *piece = NULL;
            if (child_obj != NULL && start_obj != NULL && stop_obj != NULL) {
                piece = PyTuple_Pack(8, PyList_GET_ITEM(keys, k), child_obj,
                                     child == last ? Py_True : Py_False, start_obj, stop_obj,
                                     PyList_GET_ITEM(comps, k), PyList_GET_ITEM(texts, k),
                                     n_obj);
            }
            Py_XDECREF(child_obj);
            Py_XDECREF(start_obj);
            Py_XDECREF(stop_obj);
            if (piece == NULL) {
                return NULL;
            }
            int rc = PyList_Append(PyList_GET_ITEM(held, b), piece);
            Py_DECREF(piece);
            if (rc < 0) {
                return NULL;
            }
            fill[b] += stop - start;
            if (fill[b] == cap) {
                rc = drop_bin(held, fill, b, contributor, dropped, target, &found);
                if (rc < 0) {
                    return NULL;
                }
                if (rc == 1) {
                    return child == last ? finish(fill_obj, fill, nb, k + 1, 0, drops, found)
                                         : finish(fill_obj, fill, nb, k, child + 1, drops, found);
                }
                drops++;
            }
        }
    }
    return finish(fill_obj, fill, nb, n_docs, 0, drops, NULL);
}

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
    {"drop_until_target", py_drop_until_target, METH_VARARGS, drop_until_target_doc},
    {"close_run", py_close_run, METH_VARARGS, close_run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "zephon._pack",
    "The drop phase of a restore's replay by length (see native/pack_module.c).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__pack(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_BINS", MAX_BINS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
