/* A worker's direct endpoint, its per-call steps compiled (splitserve/worker/direct.py):
   the read and intake of a plain call and the answers of a batch.

   ``Lane(func_id, sizes, max_batch, classes, rows, out_sizes, out_rows, words, page, offset,
   slots, received, admit)`` is built once per endpoint: the model's func_id, each input's
   bytes per sample, its max_batch_size, the class each header ``cls`` byte runs in (a bytes
   of 256: 0 real-time, 1 best-effort, 255 for a class the Python path must answer: unknown,
   or refused in rt-only mode) and, per class, the writable batch buffers of the inputs
   (``rows[class][input]``, each ``max_batch`` samples long); then each output's bytes per
   sample and, per class, its answer rows (``out_rows[class][output]``, where a batch's
   outputs are copied); then the worker's counters (``WorkerCounters.lane_counts``): their
   words (a writable int64 buffer, native order), the page they are copied into at
   ``offset``, the eight words a batch's answers count, the RECEIVED word, the ADMIT
   word (the front end's, read in the page), where in the page the batches are counted
   by size (``counters.SIZES_OFFSET``: per size 1..max_batch, a count and the ns they ran),
   and where the answered calls are counted per class (``counters.CALLS_OFFSET``, a block of
   ``CALL_WORDS`` words per class whose first eight are ``counters.CallWord``'s: calls,
   samples, their durations, queue waits, input, model and output times, counted, then the
   time the last was answered, set), then where their durations are binned
   (``counters.DURATIONS_OFFSET``: per class, for each ``counters.Duration`` a count per bin
   of the bounds given, ``counters.DURATION_BOUNDS_NS``, and one past them).

   bind(call_type, classes, placed, next_row, complete, flat, sizes, slo_us, max_in_flight,
        out_high_water, max_calls=0)
       Where ``intake`` records the calls it takes, as ``DirectServer`` keeps them: the
       call record's type (called as ``_Call(conn, req_id, cls, count, total, deadline_us,
       t_rx_ns, slo_us)``), the two classes' objects, and per class (lists indexed by the
       class) the placed calls, the next free row and the count of complete calls; each
       class's row buffers and the inputs' sizes (what ``_Call.place`` sets); the model's
       SLO for calls that name none; the connection limits of ``_Conn._over_bounds``; the
       calls a class's batch may hold (0: as many as its rows take; 1 for the batching
       policy ``none``): a class that holds that many has no room for a call here.

   intake(conn, be_open) -> (n, pause) | n
       One read of ``conn`` (a ``_Conn`` with an empty stage, between frames) into its
       stage. When the read is one plain call for this model (``take``'s rules; best-effort
       rows only while ``be_open``) and its req_id is not in flight on the connection, the
       call is recorded as ``DirectServer`` records an accepted call (its record in its
       class's placed calls with its rows, the class's next row and complete count moved
       on, the req_id in ``conn.ids``, RECEIVED and its class's in-flight word counted and
       in the page) and ``(n, pause)`` returned, ``pause`` when the connection is now over
       its bounds. Else the bytes read, for the frame state machine (0: nothing to read
       now; -1: the peer closed or the read failed).

   take(stage, n, rt_row, be_row) -> (req_id, class, count, deadline_us, slo_us) | None
       ``intake``'s check and copy alone (no socket, no record). ``stage[0:n]`` is what one
       read of a connection brought. When it is exactly one
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
   would have accepted with the same fields and rows.

   outputs(class, n, acts) -> bool
       A batch of ``n`` samples of ``class`` ran: each of its outputs (``acts``, the model's
       tensors) that is CPU memory of its declared dtype and ``n`` samples' bytes, C-contiguous
       (what its ``numpy()`` view shows), is copied into the class's answer rows; once an
       output's dtype passed that way, later tensors of it are copied from their own memory
       (``data_ptr``, after the same checks read from the tensor) with no view made. False,
       and perhaps some copied, when one is not (on a GPU, another dtype or size, needing
       grad): the caller then converts them all, which also says what is wrong with them.

   finish(calls, class, n, t0_ns, t1_ns, t2_ns) -> [(conn, rest)]
       A batch of ``n`` rows of ``class`` (0 real-time, 1 best-effort: its index here is the
       protocol's class byte) ran from ``t0_ns`` to ``t1_ns`` and its outputs are in the
       answer rows. Its answers are packed: the RESPONSE header of each of ``calls``
       (``_Call`` objects, row order) as ``protocol.header.pack_response_into`` would, stamped
       at ``t2_ns``; each call's req_id leaves its
       connection's ``ids``; a call whose connection is closed is dropped (no answer), one
       with an SLO is met or missed by ``slo.slo_outcome``'s rule. They are counted as
       ``WorkerCounters.answered`` and ``calls_answered`` count them (the batch's size and the
       calls' samples and times too), and the words copied into the page, before
       any leaves: a client that has its answer must find it counted. Then they leave: each
       connection's, in the batch's order, in one gather write (``sendmsg``, MSG_DONTWAIT, at
       most IOV_MAX buffers a write) of the headers and the calls' answer rows. What a
       connection's socket did not take, or all of it when the connection already has bytes
       waiting to go (``out``) or its write failed, is returned as bytes for the
       connection's own ``send``, which queues it, waits for the socket or closes the
       connection as the Python path does. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define HEADER_SIZE 64
#define VERSION 1
#define KIND_REQUEST 1
#define MAX_PAYLOAD (1u << 30) /* protocol.header.MAX_PAYLOAD */
#define MAX_INPUTS 64
#define NO_CLASS 255
#define KIND_RESPONSE 2
#define IOV_MAX_ 1024 /* Linux's IOV_MAX: a sendmsg takes at most this many buffers */
#define CALL_COUNTED 7 /* the words of a class's call block an answered call counts (counters.CallWord) */
#define CALL_LAST_MS 7 /* then the one it sets: when it was answered, ms since the epoch */
#define MAX_BOUNDS 32 /* the duration bins' bounds a Lane takes at most */
#define DURATIONS 3 /* the durations binned per class (counters.Duration): request, queue, compute */

/* One packed answer: its connection (a reference held until it is sent), its socket, rows and header */
typedef struct {
    PyObject *conn;
    int fd;
    Py_ssize_t row, count;
} Answer;

typedef struct {
    PyObject_HEAD
    unsigned func_id;
    Py_ssize_t ninputs, per, max_batch;
    Py_ssize_t sizes[MAX_INPUTS];
    unsigned char classes[256];
    Py_buffer rows[2][MAX_INPUTS];
    Py_ssize_t held[2]; /* rows[c][0:held[c]] are views held (released in dealloc) */
    Py_ssize_t nout, out_per;
    Py_ssize_t out_sizes[MAX_INPUTS];
    Py_buffer out_rows[2][MAX_INPUTS];
    Py_ssize_t out_held[2];
    PyObject *out_formats; /* each output's struct format as its answer rows' buffer gives it (a tuple of str) */
    PyObject *out_dtype[MAX_INPUTS]; /* each output's torch dtype, once a tensor of it was copied through numpy */
    Py_buffer words;       /* the worker's counter words (int64, native order), held while built */
    int words_held;
    PyObject *page;        /* the page they are copied into after a batch (its buffer taken per batch) */
    Py_ssize_t page_offset;
    Py_ssize_t slot[8];    /* in-flight RT, in-flight BE, answered, busy ns, batches, samples, SLO met, missed */
    Py_ssize_t w_received, w_admit; /* RECEIVED in the words; ADMIT in the page (the front end's) */
    Py_ssize_t sizes_offset; /* the batches by size in the page: size n's count and ns at 16 * (n - 1) */
    Py_ssize_t calls_offset, call_words; /* the answered calls in the page: a block of call_words per class */
    Py_ssize_t durations_offset, nbounds; /* their durations' bins in the page: DURATIONS * (nbounds + 1) per class */
    int64_t bounds[MAX_BOUNDS];             /* a bin's upper bound (ns, inclusive), ascending */
    int64_t bins[DURATIONS * (MAX_BOUNDS + 1)]; /* the batch being answered: its calls' bins */
    /* ``bind``: where ``intake`` records a call (see there) */
    PyObject *call_type, *class_objs, *placed, *next_row, *complete, *flat, *sizes_list;
    unsigned long long slo_default_us;
    Py_ssize_t max_in_flight, out_high_water, max_calls;
    unsigned char *headers; /* max_batch answers' headers */
    Answer *answers;        /* the packed batch's answers (max_batch) */
    Py_ssize_t nanswers;
    int answer_class;
    struct iovec *iov; /* one connection's answers in a write: max_batch * (1 + nout) */
    int ready;         /* built whole */
} Lane;

static PyObject *s_conn, *s_req_id, *s_row, *s_count, *s_t_rx_ns, *s_slo_ns, *s_closed, *s_ids, *s_fd, *s_out, *s_stage,
    *s_flat, *s_sizes, *s_got;

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static void put_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++, v >>= 8)
        p[i] = (unsigned char)v;
}

static void answers_release(Lane *self) {
    for (Py_ssize_t i = 0; i < self->nanswers; i++)
        Py_CLEAR(self->answers[i].conn);
    self->nanswers = 0;
}

static void lane_release(Lane *self) {
    self->ready = 0;
    answers_release(self);
    for (int c = 0; c < 2; c++) {
        for (Py_ssize_t i = 0; i < self->held[c]; i++)
            PyBuffer_Release(&self->rows[c][i]);
        self->held[c] = 0;
        for (Py_ssize_t i = 0; i < self->out_held[c]; i++)
            PyBuffer_Release(&self->out_rows[c][i]);
        self->out_held[c] = 0;
    }
    Py_CLEAR(self->out_formats);
    for (Py_ssize_t o = 0; o < MAX_INPUTS; o++)
        Py_CLEAR(self->out_dtype[o]);
    if (self->words_held)
        PyBuffer_Release(&self->words);
    self->words_held = 0;
    Py_CLEAR(self->page);
    Py_CLEAR(self->call_type);
    Py_CLEAR(self->class_objs);
    Py_CLEAR(self->placed);
    Py_CLEAR(self->next_row);
    Py_CLEAR(self->complete);
    Py_CLEAR(self->flat);
    Py_CLEAR(self->sizes_list);
    PyMem_Free(self->headers);
    PyMem_Free(self->answers);
    PyMem_Free(self->iov);
    self->headers = NULL;
    self->answers = NULL;
    self->iov = NULL;
}

/* ``bufs[c][i]`` (a list per class of one writable buffer per size) into ``views``, each at
   least ``max_batch`` samples of ``sizes[i]``; ``held`` counts the views taken. */
static int take_rows(PyObject *bufs_by_class, Py_ssize_t n, const Py_ssize_t *sizes, Py_ssize_t max_batch,
                     Py_buffer views[2][MAX_INPUTS], Py_ssize_t held[2], const char *what) {
    if (!PyList_Check(bufs_by_class) || PyList_GET_SIZE(bufs_by_class) != 2) {
        PyErr_Format(PyExc_ValueError, "Lane: %s must hold a list for each of the two classes", what);
        return -1;
    }
    for (int c = 0; c < 2; c++) {
        PyObject *bufs = PyList_GET_ITEM(bufs_by_class, c);
        if (!PyList_Check(bufs) || PyList_GET_SIZE(bufs) != n) {
            PyErr_Format(PyExc_ValueError, "Lane: %s must hold one buffer per tensor for each class", what);
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_buffer *b = &views[c][i];
            if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, i), b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                return -1;
            held[c] = i + 1;
            if (b->len < max_batch * sizes[i]) {
                PyErr_Format(PyExc_ValueError, "Lane: a buffer of %s is shorter than max_batch samples", what);
                return -1;
            }
        }
    }
    return 0;
}

/* A list of positive sizes into ``out``; their count, or -1 with an exception set. */
static Py_ssize_t take_sizes(PyObject *sizes, Py_ssize_t *out, Py_ssize_t *total) {
    Py_ssize_t n = PyList_GET_SIZE(sizes);
    if (n < 1 || n > MAX_INPUTS) {
        PyErr_SetString(PyExc_ValueError, "Lane: between 1 and 64 tensors a side");
        return -1;
    }
    *total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(sizes, i));
        if (s < 1) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Lane: a tensor's bytes per sample must be positive");
            return -1;
        }
        out[i] = s;
        *total += s;
    }
    return n;
}

static int lane_init(Lane *self, PyObject *args, PyObject *kw) {
    unsigned func_id;
    Py_ssize_t max_batch;
    PyObject *sizes, *rows, *out_sizes, *out_rows, *page, *slots, *bounds;
    Py_ssize_t page_offset;
    Py_buffer classes;
    lane_release(self);
    if (!PyArg_ParseTuple(args, "IO!ny*OO!Ow*OnO!nnnnnnO!", &func_id, &PyList_Type, &sizes, &max_batch, &classes,
                          &rows, &PyList_Type, &out_sizes, &out_rows, &self->words, &page, &page_offset, &PyTuple_Type,
                          &slots, &self->w_received, &self->w_admit, &self->sizes_offset, &self->calls_offset,
                          &self->call_words, &self->durations_offset, &PyTuple_Type, &bounds))
        return -1;
    self->words_held = 1;
    Py_INCREF(page);
    self->page = page;
    self->page_offset = page_offset;
    Py_ssize_t nwords = self->words.len / 8;
    if (self->words.len % 8 != 0 || page_offset < 0 || PyTuple_GET_SIZE(slots) != 8 || self->w_received < 0 ||
        self->w_received >= nwords || self->w_admit < nwords || self->sizes_offset < 0 || self->sizes_offset % 8 ||
        self->calls_offset < 0 || self->calls_offset % 8 || self->call_words <= CALL_LAST_MS ||
        self->durations_offset < 0 || self->durations_offset % 8 || PyTuple_GET_SIZE(bounds) > MAX_BOUNDS) {
        PyBuffer_Release(&classes);
        PyErr_SetString(PyExc_ValueError, "Lane: words must be int64, with eight slots and an offset in the page");
        return -1;
    }
    self->nbounds = PyTuple_GET_SIZE(bounds);
    for (Py_ssize_t i = 0; i < self->nbounds; i++) {
        long long b = PyLong_AsLongLong(PyTuple_GET_ITEM(bounds, i));
        if ((b == -1 && PyErr_Occurred()) || (i > 0 && b <= self->bounds[i - 1])) {
            PyBuffer_Release(&classes);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Lane: the duration bounds must be ascending integers");
            return -1;
        }
        self->bounds[i] = b;
    }
    for (int i = 0; i < 8; i++) {
        Py_ssize_t w = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots, i));
        if (w < 0 || w >= nwords) {
            PyBuffer_Release(&classes);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Lane: a counter slot outside the words");
            return -1;
        }
        self->slot[i] = w;
    }
    int ok = classes.len == 256;
    if (ok)
        memcpy(self->classes, classes.buf, 256);
    PyBuffer_Release(&classes);
    if (!ok || max_batch < 1 || max_batch > (1 << 20) || func_id > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "Lane: bad func_id, max_batch or classes");
        return -1;
    }
    self->func_id = func_id;
    self->max_batch = max_batch;
    if ((self->ninputs = take_sizes(sizes, self->sizes, &self->per)) < 0 ||
        (self->nout = take_sizes(out_sizes, self->out_sizes, &self->out_per)) < 0)
        return -1;
    if (take_rows(rows, self->ninputs, self->sizes, max_batch, self->rows, self->held, "rows") < 0 ||
        take_rows(out_rows, self->nout, self->out_sizes, max_batch, self->out_rows, self->out_held, "out_rows") < 0)
        return -1;
    if ((self->out_formats = PyTuple_New(self->nout)) == NULL)
        return -1;
    for (Py_ssize_t o = 0; o < self->nout; o++) {
        Py_buffer b;
        PyObject *f;
        PyObject *rows0 = PyList_GET_ITEM(PyList_GET_ITEM(out_rows, 0), o);
        if (PyObject_GetBuffer(rows0, &b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        f = PyUnicode_FromString(b.format != NULL ? b.format : "B");
        PyBuffer_Release(&b);
        if (f == NULL)
            return -1;
        PyTuple_SET_ITEM(self->out_formats, o, f);
    }
    self->headers = PyMem_Calloc((size_t)max_batch, HEADER_SIZE);
    self->answers = PyMem_Calloc((size_t)max_batch, sizeof(Answer));
    self->iov = PyMem_Calloc((size_t)(max_batch * (1 + self->nout)), sizeof(struct iovec));
    if (self->headers == NULL || self->answers == NULL || self->iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void lane_dealloc(Lane *self) {
    lane_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A plain REQUEST taken into its class's rows (see ``take``) */
typedef struct {
    unsigned long long req_id, deadline_us, slo_us;
    int c;
    Py_ssize_t count, total;
} Taken;

/* ``take``'s rules over ``h[0:n]``: 1 with ``t`` filled and the payload in its rows, 0 when declined */
static int take_frame(Lane *self, const unsigned char *h, Py_ssize_t n, const Py_ssize_t row[2], Taken *t) {
    if (n < HEADER_SIZE || memcmp(h, "SPRC", 4) != 0 || h[4] != VERSION || h[5] != KIND_REQUEST)
        return 0;
    uint64_t payload_len = le(h + 32, 4);
    if (payload_len == 0 || payload_len > MAX_PAYLOAD || (Py_ssize_t)payload_len != n - HEADER_SIZE ||
        le(h + 16, 2) != self->func_id || le(h + 18, 2) != 0 || le(h + 20, 2) != 1 ||
        payload_len % (uint64_t)self->per != 0)
        return 0;
    Py_ssize_t count = (Py_ssize_t)(payload_len / (uint64_t)self->per);
    int c = self->classes[h[7]];
    if (count > self->max_batch || c == NO_CLASS || row[c] < 0 || row[c] + count > self->max_batch)
        return 0;
    const unsigned char *src = h + HEADER_SIZE;
    for (Py_ssize_t i = 0; i < self->ninputs; i++) { /* the payload lays the inputs out one after the other */
        Py_ssize_t k = count * self->sizes[i];
        memcpy((char *)self->rows[c][i].buf + row[c] * self->sizes[i], src, (size_t)k);
        src += k;
    }
    t->req_id = le(h + 8, 8);
    t->deadline_us = le(h + 24, 8);
    t->slo_us = le(h + 56, 8);
    t->c = c;
    t->count = count;
    t->total = (Py_ssize_t)payload_len;
    return 1;
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
    Taken t;
    int taken = take_frame(self, st.buf, n, row, &t);
    PyBuffer_Release(&st);
    if (!taken)
        Py_RETURN_NONE;
    return Py_BuildValue("(KinKK)", t.req_id, t.c, t.count, t.deadline_us, t.slo_us);
}

/* An int attribute of ``obj`` (0 with an exception set when it is missing or not an int) */
static long long int_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return 0;
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return x;
}

static PyObject *lane_bind(Lane *self, PyObject *args) {
    PyObject *call_type, *class_objs, *placed, *next_row, *complete, *flat, *sizes;
    unsigned long long slo_us;
    Py_ssize_t max_in_flight, out_high_water, max_calls = 0;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!O!Knn|n", &call_type, &PyTuple_Type, &class_objs, &PyList_Type, &placed,
                          &PyList_Type, &next_row, &PyList_Type, &complete, &PyList_Type, &flat, &PyList_Type, &sizes,
                          &slo_us, &max_in_flight, &out_high_water, &max_calls))
        return NULL;
    if (!self->ready || !PyCallable_Check(call_type) || PyTuple_GET_SIZE(class_objs) != 2 ||
        PyList_GET_SIZE(placed) != 2 || PyList_GET_SIZE(next_row) != 2 || PyList_GET_SIZE(complete) != 2 ||
        PyList_GET_SIZE(flat) != 2 || max_in_flight < 1 || max_calls < 0) {
        PyErr_SetString(PyExc_ValueError, "Lane.bind: not initialised, or not two of each per class");
        return NULL;
    }
    PyObject **fields[] = {&self->call_type, &self->class_objs, &self->placed, &self->next_row,
                           &self->complete, &self->flat, &self->sizes_list};
    PyObject *values[] = {call_type, class_objs, placed, next_row, complete, flat, sizes};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        Py_INCREF(values[i]);
        Py_XSETREF(*fields[i], values[i]);
    }
    self->slo_default_us = slo_us;
    self->max_in_flight = max_in_flight;
    self->out_high_water = out_high_water;
    self->max_calls = max_calls;
    Py_RETURN_NONE;
}

/* ``list[i] += delta`` for a list of ints; -1 on an error */
static int list_add(PyObject *list, Py_ssize_t i, Py_ssize_t delta) {
    Py_ssize_t v = PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromSsize_t(v + delta);
    return nv == NULL ? -1 : PyList_SetItem(list, i, nv);
}

/* The words into the page (as ``WorkerCounters.flush``), and the ADMIT word read there; a
   batch of ``size`` rows (0: none) that ran ``ns`` counted by its size first, and its
   answered calls (``calls``: CALL_COUNTED words to add to class ``c``'s block, and
   ``bins`` to its duration bins; NULL: none) (the page's sizes, calls and bins are their
   only record: the worker is their one writer) */
static int write_words(Lane *self, int64_t *admit, Py_ssize_t size, int64_t ns, int c, const int64_t *calls) {
    Py_buffer page;
    if (PyObject_GetBuffer(self->page, &page, PyBUF_WRITABLE) < 0)
        return -1;
    Py_ssize_t nbins = DURATIONS * (self->nbounds + 1);
    int ok = self->page_offset + 8 * (self->w_admit + 1) <= page.len &&
             self->sizes_offset + 16 * self->max_batch <= page.len &&
             self->calls_offset + 16 * self->call_words <= page.len &&
             self->durations_offset + 16 * nbins <= page.len;
    if (ok) {
        if (size > 0) {
            int64_t *by_size = (int64_t *)((char *)page.buf + self->sizes_offset) + 2 * (size - 1);
            by_size[0] += 1;
            by_size[1] += ns;
        }
        if (calls != NULL) {
            int64_t *block = (int64_t *)((char *)page.buf + self->calls_offset) + c * self->call_words;
            for (int i = 0; i < CALL_COUNTED; i++)
                block[i] += calls[i];
            if (calls[0] > 0) {
                struct timespec now;
                clock_gettime(CLOCK_REALTIME, &now); /* time.time_ns()'s clock */
                block[CALL_LAST_MS] = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
            }
            int64_t *bins = (int64_t *)((char *)page.buf + self->durations_offset) + c * nbins;
            for (Py_ssize_t i = 0; i < nbins; i++)
                bins[i] += self->bins[i];
        }
        memcpy((char *)page.buf + self->page_offset, self->words.buf, (size_t)self->words.len);
        if (admit != NULL)
            memcpy(admit, (char *)page.buf + self->page_offset + 8 * self->w_admit, 8);
    }
    PyBuffer_Release(&page);
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "Lane: the counters do not fit the page");
    return ok ? 0 : -1;
}

/* The call ``t`` (its payload already in its rows) recorded as ``DirectServer`` records an
   accepted call: a ``call_type`` object in its class's placed calls, the class's next row
   and complete count moved on, its req_id in the connection's ``ids``, RECEIVED and its
   class's in-flight word counted and in the page. 1 when the connection is now over its
   bounds (the caller pauses it), 0 when not, -1 on an error. */
static int record(Lane *self, PyObject *conn, PyObject *ids, PyObject *req, const Taken *t, Py_ssize_t row) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns()'s clock */
    long long t_rx = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    int c = t->c;
    PyObject *call = PyObject_CallFunction(self->call_type, "OOOnnKLK", conn, req,
                                           PyTuple_GET_ITEM(self->class_objs, c),
                                           t->count, t->total, t->deadline_us, t_rx,
                                           t->slo_us ? t->slo_us : self->slo_default_us);
    if (call == NULL)
        return -1;
    /* its rows (``_Call.place``) and its whole payload, then the class's state */
    PyObject *row_obj = PyLong_FromSsize_t(row), *total = PyLong_FromSsize_t(t->total);
    int r = row_obj == NULL || total == NULL || PyObject_SetAttr(call, s_row, row_obj) < 0 ||
                    PyObject_SetAttr(call, s_flat, PyList_GET_ITEM(self->flat, c)) < 0 ||
                    PyObject_SetAttr(call, s_sizes, self->sizes_list) < 0 || PyObject_SetAttr(call, s_got, total) < 0 ||
                    list_add(self->next_row, c, t->count) < 0 ||
                    PyList_Append(PyList_GET_ITEM(self->placed, c), call) < 0 || list_add(self->complete, c, 1) < 0 ||
                    PySet_Add(ids, req) < 0
                ? -1
                : 0;
    Py_XDECREF(row_obj);
    Py_XDECREF(total);
    Py_DECREF(call);
    if (r < 0)
        return -1;
    int64_t *w = self->words.buf, admit = 0;
    w[self->w_received] += 1;
    w[self->slot[c]] += 1;
    if (write_words(self, &admit, 0, 0, 0, NULL) < 0)
        return -1;
    if (PySet_GET_SIZE(ids) >= self->max_in_flight || w[self->slot[0]] + w[self->slot[1]] >= admit)
        return 1;
    PyObject *out = PyObject_GetAttr(conn, s_out);
    Py_ssize_t waiting = out == NULL ? -1 : PyObject_Length(out);
    Py_XDECREF(out);
    return waiting < 0 ? -1 : waiting > self->out_high_water;
}

static PyObject *lane_intake(Lane *self, PyObject *args) {
    PyObject *conn;
    int be_open;
    if (!PyArg_ParseTuple(args, "Op", &conn, &be_open))
        return NULL;
    if (self->call_type == NULL) {
        PyErr_SetString(PyExc_ValueError, "Lane.intake: not bound (bind)");
        return NULL;
    }
    long long fd = int_attr(conn, s_fd);
    if (PyErr_Occurred())
        return NULL;
    PyObject *stage = PyObject_GetAttr(conn, s_stage);
    if (stage == NULL)
        return NULL;
    Py_buffer st;
    if (PyObject_GetBuffer(stage, &st, PyBUF_WRITABLE) < 0) {
        Py_DECREF(stage);
        return NULL;
    }
    ssize_t n;
    do
        n = recv((int)fd, st.buf, (size_t)st.len, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    PyObject *out = NULL;
    if (n <= 0) { /* nothing now, or the peer closed or the read failed */
        out = PyLong_FromLong(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1);
        goto done;
    }
    Py_ssize_t row[2] = {PyLong_AsSsize_t(PyList_GET_ITEM(self->next_row, 0)),
                         be_open ? PyLong_AsSsize_t(PyList_GET_ITEM(self->next_row, 1)) : -1};
    if (PyErr_Occurred())
        goto done;
    for (int c = 0; c < 2; c++) /* a batch that holds its most calls has no room (the policy ``none``: one) */
        if (self->max_calls && PyList_GET_SIZE(PyList_GET_ITEM(self->placed, c)) >= self->max_calls)
            row[c] = -1;
    Taken t;
    if (!take_frame(self, st.buf, n, row, &t)) {
        out = PyLong_FromSsize_t(n);
        goto done;
    }
    PyObject *req = PyLong_FromUnsignedLongLong(t.req_id), *ids = PyObject_GetAttr(conn, s_ids);
    int dup = req == NULL || ids == NULL ? -1 : PySet_Contains(ids, req);
    if (dup == 0) {
        int pause = record(self, conn, ids, req, &t, row[t.c]);
        if (pause >= 0)
            out = Py_BuildValue("(nO)", (Py_ssize_t)n, pause ? Py_True : Py_False);
    } else if (dup == 1) { /* the frame state machine answers the duplicate (the rows it filled were free) */
        out = PyLong_FromSsize_t(n);
    }
    Py_XDECREF(req);
    Py_XDECREF(ids);
done:
    PyBuffer_Release(&st);
    Py_DECREF(stage);
    return out;
}

static PyObject *s_numpy, *s_dtype, *s_is_cpu, *s_requires_grad, *s_is_contiguous, *s_is_neg, *s_is_conj, *s_nbytes,
    *s_data_ptr;

/* ``y.name`` (``call``: ``y.name()``) is the object ``want``; 0 when not or on an error (cleared). */
static int attr_is(PyObject *y, PyObject *name, int call, PyObject *want) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(y, name) : PyObject_GetAttr(y, name);
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = v == want;
    Py_DECREF(v);
    return same;
}

/* ``y.name()`` as a non-negative integer; -1 when it is not one or on an error (cleared). */
static long long attr_int(PyObject *y, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(y, name) : PyObject_GetAttr(y, name);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    long long x = PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        PyErr_Clear();
    return x;
}

/* Output ``o`` straight from the tensor's memory, without a numpy view, once a tensor of the
   same dtype object went through one (so the dtype is the declared one): 1 when ``y`` is a
   dense CPU tensor of that dtype, contiguous, of the batch's size, needing no grad, with no
   lazy negation or conjugation pending; 0 when not (the numpy way decides). A numpy view is
   an array made and freed per output, and right after the model its code runs cold. */
static int output_from_tensor(Lane *self, int c, Py_ssize_t o, Py_ssize_t n, PyObject *y) {
    if (self->out_dtype[o] == NULL || !attr_is(y, s_dtype, 0, self->out_dtype[o]) ||
        !attr_is(y, s_is_cpu, 0, Py_True) || !attr_is(y, s_requires_grad, 0, Py_False) ||
        !attr_is(y, s_is_contiguous, 1, Py_True) || !attr_is(y, s_is_neg, 1, Py_False) ||
        !attr_is(y, s_is_conj, 1, Py_False) || attr_int(y, s_nbytes, 0) != n * self->out_sizes[o])
        return 0;
    long long p = attr_int(y, s_data_ptr, 1);
    if (p <= 0)
        return 0;
    memcpy(self->out_rows[c][o].buf, (const void *)(uintptr_t)p, (size_t)(n * self->out_sizes[o]));
    return 1;
}

/* Output ``o`` of a batch of ``n`` (``y``, the model's tensor) into class ``c``'s answer rows:
   1 when it was CPU memory of the declared dtype and size (copied from the tensor, or from its
   numpy view), 0 when not (the caller converts it), -1 on an error. */
static int output_to_rows(Lane *self, int c, Py_ssize_t o, Py_ssize_t n, PyObject *y) {
    if (output_from_tensor(self, c, o, n, y))
        return 1;
    PyObject *arr = PyObject_CallMethodNoArgs(y, s_numpy);
    if (arr == NULL) { /* a GPU tensor, one that needs grad, not a tensor at all: converted in Python */
        PyErr_Clear();
        return 0;
    }
    Py_buffer b;
    int r = 0;
    if (PyObject_GetBuffer(arr, &b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_DECREF(arr);
        return 0;
    }
    const char *want = PyUnicode_AsUTF8(PyTuple_GET_ITEM(self->out_formats, o));
    if (want == NULL)
        r = -1;
    else if (b.len == n * self->out_sizes[o] && b.format != NULL && strcmp(b.format, want) == 0) {
        memcpy(self->out_rows[c][o].buf, b.buf, (size_t)b.len);
        r = 1;
        if (self->out_dtype[o] == NULL) { /* the tensor way may take this dtype from now on */
            self->out_dtype[o] = PyObject_GetAttr(y, s_dtype);
            if (self->out_dtype[o] == NULL)
                PyErr_Clear();
        }
    }
    PyBuffer_Release(&b);
    Py_DECREF(arr);
    return r;
}

static PyObject *lane_outputs(Lane *self, PyObject *args) {
    int c;
    Py_ssize_t n;
    PyObject *acts;
    if (!PyArg_ParseTuple(args, "inO", &c, &n, &acts))
        return NULL;
    if (!self->ready || c < 0 || c > 1 || n < 1 || n > self->max_batch) {
        PyErr_SetString(PyExc_ValueError, "Lane.outputs: not initialised, a bad class or batch size");
        return NULL;
    }
    if (!PyTuple_Check(acts) || PyTuple_GET_SIZE(acts) != self->nout)
        Py_RETURN_FALSE;
    for (Py_ssize_t o = 0; o < self->nout; o++) {
        int r = output_to_rows(self, c, o, n, PyTuple_GET_ITEM(acts, o));
        if (r < 0)
            return NULL;
        if (r == 0)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static uint32_t us32(long long ns) { /* a header's µs field: clamped as a 32-bit count */
    if (ns <= 0)
        return 0;
    long long us = ns / 1000;
    return us > 0xffffffffLL ? 0xffffffffu : (uint32_t)us;
}

/* The bin a duration of ``ns`` counts in: the first whose bound it is at most (bisect_left) */
static Py_ssize_t bin_of(const Lane *self, int64_t ns) {
    Py_ssize_t i = 0;
    while (i < self->nbounds && ns > self->bounds[i])
        i++;
    return i;
}

/* Pack the answers of ``calls`` (see ``finish``); 0, with counts[] = answered, dropped, SLO
   met, SLO missed, the answered calls' samples, their durations and their queue waits (ns),
   or -1 with an exception set and nothing packed. */
static int pack_answers(Lane *self, PyObject *calls, int c, long long t0, long long t1, long long t2,
                        int64_t counts[7]) {
    answers_release(self);
    Py_ssize_t n = PyList_GET_SIZE(calls), dropped = 0, met = 0, missed = 0, nb = self->nbounds + 1;
    int64_t samples = 0, rx_ns = 0;
    uint32_t compute_us = us32(t1 - t0);
    memset(self->bins, 0, sizeof(int64_t) * (size_t)(DURATIONS * nb));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *call = PyList_GET_ITEM(calls, i);
        PyObject *conn = PyObject_GetAttr(call, s_conn);
        if (conn == NULL)
            goto fail;
        PyObject *req = PyObject_GetAttr(call, s_req_id), *ids = PyObject_GetAttr(conn, s_ids);
        int gone = -1;
        if (req != NULL && ids != NULL && PySet_Discard(ids, req) >= 0) {
            PyObject *closed = PyObject_GetAttr(conn, s_closed);
            if (closed != NULL) {
                gone = PyObject_IsTrue(closed);
                Py_DECREF(closed);
            }
        }
        Py_XDECREF(ids);
        unsigned long long req_id = req != NULL && gone >= 0 ? PyLong_AsUnsignedLongLong(req) : 0;
        Py_XDECREF(req);
        if (gone < 0 || PyErr_Occurred()) {
            Py_DECREF(conn);
            goto fail;
        }
        if (gone) { /* its connection closed: no answer */
            Py_DECREF(conn);
            dropped++;
            continue;
        }
        Answer *a = &self->answers[self->nanswers];
        a->conn = conn;
        self->nanswers++;
        long long fd = int_attr(conn, s_fd), row = int_attr(call, s_row), count = int_attr(call, s_count);
        long long t_rx = int_attr(call, s_t_rx_ns), slo = int_attr(call, s_slo_ns);
        if (PyErr_Occurred())
            goto fail;
        if (fd < 0 || fd > 0x7fffffff || row < 0 || count < 1 || row + count > self->max_batch) {
            PyErr_SetString(PyExc_ValueError, "Lane.finish: a call's rows or its connection's fd are out of range");
            goto fail;
        }
        a->fd = (int)fd;
        a->row = row;
        a->count = count;
        unsigned char *h = self->headers + (self->nanswers - 1) * HEADER_SIZE;
        memset(h, 0, HEADER_SIZE);
        memcpy(h, "SPRC", 4);
        h[4] = VERSION;
        h[5] = KIND_RESPONSE;
        h[7] = (unsigned char)c; /* the class index is the protocol's class byte */
        put_le(h + 8, req_id, 8);
        put_le(h + 16, self->func_id, 2);
        put_le(h + 20, 1, 2); /* one segment */
        put_le(h + 32, (uint64_t)(count * self->out_per), 4);
        put_le(h + 44, us32(t0 - t_rx), 4);
        put_le(h + 48, compute_us, 4);
        put_le(h + 52, us32(t2 - t_rx), 4);
        samples += count;
        rx_ns += t_rx;
        self->bins[bin_of(self, t2 - t_rx)]++;
        self->bins[nb + bin_of(self, t0 - t_rx)]++;
        if (slo) {
            if (t2 <= slo)
                met++;
            else
                missed++;
        }
    }
    self->answer_class = c;
    self->bins[2 * nb + bin_of(self, t2 - t0)] += self->nanswers; /* each call's batch: model run and outputs */
    counts[0] = self->nanswers;
    counts[1] = dropped;
    counts[2] = met;
    counts[3] = missed;
    counts[4] = samples;
    counts[5] = self->nanswers * t2 - rx_ns; /* each call's duration and queue wait from its header in */
    counts[6] = self->nanswers * t0 - rx_ns;
    return 0;
fail:
    answers_release(self);
    return -1;
}

/* ``iov[0:n]`` from byte ``skip`` on, as one bytes object */
static PyObject *rest_bytes(const struct iovec *iov, int n, size_t skip) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += iov[i].iov_len;
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total - skip));
    if (b == NULL)
        return NULL;
    char *dst = PyBytes_AS_STRING(b);
    for (int i = 0; i < n; i++) {
        size_t k = iov[i].iov_len;
        if (skip >= k) {
            skip -= k;
            continue;
        }
        memcpy(dst, (const char *)iov[i].iov_base + skip, k - skip);
        dst += k - skip;
        skip = 0;
    }
    return b;
}

/* One connection's ``iov[0:n]`` written as far as the socket takes it now; the bytes sent. */
static size_t write_some(int fd, struct iovec *iov, int n) {
    size_t sent = 0;
    int at = 0;
    while (at < n) {
        int k = n - at < IOV_MAX_ ? n - at : IOV_MAX_;
        struct msghdr m = {0};
        m.msg_iov = iov + at;
        m.msg_iovlen = (size_t)k;
        ssize_t r = sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            break; /* full, or failed: the connection's own send says which */
        }
        sent += (size_t)r;
        size_t want = 0;
        for (int i = at; i < at + k; i++)
            want += iov[i].iov_len;
        if ((size_t)r < want)
            break;
        at += k;
    }
    return sent;
}

/* Write the packed answers; what the sockets did not take, as [(conn, rest)] (see ``finish``). */
static PyObject *send_answers(Lane *self) {
    PyObject *rests = PyList_New(0);
    if (rests == NULL)
        return NULL;
    int c = self->answer_class;
    Py_ssize_t n = self->nanswers;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *conn = self->answers[i].conn;
        if (conn == NULL) /* gathered with an earlier answer of its connection */
            continue;
        int fd = self->answers[i].fd, k = 0;
        size_t total = 0;
        for (Py_ssize_t j = i; j < n; j++) { /* its answers, in the batch's order */
            Answer *a = &self->answers[j];
            if (a->conn != conn)
                continue;
            self->iov[k].iov_base = self->headers + j * HEADER_SIZE;
            self->iov[k++].iov_len = HEADER_SIZE;
            for (Py_ssize_t o = 0; o < self->nout; o++) {
                Py_ssize_t nb = self->out_sizes[o];
                self->iov[k].iov_base = (char *)self->out_rows[c][o].buf + a->row * nb;
                self->iov[k++].iov_len = (size_t)(a->count * nb);
            }
            total += HEADER_SIZE + (size_t)(a->count * self->out_per);
            if (j > i)
                Py_CLEAR(a->conn);
        }
        PyObject *out = PyObject_GetAttr(conn, s_out);
        Py_ssize_t waiting = out == NULL ? -1 : PyObject_Length(out);
        Py_XDECREF(out);
        if (waiting < 0)
            goto fail;
        size_t sent = waiting == 0 ? write_some(fd, self->iov, k) : 0; /* bytes waiting: these go behind them */
        if (sent < total) {
            PyObject *rest = rest_bytes(self->iov, k, sent);
            PyObject *pair = rest == NULL ? NULL : PyTuple_Pack(2, conn, rest);
            Py_XDECREF(rest);
            if (pair == NULL || PyList_Append(rests, pair) < 0) {
                Py_XDECREF(pair);
                goto fail;
            }
            Py_DECREF(pair);
        }
        Py_CLEAR(self->answers[i].conn);
    }
    self->nanswers = 0;
    return rests;
fail:
    answers_release(self);
    Py_DECREF(rests);
    return NULL;
}


static PyObject *lane_finish(Lane *self, PyObject *args) {
    PyObject *calls;
    int c;
    Py_ssize_t n;
    long long t0, t1, t2;
    if (!PyArg_ParseTuple(args, "O!inLLL", &PyList_Type, &calls, &c, &n, &t0, &t1, &t2))
        return NULL;
    if (!self->ready || c < 0 || c > 1 || n < 1 || n > self->max_batch || PyList_GET_SIZE(calls) > n) {
        PyErr_SetString(PyExc_ValueError, "Lane.finish: not initialised, a bad class or batch size, or more calls "
                                          "than rows");
        return NULL;
    }
    int64_t counts[7];
    if (pack_answers(self, calls, c, t0, t1, t2, counts) < 0)
        return NULL;
    /* counted, and in the page, before any answer leaves (WorkerCounters.answered's rule) */
    int64_t *w = self->words.buf;
    w[self->slot[c]] -= counts[0] + counts[1];
    w[self->slot[2]] += counts[0];
    w[self->slot[3]] += t1 - t0;
    w[self->slot[4]] += 1;
    w[self->slot[5]] += n;
    w[self->slot[6]] += counts[2];
    w[self->slot[7]] += counts[3];
    /* the calls (``WorkerCounters.calls_answered``): their batch's model run and output copy once per call */
    int64_t answered[CALL_COUNTED] = {counts[0], counts[4], counts[5], counts[6], 0, counts[0] * (t1 - t0),
                                      counts[0] * (t2 - t1)};
    if (write_words(self, NULL, n, t1 - t0, c, answered) < 0) {
        answers_release(self);
        return NULL;
    }
    return send_answers(self);
}

static PyMethodDef lane_methods[] = {
    {"take", (PyCFunction)lane_take, METH_VARARGS,
     "take(stage, n, rt_row, be_row) -> (req_id, class, count, deadline_us, slo_us), or None to leave the bytes "
     "to the Python path."},
    {"bind", (PyCFunction)lane_bind, METH_VARARGS,
     "bind(call_type, classes, placed, next_row, complete, flat, sizes, slo_us, max_in_flight, out_high_water, "
     "max_calls=0): where intake records the calls it takes (at most max_calls a batch; 0: no cap)."},
    {"intake", (PyCFunction)lane_intake, METH_VARARGS,
     "intake(conn, be_open) -> (n, pause) for a call taken from a read of n bytes, n for bytes left to the frame "
     "state machine, 0 for nothing now, -1 for a closed or failed connection."},
    {"outputs", (PyCFunction)lane_outputs, METH_VARARGS,
     "outputs(class, n, acts) -> bool: a batch's outputs copied into the class's answer rows when each is CPU memory "
     "of its declared dtype and size; False: the caller converts them."},
    {"finish", (PyCFunction)lane_finish, METH_VARARGS,
     "finish(calls, class, n, t0_ns, t1_ns, t2_ns) -> [(conn, rest)]: a batch's answers packed, counted and sent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "splitserve._directlane.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A direct endpoint's compiled lane: a plain call's intake and a batch's answers "
              "(see the module's source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "splitserve._directlane",
                                    "A worker's direct endpoint: the intake of a call and the answers of a "
                                    "batch, compiled.",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__directlane(void) {
    struct {
        PyObject **name;
        const char *text;
    } names[] = {{&s_conn, "conn"},     {&s_req_id, "req_id"}, {&s_row, "row"},     {&s_count, "count"},
                 {&s_t_rx_ns, "t_rx_ns"}, {&s_slo_ns, "slo_ns"}, {&s_closed, "closed"}, {&s_ids, "ids"},
                 {&s_fd, "fd"},         {&s_out, "out"},       {&s_numpy, "numpy"},   {&s_stage, "stage"},
                 {&s_flat, "flat"},     {&s_sizes, "sizes"},   {&s_got, "got"},       {&s_dtype, "dtype"},
                 {&s_is_cpu, "is_cpu"}, {&s_requires_grad, "requires_grad"}, {&s_is_contiguous, "is_contiguous"},
                 {&s_is_neg, "is_neg"}, {&s_is_conj, "is_conj"}, {&s_nbytes, "nbytes"}, {&s_data_ptr, "data_ptr"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].name = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
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
