/* Steps: a plan of commlib.backends._plans run in C, the twin of commlib.backends._steps.Steps (the same
 * messages, stamps, checks and arithmetic; that file's docstring describes the protocol).
 *
 * Steps(plan, comm, small, tag, dtype, op, count, reducer, mismatch, block): plan is the int64 encoding of
 * Plan.encode(); comm an MPICH communicator handle; small the agreed inline size; tag a point-to-point
 * message's tag (-1: each step's own); dtype the numpy dtype of the reductions (None: none) and op their
 * stamp code; reducer(dst, srcs) reduces what this file does not (16-bit floats, bool, complex products):
 * commlib.backends._steps.reduce_into, so both executors give the same bits; mismatch(peer, stamp, got,
 * wanted, data) builds the exception for a message of another call; block the seconds go() may test without
 * the GIL. go(inp, out, seq) -> bool, start(inp, out, seq), test() -> bool, spin(seconds) -> bool | None,
 * spent(), abandon(), free(); members dtype, count and seq (what the group layer records) and state.
 *
 * Without the GIL (go()'s and spin()'s loops) only MPI calls, copies and the native reductions run; a
 * mismatch found there is remembered and raised once the GIL is back.
 */
#include "_executor.h"
#include "structmember.h"

enum { IDLE, RUNNING, ABANDONED };
enum { E_MISMATCH = -2, E_PYTHON = -3 };    /* advance()'s errors besides MPI's codes */

typedef struct {
    int peer, buf, direct;
    Py_ssize_t off, nbytes;
    char *slot;        /* inline: stamp and payload; direct: the stamp */
    Py_ssize_t cap;    /* the slot's bytes */
    char want[STAMP];  /* a receive's expected stamp (seq written each run) */
} msg_t;

typedef struct {
    int code, dbuf, sbuf, nsrc, src_at;
    Py_ssize_t doff, soff, n; /* a copy: bytes; a reduction: elements */
} act_t;

typedef struct {
    int nrecv, nsend, nearly, nafter, msg_at, act_at, tag;
    int direct; /* a message of the step goes on the caller's arrays: its early copies overlap the messages */
} step_t;

typedef void (*acc_fn)(char *restrict, const char *restrict, Py_ssize_t);

typedef struct {
    PyObject_HEAD
    handle_t comm;
    int nsteps, nmsgs, nacts, maxmsgs;
    step_t *steps;
    msg_t *msgs;
    act_t *acts;
    int *src_buf;
    Py_ssize_t *src_off;
    char *tmp;
    Py_ssize_t tmp_len, in_len, out_len, small, itemsize, count;
    acc_fn acc;         /* the native reduction (dst op= src); NULL: the Python reducer */
    int average;        /* AVG with a native sum: 4 (float32 elements) or 8 (float64) to divide by the sources */
    Py_ssize_t acc_scale; /* elements of acc's type per element (2 for complex sums) */
    int reduces;        /* the plan has reductions */
    PyObject *reducer, *mismatch, *dtype;
    PyObject *label;    /* what the record of a run go() completed says (None: nothing recorded) */
    char *preq, *dreq, *status; /* per message: its persistent request and its data request; one status */
    int *checks, nchecks;       /* receives whose stamp (or inline message) is awaited */
    int *rest, nrest, rested;   /* 2m: message m's persistent request, 2m+1: its data request; in order */
    int state, at;
    uint32_t seq;
    char *in, *out, *stage;
    Py_ssize_t stage_len;
    int spread;         /* out is the stage: spread into the root list at the end */
    PyObject *held;     /* (inp, out) while running past the call that started it */
    PyObject *cur_in, *cur_out; /* borrowed: the arguments of the go() under way (it holds them until it returns) */
    double block, spent;
    int bad_msg, bad_data; /* a mismatch found without the GIL: the message, and whether its data */
    count_t bad_got;
    int freed;          /* free() freed the persistent requests: the slots may go */
    int copy_in;        /* an input that overlaps the output is copied aside first (Plan.copy_in) */
    int copied;         /* the step's early copies are done (or are land()'s to do) */
    char *aside;        /* there */
    Py_ssize_t aside_len;
} Steps;

/* -- the native reductions: dst op= src, n elements; numpy's results bit for bit ---------------------------- */

#define ACC(name, T, EXPR)                                                                                         \
    static void name(char *restrict d_, const char *restrict s_, Py_ssize_t n)                                    \
    {                                                                                                              \
        T *restrict d = (T *)d_;                                                                                   \
        const T *restrict s = (const T *)s_;                                                                       \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                       \
            T a = d[i], b = s[i];                                                                                  \
            d[i] = (EXPR);                                                                                         \
        }                                                                                                          \
    }
/* integers: sums and products wrap (as numpy's, computed unsigned); floats: numpy's minimum/maximum (a NaN in
 * either wins; between equals, the second) */
#define INT_ACCS(S, U, T)                                                                                          \
    ACC(sum_##S, U, (U)(a + b))                                                                                    \
    ACC(prod_##S, U, (U)(a * b))                                                                                   \
    ACC(min_##S, T, a < b ? a : b)                                                                                 \
    ACC(max_##S, T, a > b ? a : b)                                                                                 \
    ACC(band_##S, U, a & b)                                                                                        \
    ACC(bor_##S, U, a | b)                                                                                         \
    ACC(bxor_##S, U, a ^ b)
INT_ACCS(i8, uint8_t, int8_t)
INT_ACCS(u8, uint8_t, uint8_t)
INT_ACCS(i16, uint16_t, int16_t)
INT_ACCS(u16, uint16_t, uint16_t)
INT_ACCS(i32, uint32_t, int32_t)
INT_ACCS(u32, uint32_t, uint32_t)
INT_ACCS(i64, uint64_t, int64_t)
INT_ACCS(u64, uint64_t, uint64_t)
#define FLOAT_ACCS(S, T)                                                                                           \
    ACC(sum_##S, T, a + b)                                                                                         \
    ACC(prod_##S, T, a * b)                                                                                        \
    ACC(min_##S, T, (a < b || a != a) ? a : b)                                                                     \
    ACC(max_##S, T, (a > b || a != a) ? a : b)
FLOAT_ACCS(f32, float)
FLOAT_ACCS(f64, double)

/* The native reduction of (numpy type number, stamp op code), and its elements per element; NULL: none. */
static acc_fn
native_acc(int type, int op, Py_ssize_t *scale)
{
    *scale = 1;
#define ARITHMETIC(S)                                                                                              \
    case O_SUM:                                                                                                    \
        return sum_##S;                                                                                            \
    case O_PRODUCT:                                                                                                \
        return prod_##S;                                                                                           \
    case O_MIN:                                                                                                    \
        return min_##S;                                                                                            \
    case O_MAX:                                                                                                    \
        return max_##S;
#define INT_CASE(NPY, S)                                                                                           \
    case NPY:                                                                                                      \
        switch (op) {                                                                                              \
            ARITHMETIC(S)                                                                                          \
        case O_BAND:                                                                                               \
            return band_##S;                                                                                       \
        case O_BOR:                                                                                                \
            return bor_##S;                                                                                        \
        case O_BXOR:                                                                                               \
            return bxor_##S;                                                                                       \
        }                                                                                                          \
        return NULL;
#define FLOAT_CASE(NPY, S)                                                                                         \
    case NPY:                                                                                                      \
        switch (op) {                                                                                              \
            ARITHMETIC(S)                                                                                          \
        case O_AVG: /* the sum, then do_reduce() divides (integers: the Python reducer, truncating) */             \
            return sum_##S;                                                                                        \
        }                                                                                                          \
        return NULL;
    switch (type) {
        INT_CASE(NPY_INT8, i8)
        INT_CASE(NPY_UINT8, u8)
        INT_CASE(NPY_INT16, i16)
        INT_CASE(NPY_UINT16, u16)
        INT_CASE(NPY_INT32, i32)
        INT_CASE(NPY_UINT32, u32)
        INT_CASE(NPY_INT64, i64)
        INT_CASE(NPY_UINT64, u64)
        FLOAT_CASE(NPY_FLOAT32, f32)
        FLOAT_CASE(NPY_FLOAT64, f64)
    case NPY_COMPLEX64:
    case NPY_COMPLEX128:
        if (op != O_SUM && op != O_AVG)
            return NULL;
        *scale = 2;
        return type == NPY_COMPLEX64 ? sum_f32 : sum_f64;
    }
    return NULL;
}

/* -- buffers -------------------------------------------------------------------------------------------------- */

static char *
region(Steps *self, int buf)
{
    return buf == B_IN ? self->in : buf == B_OUT ? self->out : self->tmp;
}

static char *
stage(Steps *self, Py_ssize_t len)
{
    if (self->stage_len < len) {
        char *s = PyMem_Realloc(self->stage, (size_t)(len ? len : 1));
        if (s == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->stage = s;
        self->stage_len = len;
    }
    return self->stage;
}

/* The memory of one array of len bytes (C-contiguous; writable for an output). NULL: error set. */
static char *
memory_of(PyObject *a, Py_ssize_t len, int writable)
{
    if (PyArray_Check(a)) {
        PyArrayObject *arr = (PyArrayObject *)a;
        int want = writable ? NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE : NPY_ARRAY_C_CONTIGUOUS;
        if ((PyArray_FLAGS(arr) & want) == want && PyArray_NBYTES(arr) == len)
            return PyArray_BYTES(arr);
    }
    Py_buffer v;
    if (PyObject_GetBuffer(a, &v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    char *at = v.len == len ? (char *)v.buf : NULL;
    PyBuffer_Release(&v);
    if (at == NULL)
        PyErr_Format(PyExc_ValueError, "Steps: expected a buffer of %zd bytes", len);
    return at;
}

/* Between one array of a root list and its chunk of the stage (at, len bytes): into the chunk (!out) or out of
 * it into the array (out). Byte copies for a contiguous array, numpy's own copy for another (a strided view).
 * -1: error set. */
static int
copy_chunk(PyObject *item, char *at, Py_ssize_t len, int out)
{
    if (!PyArray_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "Steps: a root list holds numpy arrays");
        return -1;
    }
    PyArrayObject *arr = (PyArrayObject *)item;
    if (PyArray_NBYTES(arr) != len) {
        PyErr_Format(PyExc_ValueError, "Steps: expected arrays of %zd bytes in the list", len);
        return -1;
    }
    if (PyArray_IS_C_CONTIGUOUS(arr)) {
        if (out)
            memcpy(PyArray_BYTES(arr), at, (size_t)len);
        else
            memcpy(at, PyArray_BYTES(arr), (size_t)len);
        return 0;
    }
    PyArray_Descr *descr = PyArray_DESCR(arr);
    Py_INCREF(descr);
    PyObject *chunk = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(arr), PyArray_DIMS(arr), NULL, at,
                                           NPY_ARRAY_CARRAY, NULL);
    if (chunk == NULL)
        return -1;
    int result = out ? PyArray_CopyInto(arr, (PyArrayObject *)chunk) : PyArray_CopyInto((PyArrayObject *)chunk, arr);
    Py_DECREF(chunk);
    return result;
}

/* Where a run reads (IN) or writes (OUT): None (no such buffer), an array, or a root list of equal arrays in
 * rank order (their memory where they lie back to back, else the stage: packed now for IN, spread at the end
 * for OUT). -1: error set. */
static int
bind(Steps *self, PyObject *a, Py_ssize_t len, int out, char **at)
{
    *at = NULL;
    if (len == 0) /* this rank's call has no such buffer (a reduce's output off the root): whatever it is given */
        return 0;
    if (a == Py_None) {
        if (len) {
            PyErr_Format(PyExc_ValueError, "Steps: this rank's call needs its %s (%zd bytes)", out ? "output" : "input",
                         len);
            return -1;
        }
        return 0;
    }
    if (!PyList_CheckExact(a)) {
        *at = memory_of(a, len, out);
        return *at == NULL ? -1 : 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(a), chunk = n ? len / n : 0;
    if (n == 0 || chunk * n != len) {
        PyErr_Format(PyExc_ValueError, "Steps: a list of arrays must hold %zd bytes in equal chunks", len);
        return -1;
    }
    char *first = NULL;
    int packed = 1, plain = 1;
    for (Py_ssize_t i = 0; i < n && plain; i++) {
        char *m = memory_of(PyList_GET_ITEM(a, i), chunk, out);
        if (m == NULL) { /* not contiguous (a strided view): through the stage, numpy copying */
            PyErr_Clear();
            plain = packed = 0;
        }
        else if (i == 0)
            first = m;
        else if (m != first + i * chunk)
            packed = 0;
    }
    if (packed) {
        *at = first;
        return 0;
    }
    char *st = stage(self, len);
    if (st == NULL)
        return -1;
    if (out)
        self->spread = 1;
    else {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (copy_chunk(PyList_GET_ITEM(a, i), st + i * chunk, chunk, 0) < 0)
                return -1;
        }
    }
    *at = st;
    return 0;
}

/* -- a step ----------------------------------------------------------------------------------------------- */

static void
do_copy(Steps *self, act_t *a)
{
    char *d = region(self, a->dbuf) + a->doff, *s = region(self, a->sbuf) + a->soff;
    if (a->n && d != s)
        memmove(d, s, (size_t)a->n);
}

/* dst = srcs[0] op srcs[1] op ... natively (no GIL needed), or through the Python reducer (-1: error set) */
/* x[i] /= n for n elements of float32 (size 4) or float64 (8) */
static void
divide(char *x, Py_ssize_t n, int by, int size)
{
    if (size == 4) {
        float *f = (float *)x, k = (float)by;
        for (Py_ssize_t i = 0; i < n; i++)
            f[i] = f[i] / k;
    }
    else {
        double *f = (double *)x, k = (double)by;
        for (Py_ssize_t i = 0; i < n; i++)
            f[i] = f[i] / k;
    }
}

static int
do_reduce(Steps *self, act_t *a)
{
    Py_ssize_t bytes = a->n * self->itemsize;
    char *d = region(self, a->dbuf) + a->doff;
    if (bytes == 0)
        return 0;
    if (self->acc != NULL) {
        char *s0 = region(self, self->src_buf[a->src_at]) + self->src_off[a->src_at];
        if (d != s0)
            memcpy(d, s0, (size_t)bytes);
        for (int j = 1; j < a->nsrc; j++)
            self->acc(d, region(self, self->src_buf[a->src_at + j]) + self->src_off[a->src_at + j],
                      a->n * self->acc_scale);
        if (self->average) /* every reduction has every rank's part (_plans): the final sum, divided here, while
                            * it is in the cache (numpy's x / n in the element's type; complex: each part) */
            divide(d, a->n * self->acc_scale, a->nsrc, self->average);
        return 0;
    }
    PyObject *dst = PyMemoryView_FromMemory(d, bytes, PyBUF_WRITE), *srcs = PyList_New(a->nsrc);
    int result = dst == NULL || srcs == NULL ? -1 : 0;
    for (int j = 0; j < a->nsrc && result == 0; j++) {
        char *s = region(self, self->src_buf[a->src_at + j]) + self->src_off[a->src_at + j];
        PyObject *v = PyMemoryView_FromMemory(s, bytes, PyBUF_READ);
        if (v == NULL)
            result = -1;
        else
            PyList_SET_ITEM(srcs, j, v);
    }
    if (result == 0) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->reducer, dst, srcs, NULL);
        result = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_XDECREF(dst);
    Py_XDECREF(srcs);
    return result;
}

static int
tag_of(Steps *self, int step)
{
    return self->steps[step].tag >= 0 ? self->steps[step].tag : 1 + step % TAG_SPAN;
}

/* Post step self->at: start its receives' stamps (and post their data), write and start its sends; then its
 * early copies. MPI's code. */
static int
post(Steps *self)
{
    step_t *st = &self->steps[self->at];
    int tag = tag_of(self, self->at), code = 0;
    self->nchecks = self->nrest = self->rested = 0;
    for (int i = 0; i < st->nrecv && !code; i++) {
        int m = st->msg_at + i;
        msg_t *g = &self->msgs[m];
        memcpy(g->want + 12, &self->seq, 4);
        if ((code = mpi_start(self->preq + m * request_size)))
            break;
        self->checks[self->nchecks++] = m;
        if (g->direct) {
            code = mpi_irecv(region(self, g->buf) + g->off, (count_t)g->nbytes, mpi_byte, g->peer, tag, self->comm,
                             self->dreq + m * request_size);
            self->rest[self->nrest++] = 2 * m + 1;
        }
    }
    for (int i = 0; i < st->nsend && !code; i++) {
        int m = st->msg_at + st->nrecv + i;
        msg_t *g = &self->msgs[m];
        memcpy(g->slot + 12, &self->seq, 4);
        if (!g->direct && g->nbytes)
            memcpy(g->slot + STAMP, region(self, g->buf) + g->off, (size_t)g->nbytes);
        if ((code = mpi_start(self->preq + m * request_size)))
            break;
        self->rest[self->nrest++] = 2 * m;
        if (g->direct) {
            code = mpi_isend(region(self, g->buf) + g->off, (count_t)g->nbytes, mpi_byte, g->peer, tag, self->comm,
                             self->dreq + m * request_size);
            self->rest[self->nrest++] = 2 * m + 1;
        }
    }
    self->copied = !st->direct; /* a step with large messages copies while they move (advance()); else once every
                                 * message is here (land()) */
    return code;
}

/* A stamp (or inline message) of message m arrived, got bytes: this call's? 0, or E_MISMATCH (remembered). An
 * inline payload lands once the whole step is here (land()). */
static int
check(Steps *self, int m, count_t got)
{
    msg_t *g = &self->msgs[m];
    count_t size = g->direct ? STAMP : STAMP + g->nbytes;
    if (got != size || memcmp(g->slot, g->want, STAMP) != 0) {
        self->bad_msg = m;
        self->bad_got = got;
        self->bad_data = 0;
        return E_MISMATCH;
    }
    return 0;
}

/* A step whose messages all arrived: the inline payloads into their places, and (a step of inline messages only)
 * the early copies: until now, a call that fails has not touched its output. */
static void
land(Steps *self, step_t *st)
{
    for (int i = 0; i < st->nrecv; i++) {
        msg_t *g = &self->msgs[st->msg_at + i];
        if (!g->direct && g->nbytes)
            memcpy(region(self, g->buf) + g->off, g->slot + STAMP, (size_t)g->nbytes);
    }
    for (int i = 0; !st->direct && i < st->nearly; i++)
        do_copy(self, &self->acts[st->act_at + i]);
}

/* Test the step under way; once complete, its reductions and the next step's post. *done: the run is complete.
 * MPI's code, E_MISMATCH, or E_PYTHON (a Python reduction failed: error set; only with the GIL). */
static int
advance(Steps *self, int *done)
{
    int flag, code;
    *done = 0;
    for (;;) {
        int kept = 0;
        for (int i = 0; i < self->nchecks; i++) { /* every stamp still awaited: a stranger is named at once */
            int m = self->checks[i];
            if ((code = mpi_test(self->preq + m * request_size, &flag, self->status)))
                return code;
            if (!flag) {
                self->checks[kept++] = m;
                continue;
            }
            count_t got = -1;
            if ((code = mpi_get_count(self->status, mpi_byte, &got)) || (code = check(self, m, got)))
                return code;
        }
        self->nchecks = kept;
        while (self->rested < self->nrest) { /* then the data and the sends, one at a time, in order */
            int r = self->rest[self->rested], m = r >> 1;
            char *req = ((r & 1) ? self->dreq : self->preq) + m * request_size;
            if ((code = mpi_test(req, &flag, self->status)))
                return code;
            if (!flag) {
                if (!self->copied) { /* the early copies, once the messages are under way (the peers' handshakes
                                      * answered first: a large copy would hold them up) */
                    step_t *st = &self->steps[self->at];
                    for (int i = 0; i < st->nearly; i++)
                        do_copy(self, &self->acts[st->act_at + i]);
                    self->copied = 1;
                }
                return 0;
            }
            self->rested++;
            msg_t *g = &self->msgs[m];
            step_t *st = &self->steps[self->at];
            if ((r & 1) && m < st->msg_at + st->nrecv) { /* a large message's data: of the size expected? */
                count_t got = -1;
                if ((code = mpi_get_count(self->status, mpi_byte, &got)))
                    return code;
                if (got != g->nbytes) {
                    self->bad_msg = m;
                    self->bad_got = got;
                    self->bad_data = 1;
                    return E_MISMATCH;
                }
            }
        }
        if (self->nchecks)
            return 0;
        step_t *st = &self->steps[self->at];
        if (!self->copied) { /* a step with large messages whose messages all went before its copies */
            for (int i = 0; i < st->nearly; i++)
                do_copy(self, &self->acts[st->act_at + i]);
            self->copied = 1;
        }
        land(self, st);
        for (int i = st->nearly; i < st->nearly + st->nafter; i++) {
            act_t *a = &self->acts[st->act_at + i];
            if (a->code == A_COPY)
                do_copy(self, a);
            else if (do_reduce(self, a) < 0)
                return E_PYTHON;
        }
        if (++self->at == self->nsteps) {
            *done = 1;
            return 0;
        }
        if ((code = post(self)))
            return code;
    }
}

/* advance() in a loop until the run is complete or seconds pass; needs no GIL (native reductions only) */
static int
advance_until(Steps *self, double seconds, int *done)
{
    double due = monotonic() + seconds;
    int code;
    for (unsigned i = 1; !(code = advance(self, done)) && !*done; i++) {
        if ((i & 15) == 0 && monotonic() >= due)
            break;
    }
    return code;
}

/* -- a run ----------------------------------------------------------------------------------------------- */

/* Whether a is this executor's: its dtype (the plan's, stamped), len bytes in all, writable where written; an
 * array C-contiguous, or a root list of such arrays (strided ones are staged). What go() takes without a word:
 * anything else is another call's (the group layer then takes its generic path). */
static int
fits(Steps *self, PyObject *a, Py_ssize_t len, int out, PyObject *inp)
{
    if (len == 0) /* none on this rank: None, an empty array, or a reduce's output off the root (its input) */
        return a == Py_None || (out && a == inp) || (PyArray_Check(a) && PyArray_NBYTES((PyArrayObject *)a) == 0);
    PyArray_Descr *want = self->dtype == Py_None ? NULL : (PyArray_Descr *)self->dtype;
    int flags = out ? NPY_ARRAY_WRITEABLE : 0;
    if (PyArray_Check(a)) {
        PyArrayObject *arr = (PyArrayObject *)a;
        return PyArray_NBYTES(arr) == len && (PyArray_FLAGS(arr) & (flags | NPY_ARRAY_C_CONTIGUOUS)) ==
                                                 (flags | NPY_ARRAY_C_CONTIGUOUS) &&
               (want == NULL || PyArray_DESCR(arr) == want || PyArray_EquivTypes(PyArray_DESCR(arr), want));
    }
    if (!PyList_CheckExact(a) || PyList_GET_SIZE(a) == 0)
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(a), chunk = len / n;
    if (chunk * n != len)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* one chunk each, in rank order */
        PyObject *item = PyList_GET_ITEM(a, i);
        if (!PyArray_Check(item))
            return 0;
        PyArrayObject *arr = (PyArrayObject *)item;
        if (PyArray_NBYTES(arr) != chunk || (PyArray_FLAGS(arr) & flags) != flags ||
            (want != NULL && PyArray_DESCR(arr) != want && !PyArray_EquivTypes(PyArray_DESCR(arr), want)))
            return 0;
    }
    return 1;
}

static int
begin(Steps *self, PyObject *const *args, Py_ssize_t nargs, int hold)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "Steps: go(inp, out, seq) and start(inp, out, seq) take 3 arguments");
        return -1;
    }
    if (self->state != IDLE) {
        PyErr_SetString(PyExc_RuntimeError, self->state == RUNNING ? "Steps: the previous run has not ended"
                                                                   : "Steps: abandoned after a timeout or error");
        return -1;
    }
    unsigned long seq = PyLong_AsUnsignedLongMask(args[2]);
    if (seq == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    self->spread = 0;
    if (bind(self, args[0], self->in_len, 0, &self->in) < 0 || bind(self, args[1], self->out_len, 1, &self->out) < 0)
        return -1;
    if (self->copy_in && self->in != NULL && self->out != NULL && self->in < self->out + self->out_len &&
        self->out < self->in + self->in_len) { /* the messages would read the input while writing the output */
        if (self->aside_len < self->in_len) {
            char *a = PyMem_Realloc(self->aside, (size_t)self->in_len);
            if (a == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            self->aside = a;
            self->aside_len = self->in_len;
        }
        memcpy(self->aside, self->in, (size_t)self->in_len);
        self->in = self->aside;
    }
    self->cur_in = args[0];
    self->cur_out = args[1];
    if (hold && (self->held = PyTuple_Pack(2, args[0], args[1])) == NULL) /* go() holds them only if it must */
        return -1;
    self->seq = (uint32_t)seq;
    self->at = 0;
    self->state = RUNNING;
    int code = post(self);
    if (code) {
        self->state = ABANDONED; /* some messages may be posted: MPI may use the arrays, held for good */
        if (self->held == NULL)
            self->held = PyTuple_Pack(2, args[0], args[1]);
        raise_mpi(code);
        return -1;
    }
    return 0;
}

/* The end of a run: a staged root list spread, the arrays let go. -1: error set. */
static int
complete(Steps *self)
{
    int result = 0;
    if (self->spread) {
        PyObject *list = self->held != NULL ? PyTuple_GET_ITEM(self->held, 1) : self->cur_out;
        Py_ssize_t n = PyList_GET_SIZE(list), chunk = self->out_len / n;
        for (Py_ssize_t i = 0; i < n && result == 0; i++)
            result = copy_chunk(PyList_GET_ITEM(list, i), self->stage + i * chunk, chunk, 1);
    }
    self->spread = 0;
    self->state = IDLE;
    Py_CLEAR(self->held);
    return result;
}

/* An advance's outcome: the run abandoned and an error raised (MPI's, a mismatch, a Python error), or
 * True / False. */
static PyObject *
outcome(Steps *self, int code, int done)
{
    if ((code || !done) && self->held == NULL) { /* running on (or abandoned) past this call: hold the arrays */
        if ((self->held = PyTuple_Pack(2, self->cur_in, self->cur_out)) == NULL) {
            self->state = ABANDONED;
            return NULL;
        }
    }
    if (code) {
        self->state = ABANDONED; /* MPI may still use the arrays: held for good */
        if (code == E_MISMATCH) {
            msg_t *g = &self->msgs[self->bad_msg];
            PyObject *exc = PyObject_CallFunction(self->mismatch, "iy#Ly#i", g->peer, g->slot, (Py_ssize_t)STAMP,
                                                  (long long)self->bad_got, g->want, (Py_ssize_t)STAMP,
                                                  self->bad_data);
            if (exc != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
            }
        }
        else if (code != E_PYTHON)
            raise_mpi(code);
        return NULL;
    }
    if (done && complete(self) < 0)
        return NULL;
    return PyBool_FromLong(done);
}

static PyObject *
Steps_go(Steps *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs == 3 && self->state == IDLE &&
        !(fits(self, args[0], self->in_len, 0, NULL) && fits(self, args[1], self->out_len, 1, args[0])))
        Py_RETURN_NONE; /* another call's arrays: nothing started */
    if (begin(self, args, nargs, 0) < 0)
        return NULL;
    int code = 0, done = 0;
    self->spent = 0.0;
    if (!spinning && self->block > 0) {
        spinning = 1;
        self->spent = self->block;
        Py_BEGIN_ALLOW_THREADS
        code = advance_until(self, self->block, &done);
        Py_END_ALLOW_THREADS
        spinning = 0;
    }
    else {
        for (int i = 0; i < 256 && !done && !code; i++)
            code = advance(self, &done);
    }
    PyObject *result = outcome(self, code, done);
    if (result == Py_True)
        record_run(self->label, self->seq);
    return result;
}

static PyObject *
Steps_start(Steps *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, args, nargs, 1) < 0)
        return NULL;
    self->spent = 0.0;
    Py_RETURN_NONE;
}

static PyObject *
Steps_test(Steps *self, PyObject *unused)
{
    (void)unused;
    if (self->state != RUNNING)
        return PyBool_FromLong(self->state == IDLE);
    int done = 0, code = advance(self, &done);
    return outcome(self, code, done);
}

static PyObject *
Steps_spin(Steps *self, PyObject *arg)
{
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->state != RUNNING)
        return PyBool_FromLong(self->state == IDLE);
    if (spinning || (self->acc == NULL && self->reduces))
        Py_RETURN_NONE;
    int done = 0, code = 0;
    spinning = 1;
    Py_BEGIN_ALLOW_THREADS
    code = advance_until(self, seconds, &done);
    Py_END_ALLOW_THREADS
    spinning = 0;
    return outcome(self, code, done);
}

static PyObject *
Steps_spent(Steps *self, PyObject *unused)
{
    (void)unused;
    return PyFloat_FromDouble(self->spent);
}

static PyObject *
Steps_abandon(Steps *self, PyObject *unused)
{
    (void)unused;
    if (self->state == RUNNING)
        self->state = ABANDONED;
    Py_RETURN_NONE;
}

/* free(): free the persistent requests of an idle executor (before MPI is finalized; never a running one) */
static PyObject *
Steps_free(Steps *self, PyObject *unused)
{
    (void)unused;
    if (self->state == IDLE && self->preq != NULL) {
        for (int m = 0; m < self->nmsgs; m++)
            mpi_request_free(self->preq + m * request_size);
        self->state = ABANDONED; /* never run again */
        self->freed = 1;
    }
    Py_RETURN_NONE;
}

static void
Steps_dealloc(Steps *self)
{
    Py_XDECREF(self->reducer);
    Py_XDECREF(self->mismatch);
    Py_XDECREF(self->dtype);
    Py_XDECREF(self->held);
    Py_XDECREF(self->label);
    if (self->state != IDLE && !self->freed) { /* MPI may still use its buffers (a run abandoned): leave them be */
        Py_TYPE(self)->tp_free((PyObject *)self);
        return;
    }
    for (int m = 0; self->msgs != NULL && m < self->nmsgs; m++)
        PyMem_Free(self->msgs[m].slot);
    void *blocks[] = {self->steps, self->msgs, self->acts, self->src_buf, self->src_off, self->tmp, self->preq,
                      self->dreq, self->status, self->checks, self->rest, self->stage, self->aside};
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
        PyMem_Free(blocks[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* -- construction: the plan decoded, the persistent requests made ------------------------------------------ */

/* The next value of the encoding, or -1 with an error set when it runs out (*ok cleared) */
static long long
next(const long long *code, Py_ssize_t len, Py_ssize_t *at, int *ok)
{
    if (*at >= len) {
        if (*ok)
            PyErr_SetString(PyExc_ValueError, "Steps: the plan's encoding ends early");
        *ok = 0;
        return -1;
    }
    return code[(*at)++];
}

static int
decode(Steps *self, const long long *code, Py_ssize_t len)
{
    Py_ssize_t at = 0;
    int ok = 1;
    self->nsteps = (int)next(code, len, &at, &ok);
    self->tmp_len = next(code, len, &at, &ok);
    self->in_len = next(code, len, &at, &ok);
    self->out_len = next(code, len, &at, &ok);
    self->copy_in = (int)next(code, len, &at, &ok);
    if (!ok || self->nsteps < 1 || self->tmp_len < 0 || self->in_len < 0 || self->out_len < 0) {
        if (ok)
            PyErr_SetString(PyExc_ValueError, "Steps: bad plan header");
        return -1;
    }
    /* at most len/4 messages, actions and sources: allocate for that much */
    Py_ssize_t most = len / 4 + 1;
    self->steps = PyMem_Calloc((size_t)self->nsteps, sizeof(step_t));
    self->msgs = PyMem_Calloc((size_t)most, sizeof(msg_t));
    self->acts = PyMem_Calloc((size_t)most, sizeof(act_t));
    self->src_buf = PyMem_Calloc((size_t)most, sizeof(int));
    self->src_off = PyMem_Calloc((size_t)most, sizeof(Py_ssize_t));
    if (!self->steps || !self->msgs || !self->acts || !self->src_buf || !self->src_off) {
        PyErr_NoMemory();
        return -1;
    }
    int nsrc = 0;
    for (int s = 0; s < self->nsteps && ok; s++) {
        step_t *st = &self->steps[s];
        st->nrecv = (int)next(code, len, &at, &ok);
        st->nsend = (int)next(code, len, &at, &ok);
        st->nearly = (int)next(code, len, &at, &ok);
        st->nafter = (int)next(code, len, &at, &ok);
        st->msg_at = self->nmsgs;
        st->act_at = self->nacts;
        st->tag = -1;
        int nm = st->nrecv + st->nsend;
        if (nm > self->maxmsgs)
            self->maxmsgs = nm;
        for (int i = 0; i < nm && ok; i++) {
            msg_t *g = &self->msgs[self->nmsgs++];
            g->peer = (int)next(code, len, &at, &ok);
            g->buf = (int)next(code, len, &at, &ok);
            g->off = next(code, len, &at, &ok);
            g->nbytes = next(code, len, &at, &ok);
        }
        for (int i = 0; i < st->nearly + st->nafter && ok; i++) {
            act_t *a = &self->acts[self->nacts++];
            a->code = (int)next(code, len, &at, &ok);
            a->dbuf = (int)next(code, len, &at, &ok);
            a->doff = next(code, len, &at, &ok);
            if (a->code == A_COPY) {
                a->sbuf = (int)next(code, len, &at, &ok);
                a->soff = next(code, len, &at, &ok);
                a->n = next(code, len, &at, &ok);
            }
            else {
                self->reduces = 1;
                a->n = next(code, len, &at, &ok);
                a->nsrc = (int)next(code, len, &at, &ok);
                a->src_at = nsrc;
                for (int j = 0; j < a->nsrc && ok && nsrc < most; j++, nsrc++) {
                    self->src_buf[nsrc] = (int)next(code, len, &at, &ok);
                    self->src_off[nsrc] = next(code, len, &at, &ok);
                }
            }
        }
    }
    if (ok && at != len) {
        PyErr_SetString(PyExc_ValueError, "Steps: the plan's encoding is longer than its steps");
        return -1;
    }
    return ok ? 0 : -1;
}

/* Each message's slot and persistent request: a receive's slot takes any inline message (a stranger is named);
 * a send's holds its stamp (and inline payload). MPI's code, or -1 (error set). */
static int
prepare(Steps *self, int tag)
{
    self->preq = PyMem_Calloc((size_t)(self->nmsgs ? self->nmsgs : 1), (size_t)request_size);
    self->dreq = PyMem_Calloc((size_t)(self->nmsgs ? self->nmsgs : 1), (size_t)request_size);
    self->status = PyMem_Calloc(1, (size_t)status_size);
    self->checks = PyMem_Calloc((size_t)(self->maxmsgs + 1), sizeof(int));
    self->rest = PyMem_Calloc((size_t)(2 * self->maxmsgs + 1), sizeof(int));
    self->tmp = PyMem_Calloc((size_t)(self->tmp_len ? self->tmp_len : 1), 1);
    if (!self->preq || !self->dreq || !self->status || !self->checks || !self->rest || !self->tmp) {
        PyErr_NoMemory();
        return -1;
    }
    for (int s = 0; s < self->nsteps; s++) {
        step_t *st = &self->steps[s];
        st->tag = tag;
        int t = tag_of(self, s);
        for (int i = 0; i < st->nrecv + st->nsend; i++) {
            int m = st->msg_at + i, recv = i < st->nrecv;
            msg_t *g = &self->msgs[m];
            g->direct = g->nbytes > self->small;
            st->direct |= g->direct;
            g->cap = recv ? STAMP + self->small : g->direct ? STAMP : STAMP + g->nbytes;
            if ((g->slot = PyMem_Calloc((size_t)g->cap, 1)) == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            if (g->peer < 0 || g->buf < B_IN || g->buf > B_TMP || g->off < 0 || g->nbytes < 0) {
                PyErr_SetString(PyExc_ValueError, "Steps: a message with a bad peer, buffer or size");
                return -1;
            }
            int code = recv ? mpi_recv_init(g->slot, (int)g->cap, mpi_byte, g->peer, t, self->comm,
                                            self->preq + m * request_size)
                            : mpi_send_init(g->slot, (int)g->cap, mpi_byte, g->peer, t, self->comm,
                                            self->preq + m * request_size);
            if (code) {
                raise_mpi(code);
                return -1;
            }
        }
    }
    return 0;
}

/* Steps(plan, comm, small, tag, dtype, op, count, reducer, mismatch, block, stamps): stamps holds, for each
 * message in plan order, its stamp with seq 0 (a receive's expected one, a send's own) */
static PyObject *
Steps_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"plan",    "comm",     "small", "tag",    "dtype", "op", "count",
                            "reducer", "mismatch", "block", "stamps", NULL};
    PyObject *plan, *dtype, *reducer, *mismatch, *stamps;
    int comm, tag, op;
    Py_ssize_t small, count;
    double block;
    if (mpi_start == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "commlib.backends._executor: setup() was not called");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiniOinOOdS", names, &plan, &comm, &small, &tag, &dtype, &op, &count,
                                     &reducer, &mismatch, &block, &stamps))
        return NULL;
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROMANY(plan, NPY_INT64, 1, 1, NPY_ARRAY_CARRAY_RO);
    if (arr == NULL)
        return NULL;
    Steps *self = (Steps *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(arr);
        return NULL;
    }
    self->comm = comm;
    self->small = small;
    self->count = count;
    self->block = block;
    self->state = ABANDONED; /* until prepared: never freed or run */
    Py_INCREF(reducer);
    Py_INCREF(mismatch);
    Py_INCREF(dtype);
    self->reducer = reducer;
    self->mismatch = mismatch;
    self->dtype = dtype;
    self->label = Py_NewRef(Py_None);
    int bad = decode(self, (const long long *)PyArray_DATA(arr), PyArray_SIZE(arr)) < 0;
    Py_DECREF(arr);
    if (bad) {
        Py_DECREF(self);
        return NULL;
    }
    if (dtype != Py_None) {
        if (!PyArray_DescrCheck(dtype)) {
            PyErr_SetString(PyExc_TypeError, "Steps: dtype must be a numpy dtype or None");
            Py_DECREF(self);
            return NULL;
        }
        self->itemsize = PyDataType_ELSIZE((PyArray_Descr *)dtype);
        self->acc = native_acc(((PyArray_Descr *)dtype)->type_num, op, &self->acc_scale);
        self->average = self->acc != NULL && op == O_AVG ? (int)(self->itemsize / self->acc_scale) : 0;
    }
    if (small < 0 || PyBytes_GET_SIZE(stamps) != (Py_ssize_t)self->nmsgs * STAMP) {
        PyErr_SetString(PyExc_ValueError, "Steps: small must be >= 0, and stamps 32 bytes per message");
        Py_DECREF(self);
        return NULL;
    }
    if (prepare(self, tag) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    const char *st = PyBytes_AS_STRING(stamps);
    for (int s = 0; s < self->nsteps; s++) {
        step_t *sp = &self->steps[s];
        for (int i = 0; i < sp->nrecv + sp->nsend; i++) {
            int m = sp->msg_at + i;
            memcpy(i < sp->nrecv ? self->msgs[m].want : self->msgs[m].slot, st + m * STAMP, STAMP);
        }
    }
    if (self->acc == NULL && self->reduces)
        self->block = 0.0; /* Python reductions need the GIL */
    self->state = IDLE;
    return (PyObject *)self;
}

static PyMethodDef Steps_methods[] = {
    {"go", (PyCFunction)(void (*)(void))Steps_go, METH_FASTCALL,
     "go(inp, out, seq) -> bool | None: start a run and test it; True: complete; False: still running; None: the "
     "arrays are not this executor's (another dtype or size, not contiguous, read-only): nothing started"},
    {"start", (PyCFunction)(void (*)(void))Steps_start, METH_FASTCALL, "start(inp, out, seq): start a run"},
    {"test", (PyCFunction)Steps_test, METH_NOARGS, "test() -> bool: whether the run is complete (moving it on)"},
    {"spin", (PyCFunction)Steps_spin, METH_O, "spin(seconds) -> bool | None: test without the GIL"},
    {"spent", (PyCFunction)Steps_spent, METH_NOARGS, "spent() -> seconds the last go() tested without the GIL"},
    {"abandon", (PyCFunction)Steps_abandon, METH_NOARGS, "abandon(): never run again; the arrays stay held"},
    {"free", (PyCFunction)Steps_free, METH_NOARGS, "free(): free the persistent requests of an idle executor"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Steps_members[] = {
    {"dtype", T_OBJECT, offsetof(Steps, dtype), READONLY, "the callers' dtype (None: no data)"},
    {"count", T_PYSSIZET, offsetof(Steps, count), READONLY, "the call's agreed element count"},
    {"state", T_INT, offsetof(Steps, state), READONLY, "0 idle, 1 running, 2 abandoned"},
    {"seq", T_UINT, offsetof(Steps, seq), READONLY, "the sequence number of the run (the last one)"},
    {"label", T_OBJECT, offsetof(Steps, label), 0,
     "what the record of each run go() completes says, with its sequence number and time (None: no record)"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject StepsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commlib.backends._executor.Steps",
    .tp_basicsize = sizeof(Steps),
    .tp_dealloc = (destructor)Steps_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Steps(plan, comm, small, tag, dtype, op, count, reducer, mismatch, block, stamps): a plan run in C",
    .tp_methods = Steps_methods,
    .tp_members = Steps_members,
    .tp_new = Steps_new,
};
