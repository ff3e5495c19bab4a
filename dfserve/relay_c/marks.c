/* Token marks: JSON keys found in the bytes, without decoding (JSON escapes quotes inside strings, so a key's
 * quoted name followed by a colon only occurs as a key). Which keys, and what they mean, is `dfserve.sglang`'s. */
#define _GNU_SOURCE /* memmem */
#include "relay.h"

#include <string.h>

int
check_keys(PyObject *keys)
{
    if (!PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) == 0) {
        PyErr_SetString(PyExc_TypeError, "keys must be a non-empty tuple of bytes");
        return -1;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) == 0) {
            PyErr_SetString(PyExc_TypeError, "keys must be a non-empty tuple of bytes");
            return -1;
        }
    }
    return 0;
}

static Py_ssize_t
skip_space(const char *buf, Py_ssize_t i, Py_ssize_t length)
{
    while (i < length && (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\r' || buf[i] == '\n'))
        i++;
    return i;
}

/* cumulative: the integer after the last key that has one (-1 if none); else: how many keys have a non-empty
 * string as their value. */
int64_t
read_marks(const char *buf, Py_ssize_t length, PyObject *keys, int cumulative)
{
    int64_t found = cumulative ? -1 : 0;
    Py_ssize_t last_at = -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        const char *needle = PyBytes_AS_STRING(key);
        Py_ssize_t needle_length = PyBytes_GET_SIZE(key);
        const char *at = buf, *hit;
        while ((hit = memmem(at, buf + length - at, needle, needle_length)) != NULL) {
            Py_ssize_t key_at = hit - buf, i = skip_space(buf, key_at + needle_length, length);
            at = hit + needle_length;
            if (!cumulative) {
                found += i + 1 < length && buf[i] == '"' && buf[i + 1] != '"';
                continue;
            }
            if (i >= length || buf[i] < '0' || buf[i] > '9' || key_at < last_at)
                continue;
            int64_t value = 0;
            for (; i < length && buf[i] >= '0' && buf[i] <= '9' && value < (INT64_MAX - 9) / 10; i++)
                value = value * 10 + (buf[i] - '0');
            if (i < length && buf[i] >= '0' && buf[i] <= '9')
                continue; /* beyond int64: not a count */
            found = value;
            last_at = key_at;
        }
    }
    return found;
}

int
contains_key(const char *buf, Py_ssize_t length, PyObject *keys)
{
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        if (memmem(buf, length, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) != NULL)
            return 1;
    }
    return 0;
}

PyObject *
relay_read_marks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0]) || check_keys(args[1]) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "read_marks(events: bytes, keys: tuple[bytes, ...], cumulative)");
        return NULL;
    }
    int cumulative = PyObject_IsTrue(args[2]);
    if (cumulative < 0)
        return NULL;
    int64_t found = read_marks(PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), args[1], cumulative);
    if (found < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(found);
}
