/* StampedReader: one socket's reads, each dated by when the kernel received its bytes, handed to a protocol.
 *
 * The event loop calls it when the socket is readable (loop.add_reader), so a read costs no Python frame: one
 * recvmsg, the stamp of the last segment it took (SO_TIMESTAMPNS, on the wall clock) moved onto perf_counter's
 * clock (CLOCK_MONOTONIC), then protocol.data_received(data). It also counts how long chunks waited for the loop
 * (`late_reads`, `max_lag`): a chunk still unread when the next arrives is dated by the next. dfserve/stamped_socket.py
 * says why and is the transport around it. */
#include "relay.h"

#include <structmember.h>

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define READ_BYTES 65536
#define LATE_READ_S 1e-3 /* a read taken this long after its bytes arrived counts as late (`late_reads`) */
#define STAMP_TYPE 35 /* SO_TIMESTAMPNS_OLD (asm-generic/socket.h): a struct timespec, as dfserve/stamped_socket.py asks */

static char read_buffer[READ_BYTES]; /* one for every reader: a read runs whole under the GIL */

typedef struct {
    PyObject_HEAD
    int fd;
    PyObject *protocol; /* data_received(data) for each read */
    PyObject *ended;    /* ended(exc): the peer's end of the stream (None), the read's OSError, or what the
                         * protocol raised */
    double arrival;     /* the date of the last read, on perf_counter's clock */
    int64_t reads;      /* reads that took bytes */
    int64_t late_reads; /* of the reads of chunks that more of their response followed, those taken LATE_READ_S
                         * or more after their bytes arrived */
    double max_lag;     /* of those reads, the longest their bytes waited in the kernel for the loop, in seconds */
    double pending_lag; /* the last read's lag, counted when another read follows (< 0: nothing to count) */
} StampedReader;

static double
monotonic_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + now.tv_nsec * 1e-9;
}

/* The kernel's stamp as a date on the monotonic clock, `now` being that clock's reading after the read; kept
 * between the previous read's date and now, so it never runs backwards. */
static double
arrival_of(StampedReader *self, struct msghdr *msg, double now)
{
#ifdef __linux__
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != STAMP_TYPE || c->cmsg_len < CMSG_LEN(sizeof(struct timespec)))
            continue;
        struct timespec stamp, wall;
        memcpy(&stamp, CMSG_DATA(c), sizeof stamp);
        clock_gettime(CLOCK_REALTIME, &wall);
        int64_t delay_ns = ((int64_t)wall.tv_sec - stamp.tv_sec) * 1000000000 + (wall.tv_nsec - stamp.tv_nsec);
        double arrival = now - delay_ns * 1e-9;
        return arrival > now ? now : arrival < self->arrival ? self->arrival : arrival;
    }
#endif
    return now; /* the end of the stream, or a segment queued before stamping was asked for */
}

/* ended(exc) with the exception being raised: a failed read, or a protocol that raised. */
static PyObject *
end_with_error(StampedReader *self)
{
    PyObject *type, *exc, *traceback;
    PyErr_Fetch(&type, &exc, &traceback);
    PyErr_NormalizeException(&type, &exc, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(exc, traceback);
    PyObject *result = PyObject_CallOneArg(self->ended, exc);
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(traceback);
    return result;
}

static PyObject *
StampedReader_call(StampedReader *self, PyObject *args, PyObject *kwargs)
{
    if (self->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "StampedReader: no socket");
        return NULL;
    }
    union {
        char bytes[CMSG_SPACE(sizeof(struct timespec))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {read_buffer, READ_BYTES};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.bytes;
    msg.msg_controllen = sizeof control.bytes;
    ssize_t length;
    do
        length = recvmsg(self->fd, &msg, 0);
    while (length < 0 && errno == EINTR);
    if (length < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            Py_RETURN_NONE;
        PyErr_SetFromErrno(PyExc_OSError);
        return end_with_error(self);
    }
    double now = monotonic_now();
    self->arrival = arrival_of(self, &msg, now);
    if (length == 0)
        return PyObject_CallOneArg(self->ended, Py_None);
    self->reads++;
    if (self->pending_lag >= 0) {
        if (self->pending_lag >= LATE_READ_S)
            self->late_reads++;
        if (self->pending_lag > self->max_lag)
            self->max_lag = self->pending_lag;
    }
    self->pending_lag = now - self->arrival;
    PyObject *data = PyBytes_FromStringAndSize(read_buffer, length);
    if (data == NULL)
        return NULL;
    PyObject *protocol = Py_NewRef(self->protocol); /* the call may replace it */
    PyObject *result = PyObject_CallMethodOneArg(protocol, str_data_received, data);
    Py_DECREF(protocol);
    Py_DECREF(data);
    if (result == NULL && !PyErr_ExceptionMatches(PyExc_SystemExit) && !PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        return end_with_error(self); /* as asyncio's transports do: a protocol that failed loses its connection */
    return result;
}

static int
StampedReader_init(StampedReader *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"sock", "protocol", "ended", NULL};
    PyObject *sock, *protocol, *ended;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO", names, &sock, &protocol, &ended))
        return -1;
    PyObject *module = PyImport_ImportModule("_socket");
    PyObject *socket_type = module == NULL ? NULL : PyObject_GetAttrString(module, "socket");
    Py_XDECREF(module);
    int is_socket = socket_type == NULL ? -1 : PyObject_IsInstance(sock, socket_type);
    Py_XDECREF(socket_type);
    if (is_socket <= 0) {
        if (is_socket == 0)
            PyErr_SetString(PyExc_TypeError, "StampedReader(sock, ...): sock must be a socket");
        return -1;
    }
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0)
        return -1;
    self->fd = fd;
    Py_SETREF(self->protocol, Py_NewRef(protocol));
    Py_SETREF(self->ended, Py_NewRef(ended));
    self->arrival = 0.0;
    self->reads = self->late_reads = 0;
    self->max_lag = 0.0;
    self->pending_lag = -1.0;
    return 0;
}

/* The read being delivered holds no chunk that a later one could share a stamp with (it ended its response, or
 * held only a response head): however late, it dates nothing wrongly, so its lag is not counted. */
static PyObject *
StampedReader_not_a_chunk(StampedReader *self, PyObject *unused)
{
    self->pending_lag = -1.0;
    Py_RETURN_NONE;
}

static PyObject *
StampedReader_arrival(StampedReader *self, PyObject *unused)
{
    return PyFloat_FromDouble(self->arrival);
}

static PyObject *
StampedReader_get_protocol(StampedReader *self, void *closure)
{
    return Py_NewRef(self->protocol);
}

static int
StampedReader_set_protocol(StampedReader *self, PyObject *protocol, void *closure)
{
    if (protocol == NULL) {
        PyErr_SetString(PyExc_AttributeError, "protocol cannot be deleted");
        return -1;
    }
    Py_SETREF(self->protocol, Py_NewRef(protocol));
    return 0;
}

static int
StampedReader_traverse(StampedReader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->protocol);
    Py_VISIT(self->ended);
    return 0;
}

/* Every object field None and no socket, so that no call meets a NULL: after __new__ without __init__, and after
 * the garbage collector has cleared the object. */
static int
StampedReader_clear(StampedReader *self)
{
    self->fd = -1;
    self->pending_lag = -1.0;
    Py_XSETREF(self->protocol, Py_NewRef(Py_None));
    Py_XSETREF(self->ended, Py_NewRef(Py_None));
    return 0;
}

static PyObject *
StampedReader_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    StampedReader *self = (StampedReader *)type->tp_alloc(type, 0);
    if (self != NULL)
        StampedReader_clear(self);
    return (PyObject *)self;
}

static void
StampedReader_dealloc(StampedReader *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->protocol);
    Py_CLEAR(self->ended);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef StampedReader_methods[] = {
    {"arrival", (PyCFunction)StampedReader_arrival, METH_NOARGS,
     "arrival() -> float: when the bytes of the last read arrived, on perf_counter's clock."},
    {"not_a_chunk", (PyCFunction)StampedReader_not_a_chunk, METH_NOARGS,
     "The read being delivered ended its response or held only a head: its lag is not counted."},
    {NULL},
};

static PyGetSetDef StampedReader_getset[] = {
    {"protocol", (getter)StampedReader_get_protocol, (setter)StampedReader_set_protocol,
     "What each read's bytes go to (data_received).", NULL},
    {NULL},
};

static PyMemberDef StampedReader_members[] = {
    {"reads", T_LONGLONG, offsetof(StampedReader, reads), READONLY, "Reads that took bytes."},
    {"late_reads", T_LONGLONG, offsetof(StampedReader, late_reads), READONLY,
     "Of the reads of chunks that more of their response followed, those taken 1 ms or more after their bytes "
     "arrived."},
    {"max_lag", T_DOUBLE, offsetof(StampedReader, max_lag), READONLY,
     "Of those reads, the longest their bytes waited in the kernel for the loop, in seconds."},
    {NULL},
};

PyTypeObject StampedReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dfserve._relay.StampedReader",
    .tp_doc = "StampedReader(sock, protocol, ended): called when sock is readable, reads once, dates the read by "
              "the kernel's receive time (arrival()) and hands the bytes to protocol.data_received; the end of "
              "the stream calls ended(None), a failed read or a protocol that raised ended(exc).",
    .tp_basicsize = sizeof(StampedReader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = StampedReader_new,
    .tp_init = (initproc)StampedReader_init,
    .tp_dealloc = (destructor)StampedReader_dealloc,
    .tp_traverse = (traverseproc)StampedReader_traverse,
    .tp_clear = (inquiry)StampedReader_clear,
    .tp_call = (ternaryfunc)StampedReader_call,
    .tp_methods = StampedReader_methods,
    .tp_getset = StampedReader_getset,
    .tp_members = StampedReader_members,
};
