/* Dechunker: an HTTP/1.1 chunked body, read by read; for the length of a body, also the transport's protocol. */
#include "relay.h"

#include <string.h>

#define LINE_LIMIT 4096 /* a chunk-size line, or a trailer line */

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
        failed = relay_receive(sink, now, payload, self->state == DONE);
    else {
        PyObject *result = PyObject_CallMethodObjArgs(sink, str_received, now, payload, NULL);
        failed = result == NULL ? -1 : 0;
        Py_XDECREF(result);
    }
    Py_DECREF(sink);
    return failed;
}

/* De-chunk one read, pass its payload (if any) to the sink in one piece: 1 once the body is complete, 0 if not,
 * -1 on an error (BadChunk for broken framing, or what the sink raised: EventTooLarge from a relay). Bytes after
 * the end of the body are dropped and noted (`overrun`). */
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
 * body's end (body_done()), or of broken framing or a body its sink refused (body_failed(exc)), and takes its
 * transport back. */
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
    if (!PyErr_ExceptionMatches(BadChunk) && !PyErr_ExceptionMatches(EventTooLarge))
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

PyTypeObject DechunkerType = {
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
