/* HTTP/1.1 chunk framing of what the relay writes to a client. */
#include "relay.h"

#include <string.h>

const char LAST_CHUNK[] = "0\r\n\r\n";
_Static_assert(sizeof(LAST_CHUNK) - 1 == LAST_CHUNK_LENGTH, "LAST_CHUNK_LENGTH");

/* One chunk of body, followed by the last chunk (which ends the body) if `last`. */
PyObject *
frame_chunk(const char *body, Py_ssize_t length, int last)
{
    char size[24];
    int size_length = 0;
    for (size_t rest = (size_t)length; size_length == 0 || rest; rest >>= 4)
        size[size_length++] = "0123456789abcdef"[rest & 15];
    for (int i = 0; i < size_length / 2; i++) { /* the digits came out least significant first */
        char digit = size[i];
        size[i] = size[size_length - 1 - i];
        size[size_length - 1 - i] = digit;
    }
    size[size_length++] = '\r';
    size[size_length++] = '\n';
    PyObject *out = PyBytes_FromStringAndSize(NULL, size_length + length + 2 + (last ? LAST_CHUNK_LENGTH : 0));
    if (out == NULL)
        return NULL;
    char *w = PyBytes_AS_STRING(out);
    memcpy(w, size, size_length);
    memcpy(w + size_length, body, length);
    memcpy(w + size_length + length, "\r\n", 2);
    if (last)
        memcpy(w + size_length + length + 2, LAST_CHUNK, LAST_CHUNK_LENGTH);
    return out;
}

PyObject *
relay_frame(PyObject *module, PyObject *body)
{
    if (!PyBytes_Check(body)) {
        PyErr_SetString(PyExc_TypeError, "frame() takes bytes");
        return NULL;
    }
    if (PyBytes_GET_SIZE(body) == 0) {
        PyErr_SetString(PyExc_ValueError, "frame(b\"\") would be the last chunk, which ends the body");
        return NULL;
    }
    return frame_chunk(PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body), 0);
}
