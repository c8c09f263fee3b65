/* A worker's direct endpoint, the per-call intake compiled (splitserve/worker/direct.py).

   ``Lane(func_id, sizes, max_batch, classes, rows)`` is built once per endpoint: the model's
   func_id, each input's bytes per sample, its max_batch_size, the class each header ``cls``
   byte runs in (a bytes of 256: 0 real-time, 1 best-effort, 255 for a class the Python path
   must answer: unknown, or refused in rt-only mode) and, per class, the writable batch
   buffers of the inputs (``rows[class][input]``, each ``max_batch`` samples long).

   take(stage, n, rt_row, be_row) -> (req_id, class, count, deadline_us, slo_us) | None
       ``stage[0:n]`` is what one read of a connection brought. When it is exactly one
       plain REQUEST for this model (a valid header, one segment, a whole number of samples
       within max_batch, a class that runs, the whole payload and nothing after it) and its
       class has room (rows from ``rt_row`` / ``be_row`` on; -1: none), its payload is
       copied into its rows (each input's samples at that row of its buffer) and its fields
       are returned. Anything else returns None with nothing written but free rows: the
       Python frame state machine then takes the same bytes, so every frame it does not
       take here (a refusal, a PING, a partial or pipelined read, a bad header) is handled
       and answered as before, by the one code that knows how.

   It checks what ``protocol.header.unpack_header``, ``protocol.requests.stream_samples`` and
   ``call_class`` check, and declines, never refuses: whatever it takes, the Python path
   would have accepted with the same fields and rows. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define HEADER_SIZE 64
#define VERSION 1
#define KIND_REQUEST 1
#define MAX_PAYLOAD (1u << 30) /* protocol.header.MAX_PAYLOAD */
#define MAX_INPUTS 64
#define NO_CLASS 255

typedef struct {
    PyObject_HEAD
    unsigned func_id;
    Py_ssize_t ninputs, per, max_batch;
    Py_ssize_t sizes[MAX_INPUTS];
    unsigned char classes[256];
    Py_buffer rows[2][MAX_INPUTS];
    Py_ssize_t held[2]; /* rows[c][0:held[c]] are views held (released in dealloc) */
    int ready;          /* built whole */
} Lane;

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static void lane_release(Lane *self) {
    self->ready = 0;
    for (int c = 0; c < 2; c++) {
        for (Py_ssize_t i = 0; i < self->held[c]; i++)
            PyBuffer_Release(&self->rows[c][i]);
        self->held[c] = 0;
    }
}

static int lane_init(Lane *self, PyObject *args, PyObject *kw) {
    unsigned func_id;
    Py_ssize_t max_batch;
    PyObject *sizes, *rows;
    Py_buffer classes;
    lane_release(self);
    if (!PyArg_ParseTuple(args, "IO!ny*O!", &func_id, &PyList_Type, &sizes, &max_batch, &classes, &PyList_Type, &rows))
        return -1;
    int ok = classes.len == 256;
    if (ok)
        memcpy(self->classes, classes.buf, 256);
    PyBuffer_Release(&classes);
    Py_ssize_t n = PyList_GET_SIZE(sizes);
    if (!ok || n < 1 || n > MAX_INPUTS || max_batch < 1 || func_id > 0xffff || PyList_GET_SIZE(rows) != 2) {
        PyErr_SetString(PyExc_ValueError, "Lane: bad func_id, sizes, max_batch, classes or rows");
        return -1;
    }
    self->func_id = func_id;
    self->ninputs = n;
    self->max_batch = max_batch;
    self->per = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(sizes, i));
        if (s < 1) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Lane: an input's bytes per sample must be positive");
            return -1;
        }
        self->sizes[i] = s;
        self->per += s;
    }
    for (int c = 0; c < 2; c++) {
        PyObject *bufs = PyList_GET_ITEM(rows, c);
        if (!PyList_Check(bufs) || PyList_GET_SIZE(bufs) != n) {
            PyErr_SetString(PyExc_ValueError, "Lane: rows must hold one buffer per input for each class");
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_buffer *b = &self->rows[c][i];
            if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, i), b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                return -1;
            self->held[c] = i + 1;
            if (b->len < max_batch * self->sizes[i]) {
                PyErr_SetString(PyExc_ValueError, "Lane: a batch buffer is shorter than max_batch samples");
                return -1;
            }
        }
    }
    self->ready = 1;
    return 0;
}

static void lane_dealloc(Lane *self) {
    lane_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *lane_take(Lane *self, PyObject *args) {
    Py_buffer st;
    Py_ssize_t n, row[2];
    if (!PyArg_ParseTuple(args, "y*nnn", &st, &n, &row[0], &row[1]))
        return NULL;
    if (!self->ready || n < 0 || n > st.len) {
        PyBuffer_Release(&st);
        PyErr_SetString(PyExc_ValueError, "Lane.take: not initialised, or n outside the stage");
        return NULL;
    }
    const unsigned char *h = st.buf;
    PyObject *out = Py_None;
    Py_INCREF(out);
    if (n < HEADER_SIZE || memcmp(h, "SPRC", 4) != 0 || h[4] != VERSION || h[5] != KIND_REQUEST)
        goto done;
    uint64_t payload_len = le(h + 32, 4);
    if (payload_len == 0 || payload_len > MAX_PAYLOAD || (Py_ssize_t)payload_len != n - HEADER_SIZE ||
        le(h + 16, 2) != self->func_id || le(h + 18, 2) != 0 || le(h + 20, 2) != 1 ||
        payload_len % (uint64_t)self->per != 0)
        goto done;
    Py_ssize_t count = (Py_ssize_t)(payload_len / (uint64_t)self->per);
    int c = self->classes[h[7]];
    if (count > self->max_batch || c == NO_CLASS || row[c] < 0 || row[c] + count > self->max_batch)
        goto done;
    const unsigned char *src = h + HEADER_SIZE;
    for (Py_ssize_t i = 0; i < self->ninputs; i++) { /* the payload lays the inputs out one after the other */
        Py_ssize_t k = count * self->sizes[i];
        memcpy((char *)self->rows[c][i].buf + row[c] * self->sizes[i], src, (size_t)k);
        src += k;
    }
    Py_DECREF(out);
    out = Py_BuildValue("(KinKK)", (unsigned long long)le(h + 8, 8), c, count, (unsigned long long)le(h + 24, 8),
                        (unsigned long long)le(h + 56, 8));
done:
    PyBuffer_Release(&st);
    return out;
}

static PyMethodDef lane_methods[] = {
    {"take", (PyCFunction)lane_take, METH_VARARGS,
     "take(stage, n, rt_row, be_row) -> (req_id, class, count, deadline_us, slo_us), or None to leave the bytes "
     "to the Python path."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "splitserve._directlane.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A direct endpoint's compiled intake of plain one-frame reads (see the module's source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "splitserve._directlane",
                                    "A worker's direct endpoint: the per-call intake, compiled.", -1, NULL};

PyMODINIT_FUNC PyInit__directlane(void) {
    if (PyType_Ready(&LaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
