/* The extension `dfserve._relay`: its exceptions, its functions and its three types (see relay.h for the whole). */
#include "relay.h"

PyObject *BadChunk, *EventTooLarge;
PyObject *str_received, *str_data_received, *name_body_done, *name_body_failed, *name_eof_received,
    *name_connection_lost, *name_pause_writing, *name_resume_writing;

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
    .m_doc = "Socket reads dated by the kernel, HTTP/1.1 de-chunking and server-sent-event relaying, per read, "
              "without Python in between.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__relay(void)
{
    if (PyType_Ready(&EventRelayType) < 0 || PyType_Ready(&DechunkerType) < 0 || PyType_Ready(&StampedReaderType) < 0)
        return NULL;
    struct { PyObject **name; const char *text; } names[] = {
        {&str_received, "received"}, {&str_data_received, "data_received"}, {&name_body_done, "body_done"}, {&name_body_failed, "body_failed"},
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
    EventTooLarge = PyErr_NewExceptionWithDoc(
        "dfserve._relay.EventTooLarge", "An event still incomplete past the relay's max_event_bytes.",
        PyExc_ValueError, NULL);
    PyObject *last_chunk = PyBytes_FromStringAndSize(LAST_CHUNK, LAST_CHUNK_LENGTH);
    int failed = BadChunk == NULL || EventTooLarge == NULL || last_chunk == NULL
                 || PyModule_AddObjectRef(module, "BadChunk", BadChunk) < 0
                 || PyModule_AddObjectRef(module, "EventTooLarge", EventTooLarge) < 0
                 || PyModule_AddObjectRef(module, "LAST_CHUNK", last_chunk) < 0
                 || PyModule_AddObjectRef(module, "EventRelay", (PyObject *)&EventRelayType) < 0
                 || PyModule_AddObjectRef(module, "Dechunker", (PyObject *)&DechunkerType) < 0
                 || PyModule_AddObjectRef(module, "StampedReader", (PyObject *)&StampedReaderType) < 0;
    Py_XDECREF(last_chunk);
    if (failed) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
