/* Members cut out of events by their key, without decoding: fields a proxy asked the engine for on its own behalf,
 * which the client must not see. Which key is `dfserve.sglang`'s. A key's quoted name followed by a colon only
 * occurs as a key (JSON escapes quotes inside strings), so no text a model wrote is ever cut. */
#define _GNU_SOURCE /* memmem */
#include "relay.h"

#include <string.h>

static int
inline_space(char c)
{
    return c == ' ' || c == '\t';
}

/* One past the end of the JSON value at buf[i], or -1 where it does not end on its own line. */
static Py_ssize_t
value_end(const char *buf, Py_ssize_t i, Py_ssize_t length)
{
    Py_ssize_t start = i, depth = 0;
    for (; i < length; i++) {
        char c = buf[i];
        if (c == '"') {
            for (i++; i < length && buf[i] != '"' && buf[i] != '\n'; i++)
                if (buf[i] == '\\')
                    i++;
            if (i >= length || buf[i] != '"')
                return -1;
            if (depth == 0)
                return i + 1;
        }
        else if (c == '{' || c == '[')
            depth++;
        else if (depth == 0 && (c == '}' || c == ']' || c == ',' || c == '\r' || c == '\n' || inline_space(c)))
            return i > start ? i : -1; /* a number or a literal ends here */
        else if (c == '\r' || c == '\n')
            return -1;
        else if ((c == '}' || c == ']') && --depth == 0)
            return i + 1;
    }
    return -1;
}

/* One past the first blank line that ends at or after `from`; 0 if none. */
static Py_ssize_t
event_end(const char *buf, Py_ssize_t length, Py_ssize_t from)
{
    for (Py_ssize_t i = Py_MAX(from, 1); i < length; i++)
        if (ends_event(buf, i))
            return i + 1;
    return 0;
}

/* Length of the longest prefix of buf that ends with a blank line ("\n\n" or "\n\r\n"), looking only at
 * lines that end at or after `from`; 0 if none. */
Py_ssize_t
event_boundary(const char *buf, Py_ssize_t length, Py_ssize_t from)
{
    for (Py_ssize_t i = length - 1; i >= Py_MAX(from, 1); i--)
        if (ends_event(buf, i))
            return i + 1;
    return 0;
}

/* The bytes [*from, *to) that cutting the member whose key starts at `at` removes: the member and one comma beside
 * it, or the whole event where its object is left empty (nothing else was asked for). 0: not a member to cut (its
 * value does not end, or it is not inside an object), or one that reaches back before `floor`. */
static int
member_span(const char *buf, Py_ssize_t length, Py_ssize_t at, Py_ssize_t key_length, Py_ssize_t floor,
            Py_ssize_t *from, Py_ssize_t *to)
{
    Py_ssize_t value = at + key_length;
    while (value < length && inline_space(buf[value]))
        value++;
    Py_ssize_t end = value_end(buf, value, length);
    if (end < 0)
        return 0;
    Py_ssize_t before = at, after = end;
    while (before > floor && inline_space(buf[before - 1]))
        before--;
    while (after < length && inline_space(buf[after]))
        after++;
    if (before > floor && buf[before - 1] == ',') {
        *from = before - 1;
        *to = end;
        return 1;
    }
    if (before <= floor || buf[before - 1] != '{' || after >= length)
        return 0;
    if (buf[after] == ',') {
        for (after++; after < length && inline_space(buf[after]); after++)
            ;
        *from = at;
        *to = after;
        return 1;
    }
    if (buf[after] != '}')
        return 0;
    *from = event_boundary(buf, at, 0);
    *to = event_end(buf, length, after + 1);
    return *from >= floor && *to > 0;
}

PyObject *
strip_members(PyObject *events, PyObject *key)
{
    const char *buf = PyBytes_AS_STRING(events), *needle = PyBytes_AS_STRING(key);
    Py_ssize_t length = PyBytes_GET_SIZE(events), key_length = PyBytes_GET_SIZE(key);
    const char *hit = memmem(buf, length, needle, key_length);
    if (hit == NULL)
        return Py_NewRef(events);
    PyObject *out = PyBytes_FromStringAndSize(NULL, length);
    if (out == NULL)
        return NULL;
    char *w = PyBytes_AS_STRING(out);
    Py_ssize_t kept = 0, written = 0; /* buf[kept:] is not yet copied or cut */
    while (hit != NULL) {
        Py_ssize_t at = hit - buf, from, to, next = at + key_length;
        if (member_span(buf, length, at, key_length, kept, &from, &to)) {
            memcpy(w + written, buf + kept, from - kept);
            written += from - kept;
            kept = to;
            next = Py_MAX(next, to);
        }
        hit = memmem(buf + next, length - next, needle, key_length);
    }
    if (kept == 0) {
        Py_DECREF(out);
        return Py_NewRef(events);
    }
    memcpy(w + written, buf + kept, length - kept);
    written += length - kept;
    if (_PyBytes_Resize(&out, written) < 0)
        return NULL;
    return out;
}
