/* EventRelay: a server-sent-event body relayed to a client whole events at a time, and metered. */
#include "relay.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *write;    /* writes bytes to the client's socket, or None: nothing is sent (HEAD, a shadow) */
    int chunked;        /* frame what is written as HTTP chunks */
    PyObject *keys;     /* token marks (see read_marks) */
    int cumulative;
    PyObject *strip;    /* the key of members cut from every event before it goes out (strip_members), or None */
    PyObject *stripped; /* the last piece of whole events that had members cut, as it came */
    PyObject *alarm;    /* keys that mark a piece to keep wherever it comes (a tuple of bytes, or None) */
    PyObject *alarmed[2]; /* the first and the latest piece of whole events relayed in which an alarm key occurs */
    char *held;         /* bytes after the last whole event, kept until their event is complete */
    Py_ssize_t held_length, held_capacity;
    Py_ssize_t max_event_bytes; /* the most it holds: an event still incomplete past it ends the relay */
    PyObject *tail[2];  /* the last two pieces of whole events relayed, oldest first, keep-alives left out */
    int64_t tokens;     /* cumulative: the running total seen so far (-1: none); else: marks counted */
    double first;       /* arrival time of the first piece that carried tokens (-1: none yet) */
    double previous;    /* and of the latest */
    Bins chunk_gaps;    /* gaps between pieces that carried tokens */
    Bins token_gaps;    /* the same gaps per token, one per token (cumulative marks: exact token counts) */
    PyObject *pieces;   /* keep_pieces: a list of (arrival, whole events relayed), by reference, or, cumulative, of
                         * (arrival, running total) per event whose total changed; else None */
    int64_t kept;       /* keep_pieces, cumulative: the last running total kept (0 before any) */
    int closed;
    int last_chunk_written; /* the body's end went out with its last events */
} EventRelay;

/* `found`: the marks read in a piece of whole events (read_marks). */
static int
relay_meter(EventRelay *self, PyObject *now, int64_t found)
{
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
keep(PyObject *list, PyObject *now, PyObject *item)
{
    PyObject *kept = PyTuple_Pack(2, now, item);
    int failed = kept == NULL || PyList_Append(list, kept) < 0;
    Py_XDECREF(kept);
    return failed ? -1 : 0;
}

/* One past the blank line that ends the event starting at buf[start]; `length` if none does. Line feeds are found
 * with memchr: inside JSON they are escaped, so an event has few. */
static Py_ssize_t
next_event(const char *buf, Py_ssize_t length, Py_ssize_t start)
{
    for (const char *lf = buf + start; (lf = memchr(lf, '\n', buf + length - lf)) != NULL; lf++)
        if (lf - buf > start && ends_event(buf, lf - buf))
            return lf - buf + 1;
    return length;
}

/* A recorded stream of running totals (native): each event's total where it changed, with the piece's arrival,
 * rather than the events, which repeat the whole output so far (their bytes grow with the square of its length).
 * A total that went back is kept too: a reader of the stream would call it a protocol error. `found`: the total
 * read in the whole piece, which is the event's where the piece is one event. */
static int
keep_counts(EventRelay *self, PyObject *now, PyObject *events, int64_t found)
{
    const char *buf = PyBytes_AS_STRING(events);
    Py_ssize_t length = PyBytes_GET_SIZE(events);
    for (Py_ssize_t start = 0; start < length;) {
        Py_ssize_t end = next_event(buf, length, start);
        int64_t count = start == 0 && end == length ? found : read_marks(buf + start, end - start, self->keys, 1);
        start = end;
        if (count < 0 || count == self->kept)
            continue;
        PyObject *total = PyLong_FromLongLong(count);
        int failed = total == NULL || keep(self->pieces, now, total) < 0;
        Py_XDECREF(total);
        if (failed)
            return -1;
        self->kept = count;
    }
    return 0;
}

static int
hold(EventRelay *self, const char *data, Py_ssize_t length)
{
    if (length == 0)
        return 0;
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

/* An event still incomplete past `max_event_bytes` ends the relay (EventTooLarge), and what it held is let go. */
static int
check_held(EventRelay *self)
{
    if (self->held_length <= self->max_event_bytes)
        return 0;
    PyMem_Free(self->held);
    self->held = NULL;
    self->held_length = self->held_capacity = 0;
    self->closed = 1;
    PyErr_Format(EventTooLarge, "an event longer than %zd bytes (max_event_bytes)", self->max_event_bytes);
    return -1;
}

/* Whether a piece of whole events holds nothing but comments and blank lines (a keep-alive): it is no end of the
 * stream to read, and stays out of `tail`, so that the last events are still there after it. */
static int
only_comments(const char *data, Py_ssize_t length)
{
    Py_ssize_t at = 0;
    while (at < length) {
        char first = data[at];
        if (first != ':' && first != '\n' && first != '\r') /* an event's line: settled by its first byte */
            return 0;
        const char *newline = memchr(data + at, '\n', length - at);
        Py_ssize_t end = newline != NULL ? newline - data : length;
        if (first == '\r' && end - at != 1)
            return 0;
        at = end + 1;
    }
    return 1;
}

/* The relay's whole job for one piece of body: whole events go to the client, then are metered. `last`: the
 * upstream body ends with this piece; when it leaves nothing held, the client's body is ended in the same write
 * (one system call fewer per request). */
int
relay_receive(PyObject *relay, PyObject *now, PyObject *payload, int last)
{
    EventRelay *self = (EventRelay *)relay;
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
            return check_held(self);
        events = PyBytes_FromStringAndSize(self->held, cut);
        if (events == NULL)
            return -1;
        memmove(self->held, self->held + cut, self->held_length - cut);
        self->held_length -= cut;
    }
    if (self->strip != Py_None) {
        PyObject *kept = strip_members(events, self->strip);
        if (kept == NULL) {
            Py_DECREF(events);
            return -1;
        }
        if (kept != events)
            Py_SETREF(self->stripped, Py_NewRef(events));
        Py_SETREF(events, kept);
    }
    int end = last && self->chunked && self->held_length == 0;
    if (self->write != Py_None && (PyBytes_GET_SIZE(events) > 0 || end)) { /* cut to nothing: nothing to frame */
        PyObject *write = Py_NewRef(self->write); /* the call may detach it */
        PyObject *out = !self->chunked ? Py_NewRef(events)
                        : PyBytes_GET_SIZE(events) ? frame_chunk(PyBytes_AS_STRING(events), PyBytes_GET_SIZE(events), end)
                                                   : PyBytes_FromStringAndSize(LAST_CHUNK, LAST_CHUNK_LENGTH);
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
    int64_t found = read_marks(PyBytes_AS_STRING(events), PyBytes_GET_SIZE(events), self->keys, self->cumulative);
    int failed = relay_meter(self, now, found);
    if (self->alarm != Py_None && contains_key(PyBytes_AS_STRING(events), PyBytes_GET_SIZE(events), self->alarm))
        Py_SETREF(self->alarmed[PyBytes_GET_SIZE(self->alarmed[0]) > 0], Py_NewRef(events));
    int quiet = only_comments(PyBytes_AS_STRING(events), PyBytes_GET_SIZE(events));
    if (!quiet) {
        Py_SETREF(self->tail[0], self->tail[1]);
        self->tail[1] = Py_NewRef(events);
    }
    int kept = failed || self->pieces == Py_None || PyBytes_GET_SIZE(events) == 0 ? 0
               : self->cumulative ? keep_counts(self, now, events, found) : keep(self->pieces, now, events);
    Py_DECREF(events);
    if (failed || kept < 0)
        return -1;
    return check_held(self);
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
    Py_XSETREF(self->strip, Py_NewRef(Py_None));
    Py_XSETREF(self->alarm, Py_NewRef(Py_None));
    Py_XSETREF(self->pieces, Py_NewRef(Py_None));
    Py_XSETREF(self->stripped, Py_NewRef(empty));
    Py_XSETREF(self->alarmed[0], Py_NewRef(empty));
    Py_XSETREF(self->alarmed[1], Py_NewRef(empty));
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
        self->max_event_bytes = PY_SSIZE_T_MAX;
    }
    return (PyObject *)self;
}

static int
EventRelay_init(EventRelay *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"write",           "chunked", "keys",        "cumulative", "gap_bounds",
                            "max_event_bytes", "strip",   "keep_pieces", "alarm",      NULL};
    PyObject *write, *keys, *gap_bounds, *limit = Py_None, *strip = Py_None, *alarm = Py_None;
    int chunked, cumulative, keep_pieces = 0;
    self->closed = 1; /* until this succeeds */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OpOpO|OOpO", names, &write, &chunked, &keys, &cumulative,
                                     &gap_bounds, &limit, &strip, &keep_pieces, &alarm))
        return -1;
    if (strip != Py_None && (!PyBytes_Check(strip) || PyBytes_GET_SIZE(strip) == 0)) {
        PyErr_SetString(PyExc_TypeError, "strip must be a non-empty bytes key or None");
        return -1;
    }
    Py_ssize_t max_event_bytes = PY_SSIZE_T_MAX;
    if (limit != Py_None) {
        max_event_bytes = PyLong_AsSsize_t(limit);
        if (max_event_bytes == -1 && PyErr_Occurred())
            return -1;
        if (max_event_bytes <= 0) {
            PyErr_SetString(PyExc_ValueError, "max_event_bytes must be positive");
            return -1;
        }
    }
    if (check_keys(keys) < 0 || (alarm != Py_None && check_keys(alarm) < 0)
        || bins_init(&self->chunk_gaps, gap_bounds) < 0 || bins_init(&self->token_gaps, gap_bounds) < 0
        || EventRelay_reset_fields(self) < 0)
        return -1;
    Py_SETREF(self->write, Py_NewRef(write));
    Py_SETREF(self->keys, Py_NewRef(keys));
    Py_SETREF(self->alarm, Py_NewRef(alarm));
    if (strip != Py_None) {
        PyObject *key = PyBytes_FromStringAndSize(PyBytes_AS_STRING(strip), PyBytes_GET_SIZE(strip));
        if (key == NULL)
            return -1;
        Py_SETREF(self->strip, key);
    }
    if (keep_pieces) {
        PyObject *pieces = PyList_New(0);
        if (pieces == NULL)
            return -1;
        Py_SETREF(self->pieces, pieces);
    }
    self->held_length = 0;
    self->max_event_bytes = max_event_bytes;
    self->chunked = chunked;
    self->cumulative = cumulative;
    self->tokens = cumulative ? -1 : 0;
    self->kept = 0;
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
    if (last < 0 || relay_receive((PyObject *)self, args[0], args[1], last) < 0)
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
    return PyBytes_FromStringAndSize(self->held_length ? self->held : NULL, self->held_length);
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
EventRelay_get_stripped(EventRelay *self, void *closure)
{
    return Py_NewRef(self->stripped);
}

static PyObject *
EventRelay_get_alarmed(EventRelay *self, void *closure)
{
    return PySequence_Concat(self->alarmed[0], self->alarmed[1]);
}

static PyObject *
EventRelay_get_pieces(EventRelay *self, void *closure)
{
    return Py_NewRef(self->pieces);
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
    Py_VISIT(self->strip);
    Py_VISIT(self->stripped);
    Py_VISIT(self->alarm);
    Py_VISIT(self->alarmed[0]);
    Py_VISIT(self->alarmed[1]);
    Py_VISIT(self->pieces);
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
    Py_CLEAR(self->strip);
    Py_CLEAR(self->stripped);
    Py_CLEAR(self->alarm);
    Py_CLEAR(self->alarmed[0]);
    Py_CLEAR(self->alarmed[1]);
    Py_CLEAR(self->pieces);
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
     "next piece; `last`: the body ends here, so a chunked body is ended in the same write if nothing is held. "
     "An event still incomplete past max_event_bytes raises EventTooLarge and ends the relay."},
    {"ended", (PyCFunction)EventRelay_ended, METH_NOARGS,
     "The response is over (or abandoned): nothing more is relayed."},
    {"detach", (PyCFunction)EventRelay_detach, METH_NOARGS, "The client is gone: stop writing to it."},
    {NULL},
};

static PyGetSetDef EventRelay_getset[] = {
    {"pending", (getter)EventRelay_get_pending, NULL, "Bytes after the last whole event.", NULL},
    {"tail", (getter)EventRelay_get_tail, NULL, "The last two pieces of whole events relayed.", NULL},
    {"stripped", (getter)EventRelay_get_stripped, NULL,
     "The last piece of whole events that had members cut (strip), as it came; empty if none.", NULL},
    {"alarmed", (getter)EventRelay_get_alarmed, NULL,
     "The first and the latest piece of whole events relayed (as relayed) in which a key of alarm occurs; empty if "
     "none.", NULL},
    {"pieces", (getter)EventRelay_get_pieces, NULL,
     "keep_pieces: every piece of whole events relayed (as the client got them, none empty), with the clock reading "
     "of its arrival, as a list of (now, events), by reference: what a client would have read; cumulative, "
     "(now, running total) for each event whose total changed (from 0), not its bytes; else None.",
     NULL},
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

PyTypeObject EventRelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dfserve._relay.EventRelay",
    .tp_doc = "EventRelay(write, chunked, keys, cumulative, gap_bounds, max_event_bytes=None, strip=None, "
              "keep_pieces=False, alarm=None): relays a server-sent-event body to a client whole events at a time, "
              "less the members whose key is strip (an event left with an empty object goes whole), and meters the "
              "gaps between the pieces that carried tokens; with keep_pieces, it also keeps each piece relayed with "
              "its arrival time, or, cumulative, each changed running total (pieces); with alarm, a tuple of keys, "
              "the first and the latest piece in which one occurs (alarmed).",
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
