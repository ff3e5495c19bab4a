/* Bins: histogram observations counted as a Prometheus histogram counts them (a value goes to the first bucket
 * whose upper bound is not below it; the last bucket is +Inf), to be added to one once per request. */
#include "relay.h"

int
bins_init(Bins *bins, PyObject *bounds)
{
    PyObject *sequence = PySequence_Fast(bounds, "gap_bounds must be a sequence of floats");
    if (sequence == NULL)
        return -1;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence);
    double *values = PyMem_Calloc(size + 1, sizeof(double));
    int64_t *counts = PyMem_Calloc(size + 1, sizeof(int64_t));
    if (values == NULL || counts == NULL) {
        PyMem_Free(values);
        PyMem_Free(counts);
        Py_DECREF(sequence);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        values[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(sequence, i));
        if ((values[i] == -1.0 && PyErr_Occurred()) || values[i] != values[i] || (i > 0 && !(values[i] > values[i - 1]))) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "gap_bounds must increase");
            PyMem_Free(values);
            PyMem_Free(counts);
            Py_DECREF(sequence);
            return -1;
        }
    }
    Py_DECREF(sequence);
    PyMem_Free(bins->bounds);
    PyMem_Free(bins->counts);
    bins->bounds = values;
    bins->counts = counts;
    bins->size = size;
    bins->sum = 0.0;
    return 0;
}

void
bins_add(Bins *bins, double value, int64_t weight)
{
    Py_ssize_t low = 0, high = bins->size;
    while (low < high) {
        Py_ssize_t middle = (low + high) / 2;
        if (bins->bounds[middle] < value)
            low = middle + 1;
        else
            high = middle;
    }
    bins->counts[low] += weight;
    bins->sum += value * (double)weight;
}

/* (counts per bucket, then +Inf; sum); bins never initialised count nothing in their one bucket, +Inf. */
PyObject *
bins_result(const Bins *bins)
{
    PyObject *counts = PyTuple_New(bins->size + 1);
    if (counts == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i <= bins->size; i++) {
        PyObject *count = PyLong_FromLongLong(bins->counts != NULL ? bins->counts[i] : 0);
        if (count == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyTuple_SET_ITEM(counts, i, count);
    }
    return Py_BuildValue("(Nd)", counts, bins->sum);
}

void
bins_free(Bins *bins)
{
    PyMem_Free(bins->bounds);
    PyMem_Free(bins->counts);
    bins->bounds = NULL;
    bins->counts = NULL;
    bins->size = 0;
}
