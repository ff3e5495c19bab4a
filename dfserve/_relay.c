/* The per-read work of a streamed response, in C: HTTP/1.1 de-chunking (`Dechunker`) and relaying whole
 * server-sent events to the client (`EventRelay`).
 *
 * Why C: a relayed chunk costs a proxy one socket read and one write, and whatever it runs between them. In
 * Python that work (de-chunk, cut at event boundaries, re-frame, time-stamp, count tokens) cost the gateway more
 * CPU per chunk than the whole of sglang-router's, with the syscalls being the same (bench/RESULTS.md). Here the
 * de-chunker is the upstream transport's protocol for the length of a body, so the event loop hands each read
 * straight to C; the relay writes the whole events to the client's transport, then notes the piece's arrival time
 * and the tokens it carried, found by JSON keys that `dfserve.sglang` names (`TokenMarks`), so the SGLang format
 * is still known in one place. Python sees the stream again when it ends (`gateway.relay.meter`).
 */
#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LINE_LIMIT 4096 /* a chunk-size line, or a trailer line */

static PyObject *BadChunk;
static PyObject *str_received, *name_body_done, *name_body_failed, *name_eof_received, *name_connection_lost,
    *name_pause_writing, *name_resume_writing;

/* ------------------------------------------------------------------------------------------------------------ */
/* frame: one HTTP/1.1 chunk                                                                                    */

static const char LAST_CHUNK[] = "0\r\n\r\n";
#define LAST_CHUNK_LENGTH ((Py_ssize_t)sizeof(LAST_CHUNK) - 1)

/* One chunk of body, followed by the last chunk (which ends the body) if `last`. */
static PyObject *
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

static PyObject *
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

/* ------------------------------------------------------------------------------------------------------------ */
/* Token marks: JSON keys found in the bytes, without decoding (JSON escapes quotes inside strings, so a key's
 * quoted name followed by a colon only occurs as a key). Which keys, and what they mean, is `dfserve.sglang`'s. */

static int
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
static int64_t
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

static PyObject *
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

/* ------------------------------------------------------------------------------------------------------------ */
/* Bins: histogram observations counted as a Prometheus histogram counts them (a value goes to the first bucket
 * whose upper bound is not below it; the last bucket is +Inf), to be added to one once per request.           */

typedef struct {
    double *bounds;
    int64_t *counts; /* one more than bounds: +Inf */
    Py_ssize_t size;
    double sum;
} Bins;

static int
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

static void
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

static PyObject *
bins_result(Bins *bins)
{
    PyObject *counts = PyTuple_New(bins->size + 1);
    if (counts == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i <= bins->size; i++) {
        PyObject *count = PyLong_FromLongLong(bins->counts[i]);
        if (count == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyTuple_SET_ITEM(counts, i, count);
    }
    return Py_BuildValue("(Nd)", counts, bins->sum);
}

static void
bins_free(Bins *bins)
{
    PyMem_Free(bins->bounds);
    PyMem_Free(bins->counts);
    bins->bounds = NULL;
    bins->counts = NULL;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* EventRelay                                                                                                   */

typedef struct {
    PyObject_HEAD
    PyObject *write;    /* writes bytes to the client's socket, or None: nothing is sent (HEAD, a shadow) */
    int chunked;        /* frame what is written as HTTP chunks */
    PyObject *keys;     /* token marks (see read_marks) */
    int cumulative;
    char *held;         /* bytes after the last whole event, kept until their event is complete */
    Py_ssize_t held_length, held_capacity;
    PyObject *tail[2];  /* the last two pieces of whole events relayed, oldest first */
    int64_t tokens;     /* cumulative: the running total seen so far (-1: none); else: marks counted */
    double first;       /* arrival time of the first piece that carried tokens (-1: none yet) */
    double previous;    /* and of the latest */
    Bins chunk_gaps;    /* gaps between pieces that carried tokens */
    Bins token_gaps;    /* the same gaps per token, one per token (cumulative marks: exact token counts) */
    int closed;
    int last_chunk_written; /* the body's end went out with its last events */
} EventRelay;

static PyTypeObject EventRelayType;

/* Length of the longest prefix of buf that ends with a blank line ("\n\n" or "\n\r\n"), looking only at
 * lines that end at or after `from`; 0 if none. */
static Py_ssize_t
event_boundary(const char *buf, Py_ssize_t length, Py_ssize_t from)
{
    for (Py_ssize_t i = length - 1; i >= Py_MAX(from, 1); i--) {
        if (buf[i] != '\n')
            continue;
        if (buf[i - 1] == '\n' || (i >= 2 && buf[i - 1] == '\r' && buf[i - 2] == '\n'))
            return i + 1;
    }
    return 0;
}

static int
relay_meter(EventRelay *self, PyObject *now, PyObject *events)
{
    int64_t found = read_marks(PyBytes_AS_STRING(events), PyBytes_GET_SIZE(events), self->keys, self->cumulative);
    int64_t produced = found;
    if (self->cumulative) {
        produced = found > self->tokens ? found - Py_MAX(self->tokens, 0) : 0;
        self->tokens = Py_MAX(self->tokens, found);
    }
    else
        self->tokens += found;
    if (produced <= 0)
        return 0;
    double arrival = PyFloat_AsDouble(now);
    if (arrival == -1.0 && PyErr_Occurred())
        return -1;
    if (self->first < 0)
        self->first = arrival;
    else {
        double gap = arrival - self->previous;
        bins_add(&self->chunk_gaps, gap, 1);
        if (self->cumulative)
            bins_add(&self->token_gaps, gap / (double)produced, produced);
    }
    self->previous = arrival;
    return 0;
}

static int
hold(EventRelay *self, const char *data, Py_ssize_t length)
{
    if (self->held_length + length > self->held_capacity) {
        Py_ssize_t capacity = Py_MAX(self->held_capacity * 2, self->held_length + length);
        char *held = PyMem_Realloc(self->held, capacity);
        if (held == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->held = held;
        self->held_capacity = capacity;
    }
    memcpy(self->held + self->held_length, data, length);
    self->held_length += length;
    return 0;
}

/* The relay's whole job for one piece of body: whole events go to the client, then are metered. `last`: the
 * upstream body ends with this piece; when it leaves nothing held, the client's body is ended in the same write
 * (one system call fewer per request). */
static int
relay_receive(EventRelay *self, PyObject *now, PyObject *payload, int last)
{
    if (self->closed)
        return 0;
    const char *data = PyBytes_AS_STRING(payload);
    Py_ssize_t length = PyBytes_GET_SIZE(payload);
    PyObject *events;
    if (self->held_length == 0 && length >= 2 && data[length - 1] == '\n' && data[length - 2] == '\n') {
        events = PyBytes_CheckExact(payload) ? Py_NewRef(payload) /* the usual read: whole events, nothing held */
                                             : PyBytes_FromStringAndSize(data, length);
        if (events == NULL)
            return -1;
    }
    else {
        Py_ssize_t before = self->held_length;
        if (hold(self, data, length) < 0)
            return -1;
        /* what was held had no boundary, so a boundary's last newline can only be a new byte */
        Py_ssize_t cut = event_boundary(self->held, self->held_length, before);
        if (cut == 0)
            return 0;
        events = PyBytes_FromStringAndSize(self->held, cut);
        if (events == NULL)
            return -1;
        memmove(self->held, self->held + cut, self->held_length - cut);
        self->held_length -= cut;
    }
    if (self->write != Py_None) {
        PyObject *write = Py_NewRef(self->write); /* the call may detach it */
        int end = last && self->chunked && self->held_length == 0;
        PyObject *out = self->chunked ? frame_chunk(PyBytes_AS_STRING(events), PyBytes_GET_SIZE(events), end)
                                      : Py_NewRef(events);
        PyObject *result = out ? PyObject_CallOneArg(write, out) : NULL;
        Py_XDECREF(out);
        Py_DECREF(write);
        if (result == NULL) {
            Py_DECREF(events);
            return -1;
        }
        Py_DECREF(result);
        if (end)
            self->last_chunk_written = self->closed = 1; /* the client's body is over: nothing more goes out */
    }
    int failed = relay_meter(self, now, events);
    Py_SETREF(self->tail[0], self->tail[1]);
    self->tail[1] = events;
    return failed;
}

/* Every object field set to something harmless, so that no method meets a NULL: after __new__ without
 * __init__, and after the garbage collector has cleared the object. */
static int
EventRelay_reset_fields(EventRelay *self)
{
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    PyObject *no_keys = PyTuple_New(0);
    if (empty == NULL || no_keys == NULL) {
        Py_XDECREF(empty);
        Py_XDECREF(no_keys);
        return -1;
    }
    Py_XSETREF(self->write, Py_NewRef(Py_None));
    Py_XSETREF(self->keys, no_keys);
    Py_XSETREF(self->tail[0], Py_NewRef(empty));
    Py_XSETREF(self->tail[1], empty);
    return 0;
}

static PyObject *
EventRelay_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    EventRelay *self = (EventRelay *)type->tp_alloc(type, 0);
    if (self != NULL && EventRelay_reset_fields(self) < 0)
        Py_CLEAR(self);
    if (self != NULL) {
        self->closed = 1; /* until __init__ */
        self->first = -1.0;
    }
    return (PyObject *)self;
}

static int
EventRelay_init(EventRelay *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"write", "chunked", "keys", "cumulative", "gap_bounds", NULL};
    PyObject *write, *keys, *gap_bounds;
    int chunked, cumulative;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OpOpO", names, &write, &chunked, &keys, &cumulative,
                                     &gap_bounds))
        return -1;
    if (check_keys(keys) < 0 || bins_init(&self->chunk_gaps, gap_bounds) < 0
        || bins_init(&self->token_gaps, gap_bounds) < 0 || EventRelay_reset_fields(self) < 0)
        return -1;
    Py_SETREF(self->write, Py_NewRef(write));
    Py_SETREF(self->keys, Py_NewRef(keys));
    self->held_length = 0;
    self->chunked = chunked;
    self->cumulative = cumulative;
    self->tokens = cumulative ? -1 : 0;
    self->first = -1.0;
    self->previous = 0.0;
    self->closed = 0;
    self->last_chunk_written = 0;
    return 0;
}

static PyObject *
EventRelay_received(EventRelay *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "received(now, payload: bytes, last=False)");
        return NULL;
    }
    int last = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (last < 0 || relay_receive(self, args[0], args[1], last) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
EventRelay_ended(EventRelay *self, PyObject *unused)
{
    self->closed = 1;
    Py_RETURN_NONE;
}

static PyObject *
EventRelay_detach(EventRelay *self, PyObject *unused)
{
    Py_SETREF(self->write, Py_NewRef(Py_None));
    Py_RETURN_NONE;
}

static PyObject *
EventRelay_get_pending(EventRelay *self, void *closure)
{
    return PyBytes_FromStringAndSize(self->held, self->held_length);
}

static PyObject *
EventRelay_get_last_chunk_written(EventRelay *self, void *closure)
{
    return PyBool_FromLong(self->last_chunk_written);
}

static PyObject *
EventRelay_get_tail(EventRelay *self, void *closure)
{
    return PySequence_Concat(self->tail[0], self->tail[1]);
}

static PyObject *
EventRelay_get_tokens(EventRelay *self, void *closure)
{
    if (self->tokens < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(self->tokens);
}

static PyObject *
EventRelay_get_first(EventRelay *self, void *closure)
{
    if (self->first < 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->first);
}

static PyObject *
EventRelay_get_chunk_gaps(EventRelay *self, void *closure)
{
    return bins_result(&self->chunk_gaps);
}

static PyObject *
EventRelay_get_token_gaps(EventRelay *self, void *closure)
{
    if (!self->cumulative)
        Py_RETURN_NONE;
    return bins_result(&self->token_gaps);
}

static int
EventRelay_traverse(EventRelay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->write);
    Py_VISIT(self->keys);
    Py_VISIT(self->tail[0]);
    Py_VISIT(self->tail[1]);
    return 0;
}

static int
EventRelay_clear(EventRelay *self)
{
    self->closed = 1;
    return EventRelay_reset_fields(self);
}

static void
EventRelay_dealloc(EventRelay *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->write);
    Py_CLEAR(self->keys);
    Py_CLEAR(self->tail[0]);
    Py_CLEAR(self->tail[1]);
    PyMem_Free(self->held);
    bins_free(&self->chunk_gaps);
    bins_free(&self->token_gaps);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef EventRelay_methods[] = {
    {"received", (PyCFunction)(void (*)(void))EventRelay_received, METH_FASTCALL,
     "received(now, payload, last=False): relay the whole events now complete, meter them, keep the rest for the "
     "next piece; `last`: the body ends here, so a chunked body is ended in the same write if nothing is held."},
    {"ended", (PyCFunction)EventRelay_ended, METH_NOARGS,
     "The response is over (or abandoned): nothing more is relayed."},
    {"detach", (PyCFunction)EventRelay_detach, METH_NOARGS, "The client is gone: stop writing to it."},
    {NULL},
};

static PyGetSetDef EventRelay_getset[] = {
    {"pending", (getter)EventRelay_get_pending, NULL, "Bytes after the last whole event.", NULL},
    {"tail", (getter)EventRelay_get_tail, NULL, "The last two pieces of whole events relayed.", NULL},
    {"last_chunk_written", (getter)EventRelay_get_last_chunk_written, NULL,
     "The client's chunked body was ended (its last chunk written) with the upstream body's last events.", NULL},
    {"tokens", (getter)EventRelay_get_tokens, NULL,
     "cumulative: the last running total seen (None if none); else the marks counted.", NULL},
    {"first", (getter)EventRelay_get_first, NULL, "When the first piece with tokens arrived (None if none).", NULL},
    {"chunk_gaps", (getter)EventRelay_get_chunk_gaps, NULL,
     "(counts per bucket of gap_bounds, then +Inf; sum) of the gaps between pieces that carried tokens.", NULL},
    {"token_gaps", (getter)EventRelay_get_token_gaps, NULL,
     "The same gaps per token, counted once per token (None unless cumulative: counts of text are not tokens).",
     NULL},
    {NULL},
};

static PyTypeObject EventRelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dfserve._relay.EventRelay",
    .tp_doc = "EventRelay(write, chunked, keys, cumulative, gap_bounds): relays a server-sent-event body to "
              "a client whole events at a time, and meters the gaps between the pieces that carried tokens.",
    .tp_basicsize = sizeof(EventRelay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = EventRelay_new,
    .tp_init = (initproc)EventRelay_init,
    .tp_dealloc = (destructor)EventRelay_dealloc,
    .tp_traverse = (traverseproc)EventRelay_traverse,
    .tp_clear = (inquiry)EventRelay_clear,
    .tp_methods = EventRelay_methods,
    .tp_getset = EventRelay_getset,
};

/* ------------------------------------------------------------------------------------------------------------ */
/* Dechunker                                                                                                    */

enum { AT_SIZE, IN_DATA, AT_DATA_END, IN_TRAILER, DONE };

typedef struct {
    PyObject_HEAD
    PyObject *sink;       /* receives each read's payload: an EventRelay directly, anything else by received() */
    PyObject *clock;      /* clock() -> float, for the reads it takes as the transport's protocol */
    PyObject *owner;      /* the connection's protocol, while this reads the body in its place (else None) */
    double last_read;     /* clock reading of the last read it took as the protocol */
    int overrun;          /* bytes came after the end of the body: the server's framing is out of step */
    int state;
    Py_ssize_t remaining; /* IN_DATA: payload bytes left in the chunk; AT_DATA_END: bytes of its CRLF left */
    Py_ssize_t line_length;
    char line[LINE_LIMIT];
} Dechunker;

static PyTypeObject DechunkerType;

static int
bad_chunk(const char *what, const char *line, Py_ssize_t length)
{
    PyObject *text = PyBytes_FromStringAndSize(line, length < 40 ? length : 40);
    if (text != NULL) {
        PyErr_Format(BadChunk, "%s: %R", what, text);
        Py_DECREF(text);
    }
    return -1;
}

/* A chunk-size line without its CRLF: hex digits, then optional whitespace and extensions after ';'. */
static int
parse_size(const char *line, Py_ssize_t length, Py_ssize_t *size)
{
    Py_ssize_t value = 0, i = 0;
    for (; i < length; i++) {
        char c = line[i];
        int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (digit < 0)
            break;
        if (value > (PY_SSIZE_T_MAX >> 5))
            return bad_chunk("chunk size too large", line, length);
        value = value * 16 + digit;
    }
    Py_ssize_t rest = i;
    while (rest < length && (line[rest] == ' ' || line[rest] == '\t'))
        rest++;
    if (i == 0 || (rest < length && line[rest] != ';'))
        return bad_chunk("bad chunk size", line, length);
    *size = value;
    return 0;
}

static int
deliver(Dechunker *self, PyObject *now, PyObject *payload)
{
    PyObject *sink = Py_NewRef(self->sink); /* the call may replace it */
    int failed = 0;
    if (Py_IS_TYPE(sink, &EventRelayType))
        failed = relay_receive((EventRelay *)sink, now, payload, self->state == DONE);
    else {
        PyObject *result = PyObject_CallMethodObjArgs(sink, str_received, now, payload, NULL);
        failed = result == NULL ? -1 : 0;
        Py_XDECREF(result);
    }
    Py_DECREF(sink);
    return failed;
}

/* De-chunk one read, pass its payload (if any) to the sink in one piece: 1 once the body is complete, 0 if not,
 * -1 on an error (BadChunk for broken framing). Bytes after the end of the body are dropped and noted
 * (`overrun`). */
static int
dechunk(Dechunker *self, PyObject *now, const char *data, Py_ssize_t length)
{
    Py_ssize_t i = 0, payload_length = 0;
    PyObject *payload = NULL;
    while (i < length && self->state != DONE) {
        if (self->state == IN_DATA) {
            Py_ssize_t take = Py_MIN(self->remaining, length - i);
            if (payload == NULL && (payload = PyBytes_FromStringAndSize(NULL, length - i)) == NULL)
                return -1;
            memcpy(PyBytes_AS_STRING(payload) + payload_length, data + i, take);
            payload_length += take;
            i += take;
            self->remaining -= take;
            if (self->remaining == 0) {
                self->state = AT_DATA_END;
                self->remaining = 2;
            }
        }
        else if (self->state == AT_DATA_END) {
            if (data[i] != (self->remaining == 2 ? '\r' : '\n')) {
                bad_chunk("chunk data not followed by CRLF", data + i, length - i);
                goto error;
            }
            i++;
            if (--self->remaining == 0)
                self->state = AT_SIZE;
        }
        else { /* AT_SIZE or IN_TRAILER: a line */
            const char *newline = memchr(data + i, '\n', length - i);
            Py_ssize_t take = newline ? newline - (data + i) + 1 : length - i;
            if (self->line_length + take > LINE_LIMIT) {
                bad_chunk("chunk line too long", self->line, self->line_length);
                goto error;
            }
            memcpy(self->line + self->line_length, data + i, take);
            self->line_length += take;
            i += take;
            if (newline == NULL)
                break;
            Py_ssize_t line_length = self->line_length - 2;
            self->line_length = 0;
            if (line_length < 0 || self->line[line_length] != '\r') {
                bad_chunk("chunk line not ended by CRLF", self->line, line_length + 2);
                goto error;
            }
            if (self->state == IN_TRAILER) {
                if (line_length == 0)
                    self->state = DONE;
                continue;
            }
            Py_ssize_t size;
            if (parse_size(self->line, line_length, &size) < 0)
                goto error;
            self->state = size == 0 ? IN_TRAILER : IN_DATA;
            self->remaining = size;
        }
    }
    if (self->state == DONE && i < length)
        self->overrun = 1;
    if (payload != NULL) {
        if (_PyBytes_Resize(&payload, payload_length) < 0)
            return -1;
        int failed = deliver(self, now, payload);
        Py_DECREF(payload);
        if (failed)
            return -1;
    }
    return self->state == DONE;
error:
    Py_XDECREF(payload);
    return -1;
}

static int
Dechunker_init(Dechunker *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"sink", "clock", NULL};
    PyObject *sink, *clock;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", names, &sink, &clock))
        return -1;
    Py_SETREF(self->sink, Py_NewRef(sink));
    Py_SETREF(self->clock, Py_NewRef(clock));
    Py_SETREF(self->owner, Py_NewRef(Py_None));
    self->last_read = 0.0;
    self->overrun = 0;
    self->state = AT_SIZE;
    self->remaining = 0;
    self->line_length = 0;
    return 0;
}

static PyObject *
Dechunker_feed(Dechunker *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "feed(now, data: bytes)");
        return NULL;
    }
    int done = dechunk(self, args[0], PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]));
    return done < 0 ? NULL : PyBool_FromLong(done);
}

static PyObject *forward(Dechunker *self, PyObject *method, PyObject *arg);

/* The protocol's side: uvloop calls this for each read with no Python frame in between; the owner hears of the
 * body's end (body_done()) or of broken framing (body_failed(exc)) and takes its transport back. */
static PyObject *
Dechunker_data_received(Dechunker *self, PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "data_received(data: bytes)");
        return NULL;
    }
    if (self->owner == Py_None)
        Py_RETURN_NONE; /* the owner took its transport back: what still comes is not this body's */
    PyObject *now = PyObject_CallNoArgs(self->clock);
    if (now == NULL)
        return NULL;
    double read_at = PyFloat_AsDouble(now);
    if (read_at == -1.0 && PyErr_Occurred()) {
        Py_DECREF(now);
        return NULL;
    }
    self->last_read = read_at;
    int done = dechunk(self, now, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
    Py_DECREF(now);
    if (done == 0)
        Py_RETURN_NONE;
    if (done > 0)
        return forward(self, name_body_done, NULL);
    if (!PyErr_ExceptionMatches(BadChunk))
        return NULL;
    PyObject *type, *exc, *traceback;
    PyErr_Fetch(&type, &exc, &traceback);
    PyErr_NormalizeException(&type, &exc, &traceback);
    PyObject *result = forward(self, name_body_failed, exc);
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(traceback);
    return result;
}

static PyObject *
forward(Dechunker *self, PyObject *method, PyObject *arg)
{
    if (self->owner == Py_None)
        Py_RETURN_NONE;
    PyObject *owner = Py_NewRef(self->owner); /* the call may let it go */
    PyObject *result = arg == NULL ? PyObject_CallMethodNoArgs(owner, method)
                                   : PyObject_CallMethodOneArg(owner, method, arg);
    Py_DECREF(owner);
    return result;
}

static PyObject *
Dechunker_eof_received(Dechunker *self, PyObject *unused)
{
    return forward(self, name_eof_received, NULL);
}

static PyObject *
Dechunker_connection_lost(Dechunker *self, PyObject *exc)
{
    return forward(self, name_connection_lost, exc);
}

static PyObject *
Dechunker_pause_writing(Dechunker *self, PyObject *unused)
{
    return forward(self, name_pause_writing, NULL);
}

static PyObject *
Dechunker_resume_writing(Dechunker *self, PyObject *unused)
{
    return forward(self, name_resume_writing, NULL);
}

static PyObject *
Dechunker_get_sink(Dechunker *self, void *closure)
{
    return Py_NewRef(self->sink);
}

static int
Dechunker_set_sink(Dechunker *self, PyObject *sink, void *closure)
{
    if (sink == NULL) {
        PyErr_SetString(PyExc_AttributeError, "sink cannot be deleted");
        return -1;
    }
    Py_SETREF(self->sink, Py_NewRef(sink));
    return 0;
}

static PyObject *
Dechunker_get_owner(Dechunker *self, void *closure)
{
    return Py_NewRef(self->owner);
}

static int
Dechunker_set_owner(Dechunker *self, PyObject *owner, void *closure)
{
    Py_SETREF(self->owner, Py_NewRef(owner == NULL ? Py_None : owner));
    return 0;
}

static PyObject *
Dechunker_get_done(Dechunker *self, void *closure)
{
    return PyBool_FromLong(self->state == DONE);
}

static PyObject *
Dechunker_get_overrun(Dechunker *self, void *closure)
{
    return PyBool_FromLong(self->overrun);
}

static PyObject *
Dechunker_get_last_read(Dechunker *self, void *closure)
{
    return PyFloat_FromDouble(self->last_read);
}

static int
Dechunker_traverse(Dechunker *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sink);
    Py_VISIT(self->clock);
    Py_VISIT(self->owner);
    return 0;
}

/* Every object field None, so that no method meets a NULL: after __new__ without __init__, and after the
 * garbage collector has cleared the object. */
static int
Dechunker_clear(Dechunker *self)
{
    Py_XSETREF(self->sink, Py_NewRef(Py_None));
    Py_XSETREF(self->clock, Py_NewRef(Py_None));
    Py_XSETREF(self->owner, Py_NewRef(Py_None));
    return 0;
}

static PyObject *
Dechunker_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Dechunker *self = (Dechunker *)type->tp_alloc(type, 0);
    if (self != NULL)
        Dechunker_clear(self);
    return (PyObject *)self;
}

static void
Dechunker_dealloc(Dechunker *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->sink);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Dechunker_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))Dechunker_feed, METH_FASTCALL,
     "feed(now, data) -> bool: de-chunk one read into sink.received(now, payload); True once the body is complete."},
    {"data_received", (PyCFunction)Dechunker_data_received, METH_O,
     "As the transport's protocol (while `owner` is set): feed one read, stamped by clock()."},
    {"eof_received", (PyCFunction)Dechunker_eof_received, METH_NOARGS, "Forwarded to the owner."},
    {"connection_lost", (PyCFunction)Dechunker_connection_lost, METH_O, "Forwarded to the owner."},
    {"pause_writing", (PyCFunction)Dechunker_pause_writing, METH_NOARGS, "Forwarded to the owner."},
    {"resume_writing", (PyCFunction)Dechunker_resume_writing, METH_NOARGS, "Forwarded to the owner."},
    {NULL},
};

static PyGetSetDef Dechunker_getset[] = {
    {"sink", (getter)Dechunker_get_sink, (setter)Dechunker_set_sink, "Where payload goes.", NULL},
    {"owner", (getter)Dechunker_get_owner, (setter)Dechunker_set_owner,
     "The protocol this reads the body for, while it is the transport's protocol (else None).", NULL},
    {"done", (getter)Dechunker_get_done, NULL, "The last chunk and the trailers have been read.", NULL},
    {"last_read", (getter)Dechunker_get_last_read, NULL, "When it last took a read as the protocol.", NULL},
    {"overrun", (getter)Dechunker_get_overrun, NULL,
     "Bytes came after the end of the body (dropped): the connection cannot be trusted for another response.",
     NULL},
    {NULL},
};

static PyTypeObject DechunkerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dfserve._relay.Dechunker",
    .tp_doc = "Dechunker(sink, clock): an HTTP/1.1 chunked body, read by read; also an asyncio protocol that reads "
              "the body in its owner's place.",
    .tp_basicsize = sizeof(Dechunker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Dechunker_new,
    .tp_init = (initproc)Dechunker_init,
    .tp_dealloc = (destructor)Dechunker_dealloc,
    .tp_traverse = (traverseproc)Dechunker_traverse,
    .tp_clear = (inquiry)Dechunker_clear,
    .tp_methods = Dechunker_methods,
    .tp_getset = Dechunker_getset,
};

/* ------------------------------------------------------------------------------------------------------------ */

static PyMethodDef module_methods[] = {
    {"frame", (PyCFunction)relay_frame, METH_O, "frame(body) -> bytes: body as one HTTP/1.1 chunk."},
    {"read_marks", (PyCFunction)(void (*)(void))relay_read_marks, METH_FASTCALL,
     "read_marks(events, keys, cumulative) -> int | None: the integer after the last key (cumulative; None if "
     "none), else how many keys have a non-empty string value."},
    {NULL},
};

static struct PyModuleDef relay_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dfserve._relay",
    .m_doc = "HTTP/1.1 de-chunking and server-sent-event relaying, per read, without Python in between.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__relay(void)
{
    if (PyType_Ready(&EventRelayType) < 0 || PyType_Ready(&DechunkerType) < 0)
        return NULL;
    struct { PyObject **name; const char *text; } names[] = {
        {&str_received, "received"}, {&name_body_done, "body_done"}, {&name_body_failed, "body_failed"},
        {&name_eof_received, "eof_received"}, {&name_connection_lost, "connection_lost"},
        {&name_pause_writing, "pause_writing"}, {&name_resume_writing, "resume_writing"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].name = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    PyObject *module = PyModule_Create(&relay_module);
    if (module == NULL)
        return NULL;
    BadChunk = PyErr_NewExceptionWithDoc("dfserve._relay.BadChunk", "A chunked body that breaks HTTP/1.1's framing.",
                                         PyExc_ValueError, NULL);
    PyObject *last_chunk = PyBytes_FromStringAndSize(LAST_CHUNK, LAST_CHUNK_LENGTH);
    int failed = BadChunk == NULL || last_chunk == NULL || PyModule_AddObjectRef(module, "BadChunk", BadChunk) < 0
                 || PyModule_AddObjectRef(module, "LAST_CHUNK", last_chunk) < 0
                 || PyModule_AddObjectRef(module, "EventRelay", (PyObject *)&EventRelayType) < 0
                 || PyModule_AddObjectRef(module, "Dechunker", (PyObject *)&DechunkerType) < 0;
    Py_XDECREF(last_chunk);
    if (failed) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
