/* Direct: a large blocking collective run on the caller's own buffers, in one C call.
 *
 * A call above the persistent operations' size (commlib.backends.mpi.PERSISTENT_MAX) has no scratch buffers to
 * copy through: MPI reads and writes the caller's arrays. In Python, the checks, the post and the wait around
 * MPI's nonblocking call cost 5-10 us a call in a loop of 1 MiB calls (each transfer evicts the interpreter's
 * working set), 4-30 % of the transfer. Direct.go(inp, out) does the post and the wait in one C call: find the
 * arrays' memory, post the messages, and test them in a loop without the GIL for up to `block` seconds (as
 * spin() does). True: complete. False: still running; the caller waits with spin(seconds) and test() up to its
 * deadline and then calls finish() (or abandon() when it gave up: the arrays stay held for good). An
 * asynchronous call does start(inp, out), then the same.
 *
 * The messages ("own" steps, the default): point-to-point, Isend/Irecv on a communicator that carries nothing
 * else, each rank's tag the kind's and the step's, tested one request at a time with MPI_Test (a loop of
 * MPI_Testall moves a large transfer slower). broadcast (2 ranks), scatter, gather: the root sends or receives
 * every rank's part at once; all_gather, all_to_all: every rank posts a receive from rank - k and a send to
 * rank + k, k = 1 .. size-1, all at once; this rank's own chunk is copied while they move. The reductions cut
 * the array in pieces, one per rank (reduce_scatter: its chunks): step 1 sends each rank the others' copies of
 * its piece, which it reduces into its own (SUM: a loop the compiler vectorizes; other operations:
 * MPI_Reduce_local); step 2 sends the reduced pieces to every rank (all_reduce) or to the root (reduce).
 * MPICH's nonblocking collectives run a schedule engine and reduce with an unvectorized loop (MPI_Reduce_local
 * on 512 KiB of float32: 40 us, the loop here ~13 us): on 2 ranks, 1 MiB, its MPI_Iallreduce is 1.03x its
 * blocking MPI_Allreduce, these steps 0.75-0.85x (docs/benchmarks.md). A received message of another size
 * than this rank's is an error (MPI_ERR_TRUNCATE, as MPI's own collectives report a longer one).
 * Otherwise ("own" 0: COMMLIB_MPI_OWN_STEPS=0, broadcast on more than 2 ranks, send and recv) one MPI call:
 * MPI_Iallreduce, _Ibcast, _Ireduce, _Iallgather, _Ireduce_scatter_block, _Ialltoall, _Igather, _Iscatter,
 * _Isend, _Irecv.
 *
 * The group layer finds a Direct in the same tables as the ready operations (commlib.backends._direct), so
 * the front doors' checks, numbering and flight recorder serve it unchanged. Inputs that overlap the output
 * (other than all_gather's own chunk) and root lists that do not lie back to back go through a scratch buffer
 * of the Direct's own, as the generic path stages them.
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
typedef int (*reduce_local_fn)(const void *, void *, int, handle_t, handle_t);
typedef int (*get_count_fn)(const void *, handle_t, int *);

static iallreduce_fn i_allreduce;
static ibcast_fn i_bcast;
static ireduce_fn i_reduce;
static iallgather_fn i_allgather, i_alltoall;
static ireduce_scatter_block_fn i_reduce_scatter_block;
static igather_fn i_gather, i_scatter;
static ipoint_fn i_send, i_recv;
static void *in_place; /* MPI_IN_PLACE */
static reduce_local_fn reduce_local;
static get_count_fn get_count;
static int err_truncate; /* MPI_ERR_TRUNCATE */

/* the kinds, in the order of commlib.backends._direct.KINDS */
enum { ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER, SEND, RECV, KINDS };
enum { IDLE, RUNNING, ABANDONED };
/* all_reduce's sum of a received piece into this rank's: MPI_Reduce_local (any operation), or a loop over
 * float, double or (two's complement: signed alike) unsigned integers of 1, 2, 4 or 8 bytes */
enum { BY_MPI, SUM_F32, SUM_F64, SUM_U8, SUM_U16, SUM_U32, SUM_U64, SUMS };

typedef struct {
    PyObject_HEAD
    int kind, count, root, tag, rank, size; /* count: MPI's count (all_to_all: a block's); root: or the peer */
    handle_t comm, dtype, op;
    PyObject *descr;              /* the callers' dtype (a numpy descr) */
    Py_ssize_t itemsize, in_len, out_len; /* bytes of the input and of the output (a root list: of each item) */
    double block;                 /* seconds go() tests without the GIL */
    double spent;                 /* seconds the last go() spent so (0: it only tested a few times) */
    int state, spread;            /* spread: at completion, copy the stage into the root list (gather) */
    int own, sum, tags;           /* own: point-to-point steps; sum: BY_MPI or SUM_*; tags: step s adds s */
    int step, last, nreq, nrecv;  /* the step in flight (1..last), its requests (the first nrecv receive) */
    int tested;                   /* how many of them completed (in order) */
    Py_ssize_t slots;             /* a reduction's scratch slots: from here in the stage (slot()) */
    char *reqs, *stats;           /* 2 * size requests and statuses (one mode: the first) */
    int *want;                    /* the element count each receive of the step expects */
    char *send, *recv;            /* the run's input and output (NULL: none on this rank) */
    PyObject *held;               /* (inp, out) while running */
    int *split;                   /* an uneven all_to_all: each rank's send count, offset, receive count, offset
                                   * (4 rows of size, in elements); NULL: even blocks of count */
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
    default: /* all_gather, reduce_scatter, all_to_all: one input, one output (all_gather's None: in place) */
        if ((r = region(self, out, self->out_len, 1)) == NULL)
            return -1;
        if (self->kind == ALL_GATHER && inp == Py_None)
            s = r + self->rank * self->in_len;
        else if ((s = region(self, inp, self->in_len, 0)) == NULL)
            return -1;
        if (self->kind == ALL_GATHER && s == r + self->rank * self->in_len)
            s = self->own ? s : in_place; /* this rank's chunk of the output: MPI reads it there */
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

/* Post the one MPI call on (self->send, self->recv) as request 0; MPI's error code. */
static int
post(Direct *self)
{
    const void *s = self->send;
    char *recv = self->recv;
    void *req = self->reqs;
    int n = self->count;
    handle_t c = self->comm, t = self->dtype, op = self->op;
    self->nreq = 1;
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
        return i_send((void *)s, n, t, self->root, self->tag, c, req);
    default:
        return i_recv(recv, n, t, self->root, self->tag, c, req);
    }
}

/* -- own steps: point-to-point messages of the step in flight ------------------------------------------ */

/* A receive of n elements from peer into at (none for n 0: both sides skip it); receives come first. */
static int
own_recv(Direct *self, char *at, int n, int peer)
{
    if (n == 0)
        return 0;
    int i = self->nreq++, tag = self->tag + (self->tags ? self->step : 0);
    self->want[i] = n;
    self->nrecv++;
    return i_recv(at, n, self->dtype, peer, tag, self->comm, self->reqs + i * request_size);
}

static int
own_send(Direct *self, const char *at, int n, int peer)
{
    if (n == 0)
        return 0;
    int i = self->nreq++, tag = self->tag + (self->tags ? self->step : 0);
    return i_send((void *)at, n, self->dtype, peer, tag, self->comm, self->reqs + i * request_size);
}

/* The reductions' piece i: its first element, and its length. all_reduce and reduce cut the array in size
 * pieces (rank i reduces piece i); reduce_scatter's pieces are the input's chunks. */
static Py_ssize_t
piece_at(Direct *self, int i)
{
    if (self->kind == REDUCE_SCATTER)
        return (Py_ssize_t)self->count * i;
    return (Py_ssize_t)((long long)self->count * i / self->size);
}

static int
piece_len(Direct *self, int i)
{
    return (int)(piece_at(self, i + 1) - piece_at(self, i));
}

/* A reduction's scratch: slot k - 1 for the copy of this rank's piece from rank - k, then (reduce, off the
 * root) the piece's sum; from self->slots in the stage, each the widest piece */
static char *
slot(Direct *self, int k)
{
    Py_ssize_t width = (Py_ssize_t)piece_len(self, 0) + (self->kind == REDUCE_SCATTER ? 0 : 1);
    return self->stage + self->slots + (k - 1) * width * self->itemsize;
}

/* Where this rank's piece is summed: in place (all_reduce, reduce's root), the output (reduce_scatter), or
 * the slot after the received ones (reduce, off the root: its array is left alone) */
static char *
summed(Direct *self)
{
    if (self->kind == REDUCE_SCATTER)
        return self->recv;
    if (self->kind == REDUCE && self->rank != self->root)
        return slot(self, self->size);
    return self->recv + piece_at(self, self->rank) * self->itemsize;
}

/* Post the messages of step self->step (peers paired as rank - k and rank + k); MPI's error code.
 * broadcast: the root's array to every rank; scatter: each chunk of the root's to its rank; all_gather: every
 * chunk to every rank; all_to_all: block j of rank i to block i of rank j; gather: every chunk to the root.
 * The reductions: step 1, each rank
 * its piece (reduce_scatter from the input, the others in place); step 2 (after own_reduce), the summed
 * pieces to every rank (all_reduce) or to the root (reduce); reduce_scatter has none. */
static int
own_post(Direct *self)
{
    int p = self->size, me = self->rank, root = self->root, code = 0;
    Py_ssize_t len = self->in_len, z = self->itemsize;
    char *r = self->recv, *from_base = self->kind == REDUCE_SCATTER ? self->send : r;
    self->nreq = self->nrecv = self->tested = 0;
    if (self->kind == BROADCAST || self->kind == SCATTER) { /* the root to every rank: the array, or its chunk */
        int whole = self->kind == BROADCAST;
        if (me != root)
            return own_recv(self, r, self->count, root);
        for (int i = 0; i < p && !code; i++) {
            if (i != me)
                code = own_send(self, whole ? r : self->send + i * self->out_len, self->count, i);
        }
        return code;
    }
    if (self->kind == GATHER || (self->kind == REDUCE && self->step == 2)) {
        int gather = self->kind == GATHER;
        if (me != root)
            return gather ? own_send(self, self->send, self->count, root)
                          : own_send(self, summed(self), piece_len(self, me), root);
        for (int i = 0; i < p && !code; i++) {
            if (i != me)
                code = gather ? own_recv(self, r + i * len, self->count, i)
                              : own_recv(self, r + piece_at(self, i) * z, piece_len(self, i), i);
        }
        return code;
    }
    if (self->kind == REDUCE_SCATTER && self->step == 2)
        return 0;
    int *sp = self->split; /* an uneven all_to_all: counts and offsets */
    for (int k = 1; k < p && !code; k++) {
        int from = (me - k + p) % p;
        if (sp != NULL)
            code = own_recv(self, r + sp[3 * p + from] * z, sp[2 * p + from], from);
        else if (self->kind == ALL_GATHER || self->kind == ALL_TO_ALL) /* all_to_all: in_len / size a block */
            code = own_recv(self, r + from * (len / (self->kind == ALL_TO_ALL ? p : 1)), self->count, from);
        else if (self->step == 1) /* the others' copies of my piece */
            code = own_recv(self, slot(self, k), piece_len(self, me), from);
        else /* all_reduce: their pieces, summed */
            code = own_recv(self, r + piece_at(self, from) * z, piece_len(self, from), from);
    }
    for (int k = 1; k < p && !code; k++) {
        int to = (me + k) % p;
        if (sp != NULL)
            code = own_send(self, self->send + sp[p + to] * z, sp[to], to);
        else if (self->kind == ALL_GATHER)
            code = own_send(self, self->send, self->count, to);
        else if (self->kind == ALL_TO_ALL)
            code = own_send(self, self->send + to * (len / p), self->count, to);
        else if (self->step == 1)
            code = own_send(self, from_base + piece_at(self, to) * z, piece_len(self, to), to);
        else
            code = own_send(self, summed(self), piece_len(self, me), to);
    }
    return code;
}

#define SUM_LOOP(name, T)                                                                                          \
    static void name(char *restrict into, const char *restrict from, Py_ssize_t bytes)                            \
    {                                                                                                              \
        T *restrict a = (T *)into;                                                                                 \
        const T *restrict b = (const T *)from;                                                                     \
        for (Py_ssize_t i = 0, n = bytes / (Py_ssize_t)sizeof(T); i < n; i++)                                      \
            a[i] += b[i];                                                                                          \
    }
SUM_LOOP(sum_f32, float)
SUM_LOOP(sum_f64, double)
SUM_LOOP(sum_u8, uint8_t)
SUM_LOOP(sum_u16, uint16_t)
SUM_LOOP(sum_u32, uint32_t)
SUM_LOOP(sum_u64, uint64_t)
typedef void (*sum_fn)(char *restrict, const char *restrict, Py_ssize_t);
static const sum_fn sums[SUMS] = {NULL, sum_f32, sum_f64, sum_u8, sum_u16, sum_u32, sum_u64};

/* A reduction between its steps: the received copies of this rank's piece reduced into summed() (copied
 * there first where that is not the piece itself); MPI's code */
static int
own_reduce(Direct *self)
{
    int me = self->rank, n = piece_len(self, me), code = 0;
    Py_ssize_t z = self->itemsize;
    char *into = summed(self), *mine = (self->kind == REDUCE_SCATTER ? self->send : self->recv) + piece_at(self, me) * z;
    if (into != mine)
        memcpy(into, mine, (size_t)(n * z));
    for (int k = 1; k < self->size && !code; k++) {
        if (self->sum == BY_MPI)
            code = reduce_local(slot(self, k), into, n, self->dtype, self->op);
        else
            sums[self->sum](into, slot(self, k), n * z);
    }
    return code;
}

/* After a step's requests completed: each receive got the size this rank expects (else MPI_ERR_TRUNCATE) */
static int
own_counted(Direct *self)
{
    for (int i = 0; i < self->nrecv; i++) {
        int got = -1, code = get_count(self->stats + i * status_size, self->dtype, &got);
        if (code || got != self->want[i])
            return code ? code : err_truncate;
    }
    return 0;
}

/* Test the step in flight; once complete, do its local work and post the next. *done: the run is complete.
 * MPI's error code. Needs no GIL. */
static int
advance(Direct *self, int *done)
{
    int flag = 1, code = 0;
    *done = 0;
    while (self->tested < self->nreq) { /* one at a time: a loop of MPI_Testall moves data slower */
        int i = self->tested;
        code = mpi_test(self->reqs + i * request_size, &flag, self->stats + i * status_size);
        if (code || !flag)
            return code;
        self->tested++;
    }
    if (self->nreq) {
        if (self->own && (code = own_counted(self)))
            return code;
        self->nreq = self->tested = 0;
    }
    if (self->step >= self->last) {
        *done = 1;
        return 0;
    }
    if ((code = own_reduce(self))) /* the reductions: the steps between */
        return code;
    self->step++;
    return own_post(self);
}

/* advance() in a loop until the run is complete or seconds pass; needs no GIL */
static int
advance_until(Direct *self, double seconds, int *done)
{
    double due = monotonic() + seconds;
    int code;
    for (unsigned i = 1; !(code = advance(self, done)) && !*done; i++) {
        if ((i & 15) == 0 && monotonic() >= due)
            break;
    }
    return code;
}

/* This rank's own chunk or block, copied while the messages move (all_gather, gather's root, scatter's root,
 * all_to_all) */
static void
own_chunk(Direct *self)
{
    Py_ssize_t me = self->rank, len = self->in_len;
    char *to = self->recv, *from = self->send;
    switch (self->kind) {
    case ALL_GATHER:
    case GATHER:
        to = to == NULL ? NULL : to + me * len;
        break;
    case SCATTER:
        from = from == NULL ? NULL : from + me * self->out_len;
        len = self->out_len;
        break;
    case ALL_TO_ALL: {
        Py_ssize_t z = self->itemsize, p = self->size;
        int *sp = self->split;
        len = sp ? sp[me] * z : len / p;
        to += sp ? sp[3 * p + me] * z : me * len;
        from += sp ? sp[p + me] * z : me * len;
        break;
    }
    default:
        return;
    }
    if (to != NULL && from != NULL && to != from)
        memcpy(to, from, (size_t)len);
}

/* -- a run ----------------------------------------------------------------------------------------------- */

/* Start a run on (inp, out): place, hold, post (own: step 1, and this rank's own chunk copied). -1: error. */
static int
begin(Direct *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (go_arity(nargs) < 0)
        return -1;
    if (self->state != IDLE) {
        PyErr_SetString(PyExc_RuntimeError, self->state == RUNNING ? "Direct.go: the previous run has not ended"
                                                                   : "Direct.go: abandoned after a timeout or error");
        return -1;
    }
    PyObject *inp = args[0], *out = args[1];
    self->spread = 0;
    if (place(self, inp, out, &self->send, &self->recv) < 0)
        return -1;
    if (self->own && self->last == 2) { /* a reduction's slots, after an input staged by place() */
        int staged_in = self->send != NULL && self->send == self->stage;
        self->slots = staged_in ? self->in_len : 0;
        Py_ssize_t width = (Py_ssize_t)piece_len(self, 0) + (self->kind == REDUCE_SCATTER ? 0 : 1);
        if (stage(self, self->slots + self->size * width * self->itemsize) == NULL)
            return -1;
        if (staged_in)
            self->send = self->stage;
    }
    if ((self->held = PyTuple_Pack(2, inp, out)) == NULL)
        return -1;
    self->step = 1;
    self->nreq = self->tested = 0;
    int code = self->own ? own_post(self) : post(self);
    if (code) {
        if (self->nreq > 1) /* some were posted: MPI may use the arrays */
            self->state = ABANDONED;
        else
            Py_CLEAR(self->held);
        raise_mpi(code);
        return -1;
    }
    self->state = RUNNING;
    if (self->own)
        own_chunk(self);
    return 0;
}

/* A test's or a spin's outcome: an MPI error raised (the run abandoned), True or False. */
static PyObject *
outcome(Direct *self, int code, int done)
{
    if (code) {
        self->state = ABANDONED; /* MPI may still use the arrays: held for good */
        raise_mpi(code);
        return NULL;
    }
    return PyBool_FromLong(done);
}

static PyObject *
Direct_go(Direct *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, args, nargs) < 0)
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
    if (code || !done)
        return outcome(self, code, done);
    if (complete(self) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* start(inp, out): post a run and return (an asynchronous call; then test() or spin(), and finish()) */
static PyObject *
Direct_start(Direct *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, args, nargs) < 0)
        return NULL;
    self->spent = 0.0;
    Py_RETURN_NONE;
}

/* test(): whether the run is complete (moving it on to its next step); True also once finished */
static PyObject *
Direct_test(Direct *self, PyObject *unused)
{
    (void)unused;
    int done = self->state == IDLE, code = 0;
    if (self->state == RUNNING)
        code = advance(self, &done);
    return outcome(self, code, done);
}

/* spin(seconds): test in a loop without the GIL until complete (True) or seconds pass (False); None when
 * another thread spins (the caller polls test() instead) */
static PyObject *
Direct_spin(Direct *self, PyObject *arg)
{
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->state != RUNNING)
        return PyBool_FromLong(self->state == IDLE);
    if (spinning)
        Py_RETURN_NONE;
    int done = 0, code = 0;
    spinning = 1;
    Py_BEGIN_ALLOW_THREADS
    code = advance_until(self, seconds, &done);
    Py_END_ALLOW_THREADS
    spinning = 0;
    return outcome(self, code, done);
}

/* spent(): seconds the last go() tested without the GIL (the caller's wait has that much less time) */
static PyObject *
Direct_spent(Direct *self, PyObject *unused)
{
    (void)unused;
    return PyFloat_FromDouble(self->spent);
}

/* finish(): end a run that test() or spin() found complete (nothing after the run ended) */
static PyObject *
Direct_finish(Direct *self, PyObject *unused)
{
    (void)unused;
    if (self->state == RUNNING && complete(self) < 0)
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

static void
Direct_dealloc(Direct *self)
{
    PyObject *refs[] = {self->descr, self->held};
    void *blocks[] = {self->stage, self->reqs, self->split};
    release((PyObject *)self, refs, 2, blocks, 3);
}

/* An uneven all_to_all's split from counts (the send counts, then the receive counts, size of each, in
 * elements; own steps only): self->split. -1: error set. */
static int
uneven(Direct *self, PyObject *counts)
{
    Py_ssize_t p = self->size;
    if (!self->own || self->kind != ALL_TO_ALL || !PyTuple_CheckExact(counts) || PyTuple_GET_SIZE(counts) != 2 * p) {
        PyErr_SetString(PyExc_ValueError, "Direct: counts are an own all_to_all's 2 * size element counts");
        return -1;
    }
    if ((self->split = PyMem_Calloc(4 * (size_t)p, sizeof(int))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    long long at[2] = {0, 0}; /* the send and the receive offsets so far */
    for (Py_ssize_t i = 0; i < 2 * p; i++) {
        long c = PyLong_AsLong(PyTuple_GET_ITEM(counts, i));
        int side = i >= p;
        if ((c == -1 && PyErr_Occurred()) || c < 0 || c > INT32_MAX || at[side] + c > INT32_MAX) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "Direct: counts must be ints from 0 to 2**31 - 1, summing as much");
            return -1;
        }
        self->split[2 * side * p + i % p] = (int)c;
        self->split[(2 * side + 1) * p + i % p] = (int)at[side];
        at[side] += c;
    }
    return 0;
}

static PyObject *
Direct_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"kind", "comm", "dtype", "op", "root", "tag", "rank", "size", "count", "descr",
                            "itemsize", "in_len", "out_len", "block", "own", "sum", "tags", "counts", NULL};
    PyObject *counts = Py_None;
    if (i_allreduce == NULL || request_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "commlib.backends._ready: setup() and setup_direct() were not called");
        return NULL;
    }
    Direct *self = (Direct *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiiiiiiiiOnnnd|iiiO", names, &self->kind, &self->comm,
                                     &self->dtype, &self->op, &self->root, &self->tag, &self->rank, &self->size,
                                     &self->count, &self->descr, &self->itemsize, &self->in_len, &self->out_len,
                                     &self->block, &self->own, &self->sum, &self->tags, &counts)) {
        self->descr = NULL; /* borrowed, if it got that far */
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(self->descr);
    int kind = self->kind, size = self->size;
    if (kind < 0 || kind >= KINDS || size < 1 || self->rank < 0 || self->rank >= size || self->root < 0 ||
        self->root >= size || self->tag < 0 || self->count < 0 || self->itemsize < 1 || self->in_len < 0 ||
        self->out_len < 0 || request_size > 8 || self->sum < 0 || self->sum >= SUMS ||
        (self->own && (kind == SEND || kind == RECV))) {
        PyErr_SetString(PyExc_ValueError, "Direct: bad kind, ranks, counts or sizes");
        Py_DECREF(self);
        return NULL;
    }
    self->own = self->own != 0;
    self->tags = self->tags != 0;
    self->last = self->own && (kind == ALL_REDUCE || kind == REDUCE || kind == REDUCE_SCATTER) ? 2 : 1; /* reductions */
    size_t slots = self->own ? 2 * (size_t)size : 1; /* requests, statuses, counts: one block */
    if ((self->reqs = PyMem_Calloc(slots, (size_t)(request_size + status_size) + sizeof(int))) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->stats = self->reqs + slots * (size_t)request_size;
    self->want = (int *)(self->stats + slots * (size_t)status_size); /* 4-byte handles and statuses: aligned */
    if (counts != Py_None && uneven(self, counts) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMethodDef Direct_methods[] = {
    {"go", (PyCFunction)(void (*)(void))Direct_go, METH_FASTCALL,
     "go(inp, out) -> bool: post on the arrays, test; True: complete; False: still running"},
    {"start", (PyCFunction)(void (*)(void))Direct_start, METH_FASTCALL, "start(inp, out): post on the arrays"},
    {"test", (PyCFunction)Direct_test, METH_NOARGS, "test() -> bool: whether the run is complete"},
    {"spin", (PyCFunction)Direct_spin, METH_O, "spin(seconds) -> bool | None: test without the GIL"},
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
    .tp_doc = "Direct(kind, comm, dtype, op, root, tag, rank, size, count, descr, itemsize, in_len, out_len, block, "
              "own=0, sum=0, tags=0, counts=None): a large call run on the caller's arrays",
    .tp_methods = Direct_methods,
    .tp_new = Direct_new,
};

/* setup_direct(addresses, helpers, in_place, handle_size, truncate): MPI_Iallreduce, _Ibcast, _Ireduce,
 * _Iallgather, _Ireduce_scatter_block, _Ialltoall, _Igather, _Iscatter, _Isend, _Irecv (in that order);
 * MPI_Reduce_local and MPI_Get_count; MPI_IN_PLACE's value; the size of a communicator/datatype/op handle
 * (which must be an int's); MPI_ERR_TRUNCATE. */
PyObject *
setup_direct(PyObject *module, PyObject *args)
{
    unsigned long long a[12];
    long long place;
    int handle_size;
    (void)module;
    if (!PyArg_ParseTuple(args, "(KKKKKKKKKK)(KK)Lii", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &a[7],
                          &a[8], &a[9], &a[10], &a[11], &place, &handle_size, &err_truncate))
        return NULL;
    for (int i = 0; i < 12; i++) {
        if (!a[i]) {
            PyErr_SetString(PyExc_ValueError, "setup_direct: an MPI function is missing");
            return NULL;
        }
    }
    if (handle_size != (int)sizeof(handle_t)) {
        PyErr_SetString(PyExc_ValueError, "setup_direct: MPI's handles are not ints (not MPICH's ABI)");
        return NULL;
    }
    void **into[12] = {(void **)&i_allreduce, (void **)&i_bcast, (void **)&i_reduce, (void **)&i_allgather,
                       (void **)&i_reduce_scatter_block, (void **)&i_alltoall, (void **)&i_gather,
                       (void **)&i_scatter, (void **)&i_send, (void **)&i_recv, (void **)&reduce_local,
                       (void **)&get_count}; /* POSIX: function and data pointers alike */
    for (int i = 0; i < 12; i++)
        *into[i] = (void *)(uintptr_t)a[i];
    in_place = (void *)(intptr_t)place;
    Py_RETURN_NONE;
}
