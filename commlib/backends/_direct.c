/* Direct: a large blocking collective posted on the caller's own buffers, in one C call.
 *
 * A call above the persistent operations' size (commlib.backends.mpi.PERSISTENT_MAX) has no scratch buffers to
 * copy through: MPI reads and writes the caller's arrays. In Python, the checks, the post and the wait around
 * MPI's nonblocking call cost 5-10 us a call in a loop of 1 MiB calls (each transfer evicts the interpreter's
 * working set), 4-30 % of the transfer. Direct.go(inp, out) does the post and the spin in one C call: find
 * the arrays' memory, post MPI's nonblocking call (MPI_Iallreduce, _Ibcast, _Ireduce, _Iallgather,
 * _Ireduce_scatter_block, _Ialltoall, _Igather, _Iscatter, _Isend, _Irecv), and test it in a loop without
 * the GIL for up to `block` seconds (as spin() does). True: complete. False: still running; the caller waits
 * for request() with its deadline and then calls finish() (or abandon() when it gave up: the arrays stay
 * held for good).
 *
 * The group layer finds a Direct in the same tables as the ready operations (commlib.backends._direct), so
 * the front doors' checks, numbering and flight recorder serve it unchanged. Inputs that overlap the output
 * (other than all_gather's own chunk, which goes as MPI_IN_PLACE) and root lists that do not lie back to back
 * go through a scratch buffer of the Direct's own, as the generic path stages them.
 *
 * MPICH's ABI: communicator, datatype and operation handles are ints (setup_direct() refuses another size,
 * and commlib then posts from Python). The functions are the addresses in the library mpi4py loaded.
 */
#include "_ready.h"

typedef int handle_t;
typedef int (*iallreduce_fn)(const void *, void *, int, handle_t, handle_t, handle_t, void *);
typedef int (*ibcast_fn)(void *, int, handle_t, int, handle_t, void *);
typedef int (*ireduce_fn)(const void *, void *, int, handle_t, handle_t, int, handle_t, void *);
typedef int (*iallgather_fn)(const void *, int, handle_t, void *, int, handle_t, handle_t, void *);
typedef int (*ireduce_scatter_block_fn)(const void *, void *, int, handle_t, handle_t, handle_t, void *);
typedef int (*igather_fn)(const void *, int, handle_t, void *, int, handle_t, int, handle_t, void *);
typedef int (*ipoint_fn)(void *, int, handle_t, int, int, handle_t, void *); /* Isend (const buffer), Irecv */

static iallreduce_fn i_allreduce;
static ibcast_fn i_bcast;
static ireduce_fn i_reduce;
static iallgather_fn i_allgather, i_alltoall;
static ireduce_scatter_block_fn i_reduce_scatter_block;
static igather_fn i_gather, i_scatter;
static ipoint_fn i_send, i_recv;
static void *in_place; /* MPI_IN_PLACE */

/* the kinds, in the order of commlib.backends._direct.KINDS */
enum { ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER, SEND, RECV, KINDS };
enum { IDLE, RUNNING, ABANDONED };

typedef struct {
    PyObject_HEAD
    int kind, count, root, tag, rank, size; /* count: MPI's count (all_to_all: a block's); root: or the peer */
    handle_t comm, dtype, op;
    PyObject *descr;              /* the callers' dtype (a numpy descr) */
    Py_ssize_t itemsize, in_len, out_len; /* bytes of the input and of the output (a root list: of each item) */
    double block;                 /* seconds go() tests without the GIL */
    double spent;                 /* seconds the last go() spent so (0: it only tested a few times) */
    int state, spread;            /* spread: at completion, copy the stage into the root list (gather) */
    char request[8];
    PyObject *held;               /* (inp, out) while running */
    char *stage;                  /* scratch for staged inputs and outputs, stage_len bytes */
    Py_ssize_t stage_len;
} Direct;

/* The memory of a, which must be len bytes, C-contiguous (writable if asked): read from numpy's struct for a
 * numpy array of the call's dtype, else through the buffer protocol (the caller holds a). NULL: error set. */
static char *
region(Direct *self, PyObject *a, Py_ssize_t len, int writable)
{
    if (array_fits(a, self->descr, self->itemsize, len, writable))
        return ARRAY_DATA(a);
    Py_buffer v;
    if (PyObject_GetBuffer(a, &v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    char *at = v.len == len ? (char *)v.buf : NULL;
    PyBuffer_Release(&v);
    if (at == NULL)
        PyErr_Format(PyExc_ValueError, "Direct.go: expected a buffer of %zd bytes", len);
    return at;
}

/* The memory of a root list of size arrays of len bytes each: the first item's if they lie back to back in
 * rank order (*packed 1), else *packed 0. NULL: error set. */
static char *
list_region(Direct *self, PyObject *list, Py_ssize_t len, int writable, int *packed)
{
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) != self->size) {
        PyErr_Format(PyExc_TypeError, "Direct.go: expected a list of %d arrays", self->size);
        return NULL;
    }
    char *first = NULL;
    *packed = 1;
    for (Py_ssize_t i = 0; i < self->size; i++) {
        char *at = region(self, PyList_GET_ITEM(list, i), len, writable);
        if (at == NULL)
            return NULL;
        if (i == 0)
            first = at;
        else if (at != first + i * len)
            *packed = 0;
    }
    return first;
}

static int
overlap(const char *a, Py_ssize_t alen, const char *b, Py_ssize_t blen)
{
    return a != NULL && b != NULL && a < b + blen && b < a + alen;
}

/* The stage, at least len bytes. NULL: error set. */
static char *
stage(Direct *self, Py_ssize_t len)
{
    if (self->stage_len < len) {
        char *s = PyMem_Realloc(self->stage, (size_t)len);
        if (s == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->stage = s;
        self->stage_len = len;
    }
    return self->stage;
}

/* A run's end: a root list filled from the stage (gather), the arrays let go. -1: error set. */
static int
complete(Direct *self)
{
    int result = 0;
    if (self->spread) {
        PyObject *list = PyTuple_GET_ITEM(self->held, 1);
        for (Py_ssize_t i = 0; i < self->size && result == 0; i++) {
            char *at = region(self, PyList_GET_ITEM(list, i), self->in_len, 1);
            if (at == NULL)
                result = -1;
            else
                memcpy(at, self->stage + i * self->in_len, (size_t)self->in_len);
        }
    }
    self->spread = 0;
    self->state = IDLE;
    Py_CLEAR(self->held);
    return result;
}

/* Post the call on (send, recv); MPI's error code. */
static int
post(Direct *self, const char *send, char *recv)
{
    const void *s = send;
    void *req = self->request;
    int n = self->count;
    handle_t c = self->comm, t = self->dtype, op = self->op;
    switch (self->kind) {
    case ALL_REDUCE:
        return i_allreduce(in_place, recv, n, t, op, c, req);
    case BROADCAST:
        return i_bcast(recv, n, t, self->root, c, req);
    case REDUCE: /* in place at the root; elsewhere the receive buffer is not MPI's to read */
        if (self->rank == self->root)
            return i_reduce(in_place, recv, n, t, op, self->root, c, req);
        return i_reduce(s, NULL, n, t, op, self->root, c, req);
    case ALL_GATHER:
        return i_allgather(s, n, t, recv, n, t, c, req);
    case REDUCE_SCATTER:
        return i_reduce_scatter_block(s, recv, n, t, op, c, req);
    case ALL_TO_ALL:
        return i_alltoall(s, n, t, recv, n, t, c, req);
    case GATHER:
        return i_gather(s, n, t, recv, n, t, self->root, c, req);
    case SCATTER:
        return i_scatter(s, n, t, recv, n, t, self->root, c, req);
    case SEND:
        return i_send((void *)send, n, t, self->root, self->tag, c, req);
    default:
        return i_recv(recv, n, t, self->root, self->tag, c, req);
    }
}

/* The stage in place of a root's list (or whole array, at w) that is not back to back or overlaps this rank's
 * own array: scatter's input packed into it now, gather's output spread from it at completion. NULL: error. */
static char *
staged(Direct *self, PyObject *list, char *w)
{
    int gather = self->kind == GATHER, is_list = PyList_CheckExact(list);
    Py_ssize_t chunk = gather ? self->in_len : self->out_len, whole = gather ? self->out_len : self->in_len;
    if (gather && !is_list) { /* the generic path stages such a call before it comes here */
        PyErr_SetString(PyExc_ValueError, "Direct.go: gather's input lies inside its output");
        return NULL;
    }
    char *st = stage(self, whole);
    if (st == NULL || gather) {
        self->spread = st != NULL;
        return st;
    }
    if (!is_list) {
        memcpy(st, w, (size_t)whole);
        return st;
    }
    for (Py_ssize_t i = 0; i < self->size; i++) {
        char *at = region(self, PyList_GET_ITEM(list, i), chunk, 0);
        if (at == NULL)
            return NULL;
        memcpy(st + i * chunk, at, (size_t)chunk);
    }
    return st;
}

/* Where a run reads and writes (*send, *recv; NULL: none on this rank), staging what must be. -1: error set. */
static int
place(Direct *self, PyObject *inp, PyObject *out, char **send, char **recv)
{
    int packed = 1, root = self->rank == self->root;
    char *s = NULL, *r = NULL;
    switch (self->kind) {
    case ALL_REDUCE:
    case BROADCAST:
    case REDUCE: /* in place: inp is out (or None) */
        if ((r = region(self, out, self->out_len, 1)) == NULL)
            return -1;
        if (inp != out && inp != Py_None) {
            if ((s = region(self, inp, self->in_len, 0)) == NULL)
                return -1;
            memmove(r, s, (size_t)self->out_len);
        }
        s = r;
        break;
    case GATHER: /* the root's list (or whole array) is the output; scatter: its input */
    case SCATTER: {
        int gather = self->kind == GATHER;
        PyObject *mine = gather ? inp : out, *list = gather ? out : inp;
        Py_ssize_t chunk = gather ? self->in_len : self->out_len, whole = gather ? self->out_len : self->in_len;
        char *m = region(self, mine, chunk, !gather), *w = NULL;
        if (m == NULL)
            return -1;
        if (root) {
            w = PyList_CheckExact(list) ? list_region(self, list, chunk, gather, &packed)
                                        : region(self, list, whole, gather);
            if (w == NULL || ((!packed || overlap(m, chunk, w, whole)) && (w = staged(self, list, w)) == NULL))
                return -1;
        }
        s = gather ? m : w;
        r = gather ? w : m;
        break;
    }
    case SEND:
        if ((s = region(self, inp, self->in_len, 0)) == NULL)
            return -1;
        break;
    case RECV:
        if ((r = region(self, out, self->out_len, 1)) == NULL)
            return -1;
        break;
    default: /* all_gather, reduce_scatter, all_to_all: one input, one output */
        if ((s = region(self, inp, self->in_len, 0)) == NULL || (r = region(self, out, self->out_len, 1)) == NULL)
            return -1;
        if (self->kind == ALL_GATHER && s == r + self->rank * self->in_len)
            s = in_place; /* this rank's chunk of the output: MPI reads it there */
        else if (overlap(s, self->in_len, r, self->out_len)) {
            char *st = stage(self, self->in_len);
            if (st == NULL)
                return -1;
            memcpy(st, s, (size_t)self->in_len);
            s = st;
        }
    }
    *send = s;
    *recv = r;
    return 0;
}

static PyObject *
Direct_go(Direct *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (go_arity(nargs) < 0)
        return NULL;
    if (self->state != IDLE) {
        PyErr_SetString(PyExc_RuntimeError, self->state == RUNNING ? "Direct.go: the previous run has not ended"
                                                                   : "Direct.go: abandoned after a timeout or error");
        return NULL;
    }
    PyObject *inp = args[0], *out = args[1];
    char *send, *recv;
    self->spread = 0;
    if (place(self, inp, out, &send, &recv) < 0)
        return NULL;
    if ((self->held = PyTuple_Pack(2, inp, out)) == NULL)
        return NULL;
    int code = post(self, send, recv), flag = 0;
    if (code) {
        Py_CLEAR(self->held);
        raise_mpi(code);
        return NULL;
    }
    self->state = RUNNING;
    char status[256];
    self->spent = 0.0;
    if (!spinning && self->block > 0) {
        spinning = 1;
        self->spent = self->block;
        Py_BEGIN_ALLOW_THREADS
        code = test_until(self->request, self->block, &flag, status);
        Py_END_ALLOW_THREADS
        spinning = 0;
    }
    else {
        for (int i = 0; i < 256 && !flag && !code; i++)
            code = mpi_test(self->request, &flag, status);
    }
    if (code) {
        self->state = ABANDONED; /* MPI may still use the arrays: held for good */
        raise_mpi(code);
        return NULL;
    }
    if (!flag)
        Py_RETURN_FALSE;
    if (complete(self) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* request(): the running call's request as an mpi4py Request (for a wait with a deadline) */
static PyObject *
Direct_request(Direct *self, PyObject *unused)
{
    (void)unused;
    if (self->state != RUNNING) {
        PyErr_SetString(PyExc_RuntimeError, "Direct.request: no run is going on");
        return NULL;
    }
    PyObject *r = PyObject_CallNoArgs((PyObject *)request_type);
    if (r != NULL)
        memcpy((char *)r + handle_offset, self->request, (size_t)request_size);
    return r;
}

/* spent(): seconds the last go() tested without the GIL (the caller's wait has that much less time) */
static PyObject *
Direct_spent(Direct *self, PyObject *unused)
{
    (void)unused;
    return PyFloat_FromDouble(self->spent);
}

/* finish(): after the request completed outside go() */
static PyObject *
Direct_finish(Direct *self, PyObject *unused)
{
    (void)unused;
    if (self->state != RUNNING) {
        PyErr_SetString(PyExc_RuntimeError, "Direct.finish: no run is going on");
        return NULL;
    }
    if (complete(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* abandon(): the caller gave up on the run (timeout, error): never run again, keep the arrays */
static PyObject *
Direct_abandon(Direct *self, PyObject *unused)
{
    (void)unused;
    if (self->state == RUNNING)
        self->state = ABANDONED;
    Py_RETURN_NONE;
}

static PyObject *
Direct_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"kind", "comm", "dtype", "op", "root", "tag", "rank", "size", "count", "descr",
                            "itemsize", "in_len", "out_len", "block", NULL};
    int kind, comm, dtype, op, root, tag, rank, size, count;
    PyObject *descr;
    Py_ssize_t itemsize, in_len, out_len;
    double block;
    if (i_allreduce == NULL || request_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "commlib.backends._ready: setup() and setup_direct() were not called");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiiiiiiiiOnnnd", names, &kind, &comm, &dtype, &op, &root, &tag,
                                     &rank, &size, &count, &descr, &itemsize, &in_len, &out_len, &block))
        return NULL;
    if (kind < 0 || kind >= KINDS || size < 1 || rank < 0 || rank >= size || root < 0 || root >= size || tag < 0 ||
        count < 0 || itemsize < 1 || in_len < 0 || out_len < 0 || request_size > 8) {
        PyErr_SetString(PyExc_ValueError, "Direct: bad kind, ranks, counts or sizes");
        return NULL;
    }
    Direct *self = (Direct *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->kind = kind;
    self->comm = comm;
    self->dtype = dtype;
    self->op = op;
    self->root = root;
    self->tag = tag;
    self->rank = rank;
    self->size = size;
    self->count = count;
    Py_INCREF(descr);
    self->descr = descr;
    self->itemsize = itemsize;
    self->in_len = in_len;
    self->out_len = out_len;
    self->block = block;
    return (PyObject *)self;
}

static void
Direct_dealloc(Direct *self)
{
    Py_XDECREF(self->descr);
    Py_XDECREF(self->held);
    PyMem_Free(self->stage);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Direct_methods[] = {
    {"go", (PyCFunction)(void (*)(void))Direct_go, METH_FASTCALL,
     "go(inp, out) -> bool: post on the arrays, test; True: complete; False: still running"},
    {"request", (PyCFunction)Direct_request, METH_NOARGS, "request() -> mpi4py Request of the running call"},
    {"spent", (PyCFunction)Direct_spent, METH_NOARGS, "spent() -> seconds the last go() tested without the GIL"},
    {"finish", (PyCFunction)Direct_finish, METH_NOARGS, "finish(): end a run that completed after go()"},
    {"abandon", (PyCFunction)Direct_abandon, METH_NOARGS, "abandon(): never run again; the arrays stay held"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject DirectType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commlib.backends._ready.Direct",
    .tp_basicsize = sizeof(Direct),
    .tp_dealloc = (destructor)Direct_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Direct(kind, comm, dtype, op, root, tag, rank, size, count, descr, itemsize, in_len, out_len, block): "
              "a large blocking call posted on the caller's arrays",
    .tp_methods = Direct_methods,
    .tp_new = Direct_new,
};

/* setup_direct(addresses, in_place, handle_size): MPI_Iallreduce, _Ibcast, _Ireduce, _Iallgather,
 * _Ireduce_scatter_block, _Ialltoall, _Igather, _Iscatter, _Isend, _Irecv (in that order), MPI_IN_PLACE's
 * value, and the size of a communicator/datatype/op handle (which must be an int's). */
PyObject *
setup_direct(PyObject *module, PyObject *args)
{
    unsigned long long a[10];
    long long place;
    int handle_size;
    (void)module;
    if (!PyArg_ParseTuple(args, "(KKKKKKKKKK)Li", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &a[7], &a[8],
                          &a[9], &place, &handle_size))
        return NULL;
    for (int i = 0; i < 10; i++) {
        if (!a[i]) {
            PyErr_SetString(PyExc_ValueError, "setup_direct: an MPI function is missing");
            return NULL;
        }
    }
    if (handle_size != (int)sizeof(handle_t)) {
        PyErr_SetString(PyExc_ValueError, "setup_direct: MPI's handles are not ints (not MPICH's ABI)");
        return NULL;
    }
    i_allreduce = (iallreduce_fn)(uintptr_t)a[0];
    i_bcast = (ibcast_fn)(uintptr_t)a[1];
    i_reduce = (ireduce_fn)(uintptr_t)a[2];
    i_allgather = (iallgather_fn)(uintptr_t)a[3];
    i_reduce_scatter_block = (ireduce_scatter_block_fn)(uintptr_t)a[4];
    i_alltoall = (iallgather_fn)(uintptr_t)a[5];
    i_gather = (igather_fn)(uintptr_t)a[6];
    i_scatter = (igather_fn)(uintptr_t)a[7];
    i_send = (ipoint_fn)(uintptr_t)a[8];
    i_recv = (ipoint_fn)(uintptr_t)a[9];
    in_place = (void *)(intptr_t)place;
    Py_RETURN_NONE;
}
