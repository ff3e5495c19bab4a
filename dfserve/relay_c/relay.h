/* The per-read work of a streamed response, in C: HTTP/1.1 de-chunking (`Dechunker`, dechunker.c) and relaying
 * whole server-sent events to the client (`EventRelay`, event_relay.c), with what they share: HTTP chunk framing
 * (frame.c), token marks read from JSON keys (marks.c) and histogram bins (bins.c); and, before them, the socket
 * read itself dated by the kernel (`StampedReader`, reader.c: the load tester's reads). module.c puts them together
 * as the extension `dfserve._relay`.
 *
 * Why C: a relayed chunk costs a proxy one socket read and one write, and whatever it runs between them. In
 * Python that work (de-chunk, cut at event boundaries, re-frame, time-stamp, count tokens) cost the gateway more
 * CPU per chunk than the whole of sglang-router's, with the syscalls being the same (bench/RESULTS.md). Here the
 * de-chunker is the upstream transport's protocol for the length of a body, so the event loop hands each read
 * straight to C; the relay writes the whole events to the client's transport (less any member it was told to cut,
 * members.c), then notes the piece's arrival time and the tokens it carried, found by JSON keys that
 * `dfserve.sglang` names (`TokenMarks`), so the SGLang format is still known in one place. Python sees the stream again when it ends (`gateway.relay.meter`).
 *
 * The extension is optional: `dfserve/_relay_py/` is its pure-Python twin, one module per file here, with the
 * same API and behaviour (tests/unit/test_relay_differential.py runs both on the same inputs), and
 * `dfserve.relay_core` picks one.
 */
#ifndef DFSERVE_RELAY_H
#define DFSERVE_RELAY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* module.c: the module's exceptions and interned method names */
extern PyObject *BadChunk, *EventTooLarge;
extern PyObject *str_received, *str_data_received, *name_body_done, *name_body_failed, *name_eof_received,
    *name_connection_lost, *name_pause_writing, *name_resume_writing;

/* frame.c */
extern const char LAST_CHUNK[];
#define LAST_CHUNK_LENGTH ((Py_ssize_t)5)
PyObject *frame_chunk(const char *body, Py_ssize_t length, int last);
PyObject *relay_frame(PyObject *module, PyObject *body);

/* marks.c */
int check_keys(PyObject *keys);
int64_t read_marks(const char *buf, Py_ssize_t length, PyObject *keys, int cumulative);
int contains_key(const char *buf, Py_ssize_t length, PyObject *keys); /* any of the tuple's keys occurs in buf */
PyObject *relay_read_marks(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* members.c: `events` less each member whose key is `key` (a new reference; `events` itself if nothing was cut),
 * and where the events of a buffer end */
PyObject *strip_members(PyObject *events, PyObject *key);
Py_ssize_t event_boundary(const char *buf, Py_ssize_t length, Py_ssize_t from);

/* bins.c: histogram observations counted as a Prometheus histogram counts them */
typedef struct {
    double *bounds;
    int64_t *counts; /* one more than bounds: +Inf; NULL until bins_init */
    Py_ssize_t size;
    double sum;
} Bins;
int bins_init(Bins *bins, PyObject *bounds);
void bins_add(Bins *bins, double value, int64_t weight);
PyObject *bins_result(const Bins *bins);
void bins_free(Bins *bins);

/* Whether buf[i] is the line feed that ends a blank line, so an event: "\n\n" or "\n\r\n". */
static inline int
ends_event(const char *buf, Py_ssize_t i)
{
    return buf[i] == '\n' && i >= 1 && (buf[i - 1] == '\n' || (i >= 2 && buf[i - 1] == '\r' && buf[i - 2] == '\n'));
}

/* event_relay.c */
extern PyTypeObject EventRelayType;
int relay_receive(PyObject *relay, PyObject *now, PyObject *payload, int last);

/* dechunker.c */
extern PyTypeObject DechunkerType;

/* reader.c */
extern PyTypeObject StampedReaderType;

#endif
