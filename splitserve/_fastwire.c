/* The sync fast-path client's wire I/O, compiled (splitserve/client/stream.py, _CStream).

   ``Wire(capacity)`` is the receive buffer of one connected blocking stream socket, whose
   fd each method is given (the caller's socket object owns and closes it, so a closed
   socket's -1 is refused rather than a number since reused); the methods hold the GIL only
   outside the kernel:

   send(fd, parts, timeout_s) -> None
       One gather write of ``parts`` (a list of objects with a contiguous buffer: the
       64-byte header and the input arrays), finished with further writes if the kernel
       took only part. Sends take the wire's own send lock (a frame is never interleaved
       with another thread's), waited for at most ``timeout_s``.

   recv_frame(fd, timeout_s) -> (fields, payload)
       The next whole frame of the stream. The buffer keeps what was received and not yet
       parsed (one recv usually brings a whole small answer, or several); a frame's header
       is parsed there and its payload copied into a bytearray of its own (the decoded
       arrays keep it), or, when it is bigger than what is buffered, received straight into
       that bytearray. ``fields`` is the header's 17 fields in ``protocol.header.Header``'s
       positional order and by its names (a ``Fields`` struct sequence); when the header is
       malformed ``fields`` is None and ``payload`` the 64 header bytes, for the caller to
       raise ``unpack_header``'s own BadFrame from, so that both implementations say the
       same.

   call(fd, parts, timeout_s, poll_s=0.0, load=None) -> (fields, payload)
       ``send`` then ``recv_frame`` in one call, for a caller that holds the reading turn
       and has nothing else in flight: the GIL is released once for the send and the wait
       for the answer, not once for each. ``sent`` (an attribute) then says whether the
       send went out whole, so that the caller tells a failed send from a failed receive.
       With ``poll_s`` the answer's first bytes are polled for (MSG_DONTWAIT, the CPU
       yielded between tries) for up to that long before the blocking recv: the caller's
       policy (splitserve/spin.py) says when that pays. The answer's wait is then bounded by
       the timeout plus the poll (at most the timeout again: poll windows are µs to ms).
       ``load=(fd, cpus, period_s, reads)`` (``spin.HostLoad.poll_check``) ends the poll early
       once the host has a task waiting for a CPU: the runnable count of ``/proc/loadavg``
       (open at ``fd``) is read at the first try and every ``period_s`` after, and ``reads``
       reads in a row above ``cpus`` end it, as ``HostLoad`` decides; ``busy`` (an attribute) then says
       so, for the caller's policy to learn from.

   The socket stays blocking, its SO_RCVTIMEO and SO_SNDTIMEO set to ``timeout_s`` by the
   caller (protocol/sockets.py bound_waits): the first recv of a frame blocks in the kernel
   (bounded by SO_RCVTIMEO, the whole of what is left then), every other call is
   MSG_DONTWAIT and polls only when it would block, for what is left of ``timeout_s``
   (counted from the method's start). A call's send and the receive of its answer are
   then one system call each, as a bare blocking client's. Nothing a peer sends is trusted:
   lengths are checked against the buffer and the protocol's payload limit before any byte
   is read into memory. Header bytes received before an error stay buffered, as the Python
   reader's do. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HEADER_SIZE 64
#define VERSION 1
#define KIND_MAX 7              /* protocol.header.Kind: 1 .. 7 */
#define MAX_PAYLOAD (1u << 30)  /* protocol.header.MAX_PAYLOAD */
#define MAX_PARTS 64            /* a request is a header and one buffer per model input */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A system call was interrupted by a signal: run Python's handlers now (the GIL taken for
   them), as the Python wire does between its calls, so that Ctrl-C or an alarm's exception is
   not held until the timeout. 1 to go on, -3 when a handler raised (its exception set). */
static int signals_nogil(void) {
    PyGILState_STATE gil = PyGILState_Ensure();
    int r = PyErr_CheckSignals();
    PyGILState_Release(gil);
    return r < 0 ? -3 : 1;
}

/* Wait (GIL released by the caller) until ``fd`` is ready for ``events`` or ``deadline``
   passes: 0 ready, -1 timed out, -2 errno set, -3 a signal handler raised. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0)
            return -1;
        struct pollfd p = {fd, events, 0};
        int ms = left > 3.6e6 ? 3600000 : (int)(left * 1000.0) + 1;
        int r = poll(&p, 1, ms);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return -2;
        if (r < 0 && signals_nogil() < 0)
            return -3;
    }
}

/* After a recv or sendmsg that failed: 1 to try again (interrupted, or ``fd`` became ready
   for ``events``), else wait_fd's code. GIL released by the caller. */
static int retry_after(int fd, short events, double deadline) {
    if (errno == EINTR)
        return signals_nogil();
    if (errno != EAGAIN && errno != EWOULDBLOCK)
        return -2;
    int r = wait_fd(fd, events, deadline);
    return r == 0 ? 1 : r;
}

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Raise the error a failed I/O step stands for; ``r`` as wait_fd's, or 0 for a closed peer
   (-3: a signal handler's exception is set already). */
static PyObject *io_error(int r) {
    if (r == -3)
        return NULL;
    if (r == -1)
        PyErr_SetString(PyExc_TimeoutError, "timed out");
    else if (r == 0)
        PyErr_SetString(PyExc_ConnectionError, "server closed the connection");
    else
        PyErr_SetFromErrno(PyExc_OSError);
    return NULL;
}

/* Receive at least ``need`` bytes into buf[0:cap) (at most cap); returns the bytes got,
   and through *err 1, or io_error's code (-1 timeout, -2 errno, -3 a signal handler raised, 0
   closed). With ``block``
   the first recv blocks, bounded by the socket's SO_RCVTIMEO (the caller's timeout, set
   at connect): the start of an answer is rarely there yet, and a blocking recv is one
   system call where a failed recv and a poll are two. Any other recv polls for what is
   left of ``deadline`` only when it would block. Called without the GIL. */
/* How a poll watches the host (``call``'s ``load``): no fd, no watching. */
typedef struct {
    double until;  /* the poll's end (0: no poll) */
    int fd;        /* /proc/loadavg, kept open by the caller (-1: not watched) */
    int cpus;      /* runnable tasks above this: one waits for a CPU, and the poll ends */
    double period; /* seconds between two reads */
    int reads;     /* reads in a row that must find a task waiting to end the poll (spin.BUSY_READS) */
    int busy_run;  /* reads in a row that found a task waiting */
    int busy;      /* set once ``reads`` did: that ended the poll */
} Poll;

/* 1 when /proc/loadavg's runnable count (its fourth field, "runnable/total") is above
   ``cpus``, 0 when not; 1 too when it cannot be read or parsed (as spin.HostLoad). */
static int host_busy(int fd, int cpus) {
    char text[128];
    ssize_t n = pread(fd, text, sizeof text - 1, 0);
    if (n <= 0)
        return 1;
    text[n] = 0;
    char *p = text;
    for (int field = 0; field < 3; field++) { /* skip the three load averages */
        while (*p && *p != ' ')
            p++;
        while (*p == ' ')
            p++;
    }
    if (*p < '0' || *p > '9')
        return 1;
    long runnable = 0;
    while (*p >= '0' && *p <= '9' && runnable < 1000000)
        runnable = runnable * 10 + (*p++ - '0');
    return *p != '/' || runnable > cpus;
}

/* The poll goes on at ``now``: within its window and, where the host is watched, until
   ``poll->reads`` reads in a row found a task waiting for a CPU. */
static int poll_on(Poll *poll, double now, double *look_at) {
    if (now >= poll->until)
        return 0;
    if (poll->fd < 0 || now < *look_at)
        return 1;
    *look_at = now + poll->period;
    poll->busy_run = host_busy(poll->fd, poll->cpus) ? poll->busy_run + 1 : 0;
    poll->busy = poll->busy_run >= poll->reads;
    return !poll->busy;
}

static Py_ssize_t recv_nogil(int fd, char *buf, Py_ssize_t cap, Py_ssize_t need, double deadline, int block,
                             Poll *poll, int *err) {
    Py_ssize_t got = 0;
    int r = 1, flags = block ? 0 : MSG_DONTWAIT, polling = poll != NULL && poll->until > 0;
    double look_at = 0; /* the host is read at the first try that would wait */
    while (got < need) {
        if (flags == 0 && polling) { /* poll before the blocking recv, until poll->until */
            ssize_t n = recv(fd, buf + got, (size_t)(cap - got), MSG_DONTWAIT);
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                polling = poll_on(poll, now_s(), &look_at);
                if (polling)
                    sched_yield(); /* a task that waits for this CPU runs first */
                continue;
            }
            polling = 0;
            if (n > 0) {
                got += n;
                flags = MSG_DONTWAIT;
                continue;
            }
            if (n == 0) {
                r = 0;
                break;
            }
            /* an error or a signal: as after the blocking recv below */
            flags = MSG_DONTWAIT;
            r = retry_after(fd, POLLIN, deadline);
            if (r != 1)
                break;
            continue;
        }
        ssize_t n = recv(fd, buf + got, (size_t)(cap - got), flags);
        if (flags == 0 && n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) { /* SO_RCVTIMEO ran out */
            r = -1;
            break;
        }
        flags = MSG_DONTWAIT;
        if (n > 0) {
            got += n;
            continue;
        }
        if (n == 0) {
            r = 0;
            break;
        }
        r = retry_after(fd, POLLIN, deadline);
        if (r != 1)
            break;
    }
    *err = r;
    return got;
}

typedef struct {
    PyObject_HEAD
    char *buf;
    Py_ssize_t cap, start, end; /* the unparsed bytes are buf[start:end] */
    int reading;                /* a recv_frame or call is under way (the GIL may be released) */
    PyThread_type_lock send_lock; /* held for a whole frame's send, taken without the GIL */
    char sent;                  /* the last call's send went out whole */
    char busy;                  /* the last call's poll ended because a task waited for a CPU */
} Wire;

static int wire_init(Wire *self, PyObject *args, PyObject *kw) {
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "n", &cap))
        return -1;
    if (cap < HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "Wire needs at least %d bytes of buffer", HEADER_SIZE);
        return -1;
    }
    if (self->buf != NULL) { /* another thread may be reading into the buffer without the GIL */
        PyErr_SetString(PyExc_RuntimeError, "a Wire is initialised once");
        return -1;
    }
    if (self->send_lock == NULL && (self->send_lock = PyThread_allocate_lock()) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    char *buf = PyMem_Malloc((size_t)cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->buf = buf;
    self->cap = cap;
    self->start = self->end = 0;
    return 0;
}

static void wire_dealloc(Wire *self) {
    PyMem_Free(self->buf);
    if (self->send_lock != NULL)
        PyThread_free_lock(self->send_lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An fd to use: a closed socket's fileno() is -1. */
static int check_fd(int fd) {
    if (fd >= 0)
        return 0;
    errno = EBADF;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* A frame's buffers as an iovec: ``views`` hold them until release_parts; -1 with an
   exception set (none is held then). */
static Py_ssize_t gather(PyObject *parts, Py_buffer *views, struct iovec *iov) {
    Py_ssize_t n = PyList_GET_SIZE(parts);
    if (n > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "a frame is at most %d buffers, got %zd", MAX_PARTS, n);
        return -1;
    }
    for (Py_ssize_t taken = 0; taken < n; taken++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(parts, taken), &views[taken], PyBUF_SIMPLE) < 0) {
            for (Py_ssize_t i = 0; i < taken; i++)
                PyBuffer_Release(&views[i]);
            return -1;
        }
        iov[taken].iov_base = views[taken].buf;
        iov[taken].iov_len = (size_t)views[taken].len;
    }
    return n;
}

static void release_parts(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

/* Send iov[0:n) whole under the wire's send lock, both waited for until ``deadline``:
   1 sent, else wait_fd's code. Called without the GIL. */
static int send_nogil(Wire *self, int fd, struct iovec *iov, Py_ssize_t n, double deadline) {
    double left_us = (deadline - now_s()) * 1e6;
    if (left_us > (double)PY_TIMEOUT_MAX)
        left_us = (double)PY_TIMEOUT_MAX;
    if (left_us <= 0 || PyThread_acquire_lock_timed(self->send_lock, (PY_TIMEOUT_T)left_us, 0) != PY_LOCK_ACQUIRED)
        return -1;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)n;
    int r = 1;
    while (msg.msg_iovlen > 0) {
        ssize_t sent = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent < 0) {
            r = retry_after(fd, POLLOUT, deadline);
            if (r != 1)
                break;
            continue;
        }
        while (msg.msg_iovlen > 0 && (size_t)sent >= msg.msg_iov->iov_len) { /* drop the buffers that went */
            sent -= (ssize_t)msg.msg_iov->iov_len;
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (msg.msg_iovlen > 0) {
            msg.msg_iov->iov_base = (char *)msg.msg_iov->iov_base + sent;
            msg.msg_iov->iov_len -= (size_t)sent;
        }
    }
    int saved = errno; /* releasing the lock must not change what io_error reports */
    PyThread_release_lock(self->send_lock);
    errno = saved;
    return r;
}

static PyObject *wire_send(Wire *self, PyObject *args) {
    int fd;
    PyObject *parts;
    double timeout;
    if (!PyArg_ParseTuple(args, "iO!d", &fd, &PyList_Type, &parts, &timeout) || check_fd(fd) < 0)
        return NULL;
    Py_buffer views[MAX_PARTS];
    struct iovec iov[MAX_PARTS];
    Py_ssize_t n = gather(parts, views, iov);
    if (n < 0)
        return NULL;
    double deadline = now_s() + timeout;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = send_nogil(self, fd, iov, n, deadline);
    Py_END_ALLOW_THREADS
    int saved = errno;
    release_parts(views, n);
    errno = saved;
    if (r != 1)
        return io_error(r);
    Py_RETURN_NONE;
}

/* Make sure a whole header is buffered at buf[start:]: receive (blocking first) until it
   is; 1, else io_error's code. Called without the GIL. */
static int header_nogil(Wire *self, int fd, double deadline, Poll *poll) {
    int err = 1;
    if (self->end - self->start < HEADER_SIZE) {
        if (self->start + HEADER_SIZE > self->cap) { /* no room after a partial header: move it to the front */
            memmove(self->buf, self->buf + self->start, (size_t)(self->end - self->start));
            self->end -= self->start;
            self->start = 0;
        }
        self->end += recv_nogil(fd, self->buf + self->end, self->cap - self->end,
                                self->start + HEADER_SIZE - self->end, deadline, 1, poll, &err);
    }
    return err;
}

/* A header's fields by name, in protocol.header.Header's order and with its names: what
   ``call`` answers with, so that the caller reads them without building a Header. */
static PyStructSequence_Field fields_names[] = {
    {"kind", NULL}, {"req_id", NULL}, {"func_id", NULL}, {"cls", NULL}, {"flags", NULL}, {"seq_num", NULL},
    {"seg_count", NULL}, {"status", NULL}, {"deadline_us", NULL}, {"payload_len", NULL},
    {"payload_offset", NULL}, {"total_len", NULL}, {"queue_us", NULL}, {"compute_us", NULL},
    {"total_us", NULL}, {"slo_us", NULL}, {"version", NULL}, {NULL, NULL},
};
static PyStructSequence_Desc fields_desc = {"splitserve._fastwire.Fields",
                                            "An answer header's fields, by name and in Header's order.",
                                            fields_names, 17};
static PyTypeObject *FieldsType;

/* The frame whose header is buffered at buf[start:] (header_nogil), its payload read on
   until ``deadline``: (fields, payload), or (None, header bytes) for a malformed header. */
static PyObject *take_frame(Wire *self, int fd, double deadline) {
    int err;
    const unsigned char *h = (const unsigned char *)self->buf + self->start;
    uint64_t payload_len = le(h + 32, 4);
    if (memcmp(h, "SPRC", 4) != 0 || h[4] != VERSION || h[5] < 1 || h[5] > KIND_MAX || payload_len > MAX_PAYLOAD) {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)h, HEADER_SIZE);
        return raw == NULL ? NULL : Py_BuildValue("(ON)", Py_None, raw);
    }
    /* the buffer holds magic, version, kind, flags, cls, req_id, func_id, seq_num, seg_count,
       status, deadline_us, payload_len, payload_offset, total_len, queue_us, compute_us,
       total_us, slo_us (header.py's _FORMAT); Header takes them in this order */
    PyObject *fields = PyStructSequence_New(FieldsType);
    if (fields == NULL)
        return NULL;
    const uint64_t values[17] = {
        h[5],          le(h + 8, 8),  le(h + 16, 2), h[7],          h[6],          le(h + 18, 2),
        le(h + 20, 2), le(h + 22, 2), le(h + 24, 8), payload_len,   le(h + 36, 4), le(h + 40, 4),
        le(h + 44, 4), le(h + 48, 4), le(h + 52, 4), le(h + 56, 8), h[4],
    };
    for (int i = 0; i < 17; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(values[i]);
        if (v == NULL) {
            Py_DECREF(fields);
            return NULL;
        }
        PyStructSequence_SET_ITEM(fields, i, v);
    }
    Py_ssize_t n = (Py_ssize_t)payload_len;
    Py_ssize_t begin = self->start + HEADER_SIZE;
    Py_ssize_t have = self->end - begin < n ? self->end - begin : n;
    PyObject *payload = PyByteArray_FromStringAndSize(self->buf + begin, have);
    if (payload == NULL) {
        Py_DECREF(fields);
        return NULL;
    }
    /* the frame leaves the buffer now: a failure below loses this answer, as in the Python reader */
    self->start = begin + have;
    if (self->start == self->end)
        self->start = self->end = 0;
    if (have < n) { /* the rest goes straight into the payload's own buffer */
        if (PyByteArray_Resize(payload, n) < 0) {
            Py_DECREF(fields);
            Py_DECREF(payload);
            return NULL;
        }
        char *rest = PyByteArray_AS_STRING(payload) + have;
        Py_BEGIN_ALLOW_THREADS
        recv_nogil(fd, rest, n - have, n - have, deadline, 0, NULL, &err);
        Py_END_ALLOW_THREADS
        if (err != 1) {
            Py_DECREF(fields);
            Py_DECREF(payload);
            return io_error(err);
        }
    }
    return Py_BuildValue("(NN)", fields, payload);
}

/* Claim the wire's reading turn: 0, or -1 with RuntimeError set. */
static int claim(Wire *self, const char *what) {
    if (self->buf == NULL || self->reading) {
        PyErr_Format(PyExc_RuntimeError, "Wire.%s: not initialised, or another thread is reading", what);
        return -1;
    }
    self->reading = 1;
    return 0;
}

static PyObject *wire_recv_frame(Wire *self, PyObject *args) {
    int fd;
    double timeout;
    if (!PyArg_ParseTuple(args, "id", &fd, &timeout) || check_fd(fd) < 0 || claim(self, "recv_frame") < 0)
        return NULL;
    double deadline = now_s() + timeout;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = header_nogil(self, fd, deadline, NULL);
    Py_END_ALLOW_THREADS
    PyObject *out = r == 1 ? take_frame(self, fd, deadline) : io_error(r);
    self->reading = 0;
    return out;
}

static PyObject *wire_call(Wire *self, PyObject *args) {
    int fd;
    PyObject *parts;
    double timeout, poll_s = 0;
    PyObject *load = Py_None;
    Poll poll = {0, -1, 0, 0, 1, 0, 0};
    self->sent = self->busy = 0;
    if (!PyArg_ParseTuple(args, "iO!d|dO", &fd, &PyList_Type, &parts, &timeout, &poll_s, &load) ||
        check_fd(fd) < 0)
        return NULL;
    if (load != Py_None && !PyArg_ParseTuple(load, "iidi;load is (fd, cpus, period_s, reads)", &poll.fd, &poll.cpus,
                                             &poll.period, &poll.reads))
        return NULL;
    if (poll.reads < 1) {
        PyErr_SetString(PyExc_ValueError, "load's reads is at least 1");
        return NULL;
    }
    Py_buffer views[MAX_PARTS];
    struct iovec iov[MAX_PARTS];
    Py_ssize_t n = gather(parts, views, iov);
    if (n < 0)
        return NULL;
    if (claim(self, "call") < 0) {
        release_parts(views, n);
        return NULL;
    }
    /* the send and then the answer each have the whole timeout, as a send and then a
       recv_frame would */
    int r;
    double deadline = 0;
    Py_BEGIN_ALLOW_THREADS
    r = send_nogil(self, fd, iov, n, now_s() + timeout);
    if (r == 1) {
        self->sent = 1;
        double sent_at = now_s();
        deadline = sent_at + timeout;
        poll.until = poll_s > 0 ? sent_at + (poll_s < timeout ? poll_s : timeout) : 0;
        r = header_nogil(self, fd, deadline, &poll);
    }
    Py_END_ALLOW_THREADS
    self->busy = (char)poll.busy;
    int saved = errno;
    release_parts(views, n);
    errno = saved;
    PyObject *out = r == 1 ? take_frame(self, fd, deadline) : io_error(r);
    self->reading = 0;
    return out;
}

static PyMemberDef wire_members[] = {
    {"sent", T_BOOL, offsetof(Wire, sent), READONLY, "whether the last call's send went out whole"},
    {"busy", T_BOOL, offsetof(Wire, busy), READONLY,
     "whether the last call's poll ended because the host had a task waiting for a CPU"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef wire_methods[] = {
    {"send", (PyCFunction)wire_send, METH_VARARGS, "send(fd, parts, timeout_s): one gather write of parts."},
    {"recv_frame", (PyCFunction)wire_recv_frame, METH_VARARGS,
     "recv_frame(fd, timeout_s) -> (fields, payload), or (None, header bytes) for a malformed header."},
    {"call", (PyCFunction)wire_call, METH_VARARGS,
     "call(fd, parts, timeout_s, poll_s=0.0, load=None) -> recv_frame's answer, after sending parts (sent: "
     "whether they went); the answer polled for up to poll_s before the blocking wait, and not once load's "
     "host has a task waiting for a CPU."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WireType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "splitserve._fastwire.Wire",
    .tp_basicsize = sizeof(Wire),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Wire(capacity): a connected blocking socket's sends and framed receives (see _fastwire.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)wire_init,
    .tp_dealloc = (destructor)wire_dealloc,
    .tp_methods = wire_methods,
    .tp_members = wire_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "splitserve._fastwire",
                                    "The sync fast-path client's wire I/O, compiled (see _fastwire.c).", -1, NULL};

PyMODINIT_FUNC PyInit__fastwire(void) {
    if (PyType_Ready(&WireType) < 0)
        return NULL;
    if (FieldsType == NULL && (FieldsType = PyStructSequence_NewType(&fields_desc)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Wire", (PyObject *)&WireType) < 0
        || PyModule_AddObjectRef(m, "Fields", (PyObject *)FieldsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
