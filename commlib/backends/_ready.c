/* commlib.backends._ready: commlib's hot paths in C. Optional: without it (no compiler at install,
 * or COMMLIB_NATIVE=0) the same steps run in Python, and the tests run both.
 *
 * Four parts, in this order:
 * - Runner: one run of a ready (persistent) MPI operation. A small blocking collective spends most of its
 *   time in Python around the MPI call: the copies, the start, the test loop. Runner.go(inp, out) does
 *   all of it in one call: copy inp into the operation's send buffer, start its requests, test them up to
 *   `tests` times (holding the GIL: a few tens of microseconds at most), and once complete copy the
 *   receive buffer into out. inp may be a list of arrays (scatter's root list: packed in rank order), and
 *   so may out (gather's root list: filled in rank order). It returns True (complete, out written) or
 *   False (still running: the caller waits with its deadline, then copies out itself), and raises
 *   mpi4py.MPI.Exception(code) for an MPI error. Python's Persistent.go / Exchange.go
 *   (commlib/backends/_mpi.py) do the same where this module was not built.
 * - spin(request, seconds): a large wait, MPI_Test in a loop without the GIL until done or a deadline.
 * - span(parts): whether a list of arrays lies back to back in one buffer (commlib._collectives.packed).
 * - summed / rooted / paired / plain / peer: the group layer's ready path of the small calls (checks, lookup, numbering,
 *   flight recorder, run) in one call, mirroring commlib._collectives' Python functions.
 * A fifth part lives in _direct.c (Direct: a large call run on the caller's arrays, as point-to-point steps
 * of commlib's own or one MPI nonblocking call); _ready.h holds what the two files share.
 * numpy arrays are read through their struct where commlib.arrays._layout found (and checked) it.
 *
 * No MPI header and no link to MPI: MPI_Start/Startall/Test/Testall are the addresses in the MPI
 * library mpi4py loaded (set once by setup()), and request handles are opaque values of the
 * library's own size, so this file builds with a C compiler alone and follows mpi4py's MPI.
 */
#include "_ready.h"
#include "structmember.h" /* PyMemberDescrObject, T_OBJECT_EX: the slots read straight */

static start_fn mpi_start;
static startall_fn mpi_startall;
test_fn mpi_test;
testall_fn mpi_testall;
Py_ssize_t request_size, status_size;
static PyObject *mpi_exception; /* mpi4py.MPI.Exception */
static PyObject *spread, *pack;  /* Python fallbacks of copy_list: spread(list, whole), pack(list, whole) */
PyTypeObject *request_type;
Py_ssize_t handle_offset;
int spinning;

/* numpy's array struct, read where setup_array() was told (commlib.arrays._layout checks the offsets on
 * real arrays first): the data pointer, the dimensions, NPY_ARRAY_* flags and the dtype (its descr object).
 * Asking numpy through the buffer protocol costs ~70-100 ns an array; these reads cost nothing. Until
 * setup_array() is called (or if it never is) everything goes through the buffer protocol. */
PyTypeObject *array_type;
Py_ssize_t off_data, off_nd, off_dims, off_flags, off_descr;

/* Whether a is a plain numpy array of dtype descr, C-contiguous (and writable if asked), of len bytes
 * (itemsize: descr's). */
int
array_fits(PyObject *a, PyObject *descr, Py_ssize_t itemsize, Py_ssize_t len, int writable)
{
    if (array_type == NULL || Py_TYPE(a) != array_type || ARRAY_DESCR(a) != descr)
        return 0;
    int want = writable ? C_CONTIGUOUS | WRITEABLE : C_CONTIGUOUS;
    if ((ARRAY_FLAGS(a) & want) != want)
        return 0;
    Py_ssize_t n = itemsize, nd = ARRAY_ND(a), *dims = ARRAY_DIMS(a);
    for (Py_ssize_t i = 0; i < nd; i++)
        n *= dims[i];
    return n == len;
}

typedef struct {
    PyObject_HEAD
    int count;            /* requests */
    char *requests;       /* count handles of request_size bytes */
    char *statuses;       /* count statuses of status_size bytes */
    PyObject *send, *recv; /* the operation's buffers, or None */
    PyObject *own_dst, *own_src; /* a block copied from own_src to own_dst after the start, or None */
    int raw;              /* the callers' arrays have the buffers' dtype: plain byte copies */
    int tests;
    char *send_at, *recv_at;          /* the buffers' memory (they hold it for the Runner's life) */
    Py_ssize_t send_len, recv_len, itemsize;
    PyObject *descr;                  /* the buffers' dtype, where raw and numpy's layout is known */
} Runner;

int
raise_mpi(int code)
{
    PyObject *exc = PyObject_CallFunction(mpi_exception, "i", code);
    if (exc != NULL) {
        PyErr_SetObject(mpi_exception, exc);
        Py_DECREF(exc);
    }
    return -1;
}

/* dst[...] = src: a byte copy where both export contiguous buffers of one length, else numpy's own. */
static int
copy(PyObject *dst, PyObject *src, int raw)
{
    if (raw) {
        Py_buffer d, s;
        if (PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
            if (PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS) == 0) {
                int same = s.len == d.len;
                if (same)
                    memcpy(d.buf, s.buf, (size_t)s.len);
                PyBuffer_Release(&s);
                PyBuffer_Release(&d);
                if (same)
                    return 0;
            }
            else {
                PyBuffer_Release(&d);
                PyErr_Clear();
            }
        }
        else
            PyErr_Clear(); /* e.g. bfloat16, which numpy does not export */
    }
    return PyObject_SetItem(dst, Py_Ellipsis, src);
}

/* The chunks of a list of arrays and one whole buffer, in rank order: gather's root list filled from the
 * operation's receive buffer (out), or scatter's root list packed into its send buffer (!out). Byte copies
 * where every array exports a buffer of a chunk's length, else the Python fallback set up for it. */
static int
copy_list(PyObject *list, PyObject *whole, int out, int raw)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    Py_buffer w;
    int done = 0;
    if (raw && n > 0 && PyObject_GetBuffer(whole, &w, (out ? 0 : PyBUF_WRITABLE) | PyBUF_C_CONTIGUOUS) == 0) {
        Py_ssize_t chunk = w.len / n, i;
        for (i = 0; chunk * n == w.len && i < n; i++) {
            Py_buffer a;
            PyObject *item = PyList_GET_ITEM(list, i);
            if (PyObject_GetBuffer(item, &a, (out ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
                PyErr_Clear();
                break;
            }
            Py_ssize_t len = a.len;
            if (len == chunk) {
                if (out)
                    memcpy(a.buf, (char *)w.buf + i * chunk, (size_t)chunk);
                else
                    memcpy((char *)w.buf + i * chunk, a.buf, (size_t)chunk);
            }
            PyBuffer_Release(&a);
            if (len != chunk)
                break;
        }
        done = chunk * n == w.len && i == n;
        PyBuffer_Release(&w);
    }
    else if (raw && n > 0)
        PyErr_Clear();
    if (done)
        return 0;
    PyObject *r = PyObject_CallFunctionObjArgs(out ? spread : pack, list, whole, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int
test_all(Runner *self, int *flag)
{
    if (self->count == 1)
        return mpi_test(self->requests, flag, self->statuses);
    return mpi_testall(self->count, self->requests, flag, self->statuses);
}

/* inp (an array, or a list of equal chunks in rank order) into the buffer at (at, len), or out of it into out,
 * by reading the arrays' structs: 1 copied, 0 not plain arrays of the buffer's dtype (the caller copies). */
static int
fast_copy(Runner *self, PyObject *arrays, char *at, Py_ssize_t len, int out)
{
    if (!self->raw || self->descr == NULL || at == NULL)
        return 0;
    if (!PyList_CheckExact(arrays)) {
        if (!array_fits(arrays, self->descr, self->itemsize, len, out))
            return 0;
        if (out)
            memcpy(ARRAY_DATA(arrays), at, (size_t)len);
        else
            memcpy(at, ARRAY_DATA(arrays), (size_t)len);
        return 1;
    }
    Py_ssize_t n = PyList_GET_SIZE(arrays), chunk = n ? len / n : 0;
    if (n == 0 || chunk * n != len)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!array_fits(PyList_GET_ITEM(arrays, i), self->descr, self->itemsize, chunk, out))
            return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char *a = ARRAY_DATA(PyList_GET_ITEM(arrays, i));
        if (out)
            memcpy(a, at + i * chunk, (size_t)chunk);
        else
            memcpy(at + i * chunk, a, (size_t)chunk);
    }
    return 1;
}

int
go_arity(Py_ssize_t nargs)
{
    if (nargs == 2)
        return 0;
    PyErr_SetString(PyExc_TypeError, "go(inp, out) takes 2 arguments");
    return -1;
}

static PyObject *
Runner_go(Runner *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (go_arity(nargs) < 0)
        return NULL;
    PyObject *inp = args[0], *out = args[1];
    int code, flag = 0;
    if (inp != Py_None && self->send != Py_None && !fast_copy(self, inp, self->send_at, self->send_len, 0)) {
        if ((PyList_CheckExact(inp) ? copy_list(inp, self->send, 0, self->raw) : copy(self->send, inp, self->raw)) < 0)
            return NULL;
    }
    if (self->count == 1)
        code = mpi_start(self->requests);
    else
        code = self->count ? mpi_startall(self->count, self->requests) : 0;
    if (code) {
        raise_mpi(code);
        return NULL;
    }
    if (self->own_dst != Py_None && copy(self->own_dst, self->own_src, 1) < 0)
        return NULL;
    if (self->count == 0)
        flag = 1;
    for (int i = 0; !flag && i < self->tests; i++) {
        if ((code = test_all(self, &flag)) != 0) {
            raise_mpi(code);
            return NULL;
        }
    }
    if (!flag)
        Py_RETURN_FALSE;
    if (out != Py_None && self->recv != Py_None && !fast_copy(self, out, self->recv_at, self->recv_len, 1)) {
        if ((PyList_CheckExact(out) ? copy_list(out, self->recv, 1, self->raw) : copy(out, self->recv, self->raw)) < 0)
            return NULL;
    }
    Py_RETURN_TRUE;
}

static PyObject *
Runner_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"handles", "send", "recv", "own_dst", "own_src", "raw", "tests", NULL};
    PyObject *handles, *send, *recv, *own_dst = Py_None, *own_src = Py_None;
    int raw = 0, tests = 256;
    if (mpi_start == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "commlib.backends._ready: setup() was not called");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|OOpi", names, &handles, &send, &recv, &own_dst, &own_src,
                                     &raw, &tests))
        return NULL;
    PyObject *seq = PySequence_Fast(handles, "handles must be a sequence of request handles");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Runner *self = (Runner *)type->tp_alloc(type, 0);
    if (self == NULL || n > INT_MAX) {
        Py_XDECREF(self);
        Py_DECREF(seq);
        return n > INT_MAX ? PyErr_NoMemory() : NULL;
    }
    self->count = (int)n;
    self->requests = PyMem_Calloc((size_t)(n ? n : 1), (size_t)request_size);
    self->statuses = PyMem_Calloc((size_t)(n ? n : 1), (size_t)status_size);
    if (self->requests == NULL || self->statuses == NULL) {
        Py_DECREF(seq);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* mpi4py's handle: the C value as an int (MPICH's int handles come sign-extended) */
        unsigned long long h = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            Py_DECREF(self);
            return NULL;
        }
        char *slot = self->requests + i * request_size;
        if (request_size == sizeof(int)) {
            unsigned int v = (unsigned int)h;
            memcpy(slot, &v, sizeof v);
        }
        else
            memcpy(slot, &h, (size_t)(request_size < 8 ? request_size : 8));
    }
    Py_DECREF(seq);
    Py_INCREF(send);
    Py_INCREF(recv);
    Py_INCREF(own_dst);
    Py_INCREF(own_src);
    self->send = send;
    self->recv = recv;
    self->own_dst = own_dst;
    self->own_src = own_src;
    self->raw = raw;
    self->tests = tests;
    if (raw && array_type != NULL) { /* plain numpy buffers of one dtype: their memory and dtype, for fast_copy */
        PyObject *bufs[2] = {send, recv};
        char **ats[2] = {&self->send_at, &self->recv_at};
        Py_ssize_t *lens[2] = {&self->send_len, &self->recv_len};
        for (int i = 0; i < 2; i++) {
            PyObject *b = bufs[i];
            if (b == Py_None || Py_TYPE(b) != array_type || !(ARRAY_FLAGS(b) & C_CONTIGUOUS))
                continue;
            Py_buffer v;
            if (PyObject_GetBuffer(b, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
                PyErr_Clear();
                continue;
            }
            if (self->descr == NULL || ARRAY_DESCR(b) == self->descr) {
                *ats[i] = v.buf;
                *lens[i] = v.len;
                self->itemsize = v.itemsize;
                if (self->descr == NULL) {
                    self->descr = ARRAY_DESCR(b);
                    Py_INCREF(self->descr);
                }
            }
            PyBuffer_Release(&v);
        }
    }
    return (PyObject *)self;
}

/* A tp_dealloc's body: drop the references (NULLs allowed), free the PyMem blocks, then the object. */
void
release(PyObject *self, PyObject *const *refs, int nrefs, void *const *blocks, int nblocks)
{
    for (int i = 0; i < nrefs; i++)
        Py_XDECREF(refs[i]);
    for (int i = 0; i < nblocks; i++)
        PyMem_Free(blocks[i]);
    Py_TYPE(self)->tp_free(self);
}

static void
Runner_dealloc(Runner *self)
{
    PyObject *refs[] = {self->send, self->recv, self->own_dst, self->own_src, self->descr};
    void *blocks[] = {self->requests, self->statuses};
    release((PyObject *)self, refs, 5, blocks, 2);
}

static PyMethodDef Runner_methods[] = {
    {"go", (PyCFunction)(void (*)(void))Runner_go, METH_FASTCALL,
     "go(inp, out) -> bool: copy inp in, start, test; True: complete and copied into out; False: still running"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RunnerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commlib.backends._ready.Runner",
    .tp_basicsize = sizeof(Runner),
    .tp_dealloc = (destructor)Runner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Runner(handles, send, recv, own_dst=None, own_src=None, raw=False, tests=256): runs a ready operation",
    .tp_methods = Runner_methods,
    .tp_new = Runner_new,
};

static PyObject *
setup(PyObject *module, PyObject *args)
{
    unsigned long long start, startall, test, testall;
    PyObject *exception, *spread_fn, *pack_fn, *req_type;
    Py_ssize_t offset;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKKKnnOOOO!n", &start, &startall, &test, &testall, &request_size, &status_size,
                          &exception, &spread_fn, &pack_fn, &PyType_Type, &req_type, &offset))
        return NULL;
    if (!start || !startall || !test || !testall || request_size < 1 || request_size > 8 || status_size < 1 ||
        status_size > 256 || offset < (Py_ssize_t)sizeof(PyObject) ||
        offset + request_size > ((PyTypeObject *)req_type)->tp_basicsize) {
        PyErr_SetString(PyExc_ValueError, "setup: bad MPI function addresses or handle sizes");
        return NULL;
    }
    mpi_start = (start_fn)(uintptr_t)start;
    mpi_startall = (startall_fn)(uintptr_t)startall;
    mpi_test = (test_fn)(uintptr_t)test;
    mpi_testall = (testall_fn)(uintptr_t)testall;
    Py_INCREF(exception);
    Py_XSETREF(mpi_exception, exception);
    Py_INCREF(spread_fn);
    Py_XSETREF(spread, spread_fn);
    Py_INCREF(pack_fn);
    Py_XSETREF(pack, pack_fn);
    Py_INCREF(req_type);
    Py_XSETREF(request_type, (PyTypeObject *)req_type);
    handle_offset = offset;
    Py_RETURN_NONE;
}

double
monotonic(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int
test_until(void *handle, double seconds, int *flag, void *status)
{
    double due = monotonic() + seconds;
    int code;
    for (unsigned i = 1; !(code = mpi_test(handle, flag, status)) && !*flag; i++) {
        if ((i & 15) == 0 && monotonic() >= due)
            break;
    }
    return code;
}

/* spin(request, seconds): test an mpi4py Request in a loop, without the GIL, until it completes (True) or
 * seconds pass (False); None when another thread is spinning here (the caller polls instead). A loop of
 * MPI_Test in C progresses a transfer as MPI_Wait does, and unlike MPI_Wait it ends at a deadline. */
static PyObject *
spin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || request_type == NULL || !PyObject_TypeCheck(args[0], request_type)) {
        PyErr_SetString(PyExc_TypeError, "spin(request, seconds) takes an mpi4py Request and a float (after setup)");
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (spinning)
        Py_RETURN_NONE;
    spinning = 1;
    void *handle = (char *)args[0] + handle_offset;
    char status[256];
    int flag = 0, code = 0;
    Py_BEGIN_ALLOW_THREADS
    code = test_until(handle, seconds, &flag, status);
    Py_END_ALLOW_THREADS
    spinning = 0;
    if (code) {
        raise_mpi(code);
        return NULL;
    }
    return PyBool_FromLong(flag);
}

/* The end of obj's chain of `base` attributes of obj's own type (numpy: the array whose memory obj views);
 * a new reference. */
static PyObject *
chain_root(PyObject *obj)
{
    PyTypeObject *type = Py_TYPE(obj);
    Py_INCREF(obj);
    for (;;) {
        PyObject *base = PyObject_GetAttrString(obj, "base");
        if (base == NULL) {
            PyErr_Clear();
            return obj;
        }
        if (Py_TYPE(base) != type) {
            Py_DECREF(base);
            return obj;
        }
        Py_DECREF(obj);
        obj = base;
    }
}

/* span(parts): whether a list of arrays lies back to back, in order, in the memory of one root array (the
 * end of each one's chain of bases), with one element format. (root, root's address or -1 where the root is
 * not contiguous, root's length in bytes, start, end) where it does; False where it does not; None where it
 * cannot tell (an item exports no C-contiguous buffer: not contiguous, or bfloat16, which numpy does not
 * export). About 0.3 us for two arrays, against 3 us in Python (commlib._collectives.packed). */
static PyObject *
span(PyObject *module, PyObject *parts)
{
    (void)module;
    if (!PyList_CheckExact(parts) || PyList_GET_SIZE(parts) == 0)
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(parts);
    PyObject *first = PyList_GET_ITEM(parts, 0), *root = NULL;
    char *start = NULL, *at = NULL, format[32] = "";
    Py_ssize_t itemsize = 0;
    int verdict = 1; /* 1 back to back, 0 not, -1 cannot tell */
    for (Py_ssize_t i = 0; i < n && verdict == 1; i++) {
        PyObject *item = PyList_GET_ITEM(parts, i);
        Py_buffer v;
        if (Py_TYPE(item) != Py_TYPE(first)) {
            verdict = 0;
            break;
        }
        if (PyObject_GetBuffer(item, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            verdict = -1;
            break;
        }
        const char *f = v.format ? v.format : "B";
        int same = i == 0 || (v.itemsize == itemsize && strcmp(f, format) == 0 && (char *)v.buf == at);
        if (i == 0) {
            if (strlen(f) >= sizeof format)
                verdict = -1;
            else
                strcpy(format, f);
            itemsize = v.itemsize;
            start = at = v.buf;
        }
        at += v.len;
        PyBuffer_Release(&v);
        if (!same || verdict != 1) {
            verdict = same ? verdict : 0;
            break;
        }
        PyObject *r = chain_root(item);
        if (i == 0)
            root = r;
        else {
            same = r == root;
            Py_DECREF(r);
            if (!same)
                verdict = 0;
        }
    }
    if (verdict != 1) {
        Py_XDECREF(root);
        if (verdict == 0)
            Py_RETURN_FALSE;
        Py_RETURN_NONE;
    }
    long long base = -1, size = 0;
    Py_buffer w;
    if (PyObject_GetBuffer(root, &w, PyBUF_C_CONTIGUOUS) == 0) {
        base = (long long)(uintptr_t)w.buf;
        size = (long long)w.len;
        PyBuffer_Release(&w);
    }
    else
        PyErr_Clear();
    return Py_BuildValue("(NLLLL)", root, base, size, (long long)(uintptr_t)start, (long long)(uintptr_t)at);
}

/* ---- The group layer's ready path for rooted calls, in C -------------------------------------------------
 *
 * rooted(call, tensor, root, group, group_root, async_op, mode, items) runs a blocking broadcast,
 * reduce (mode 0: in place), gather (mode 1: items is the root's output list) or scatter (mode 2: items is
 * the root's input list) through the group's ready operation, as commlib._collectives.ready_rooted,
 * commlib._composed._plain and commlib._collectives.run_ready do in Python: True when it ran the call;
 * False when the generic path must (another group, an async call, a new shape, a list that is not plain);
 * the group's ready table of the call has the call's name. Set up by setup_array() and setup_rooted() with
 * the group layer's objects; COMMLIB_NATIVE=0, no build or another numpy layout: the Python functions. */
static PyObject *fr_state, *fr_starts, *fr_ends, *fr_slots, *fr_rest;
static PyTypeObject *fr_group_type;
static PyObject *fr_one, *fr_zero, *fr_minus_one; /* 1, 0, -1 */
static PyObject *s_world, *s_ready, *s_pending, *s_rank, *s_size, *s_seq, *s_shape, *s_dtype, *s_count, *s_go;
static PyObject *s_sums, *s_all_reduce, *fr_sum; /* fr_sum: ReduceOp.SUM */

/* The group layer's objects keep their state in __slots__: o.name read (or written) straight from o's struct
 * at the slot's offset, cached per (type, name) in a small table that holds the type (so its address is never
 * reused), instead of PyObject_GetAttr's lookups (~20 ns each, a dozen a call). Only where Python would do the
 * same: the type's generic getattr/setattr, a plain writable object slot of a class in the type's MRO, and the
 * type unchanged since (its version tag, which CPython resets when a class changes). Anything else (off -1), or
 * a slot not set yet, goes through PyObject_GetAttr/SetAttr. */
#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))
#define SLOT_CACHE 64 /* entries; a pair lives in one of PROBES after its hash (no two pairs evict each other) */
#define PROBES 4
static struct {
    PyTypeObject *type;
    PyObject *name;
    Py_ssize_t off;
    unsigned int version; /* the type's tp_version_tag when cached */
} slot_cache[SLOT_CACHE];

/* name's offset in o's type when Python's o.name would read (and write) just that slot; else -1 */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name)
{
    if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_setattro != PyObject_GenericSetAttr)
        return -1;
    PyObject *d = PyObject_GetAttr((PyObject *)type, name);
    Py_ssize_t off = -1;
    if (d == NULL)
        PyErr_Clear(); /* not an attribute of the type (or its lookup failed): the generic path decides */
    else if (Py_IS_TYPE(d, &PyMemberDescr_Type) && PyType_IsSubtype(type, PyDescr_TYPE(d))) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY) && m->offset >= (Py_ssize_t)sizeof(PyObject) &&
            m->offset + (Py_ssize_t)sizeof(PyObject *) <= type->tp_basicsize)
            off = m->offset;
    }
    Py_XDECREF(d);
    return off;
}

static Py_ssize_t
slot_of(PyObject *o, PyObject *name)
{
    PyTypeObject *type = Py_TYPE(o);
    int current = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
    size_t h = ((uintptr_t)type >> 4) * 31u + ((uintptr_t)name >> 4), i, free = SLOT_CACHE;
    for (i = 0; i < PROBES; i++) {
        size_t at = (h + i) % SLOT_CACHE;
        if (slot_cache[at].type == type && slot_cache[at].name == name) {
            if (current && slot_cache[at].version == type->tp_version_tag)
                return slot_cache[at].off;
            free = at; /* the class changed since: look again, in place */
            break;
        }
        if (slot_cache[at].type == NULL && free == SLOT_CACHE)
            free = at;
    }
    Py_ssize_t off = slot_offset(type, name); /* its lookup gives the type a version tag */
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        return -1; /* none to check later: not cached */
    size_t at = free < SLOT_CACHE ? free : h % SLOT_CACHE; /* all taken: the first is replaced */
    PyTypeObject *old = slot_cache[at].type;
    Py_INCREF(type);
    slot_cache[at].type = type;
    slot_cache[at].name = name; /* interned and kept for good (the s_* names) */
    slot_cache[at].off = off;
    slot_cache[at].version = type->tp_version_tag;
    Py_XDECREF(old); /* last: a finalizer it runs sees a whole entry */
    return off;
}

/* o.name: a new reference, or NULL with an error */
static PyObject *
attr(PyObject *o, PyObject *name)
{
    Py_ssize_t off = slot_of(o, name);
    PyObject *v = off >= 0 ? SLOT(o, off) : NULL;
    if (v == NULL)
        return PyObject_GetAttr(o, name);
    Py_INCREF(v);
    return v;
}

/* o.name = v; -1 with an error */
static int
set_attr(PyObject *o, PyObject *name, PyObject *v)
{
    Py_ssize_t off = slot_of(o, name);
    if (off < 0)
        return PyObject_SetAttr(o, name, v);
    Py_INCREF(v);
    Py_XSETREF(SLOT(o, off), v);
    return 0;
}

static PyObject *
now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return PyLong_FromLongLong((long long)t.tv_sec * 1000000000LL + (long long)t.tv_nsec);
}

/* _plain: None off the root; on it a list of size arrays of like's type, dtype (the same object) and shape,
 * writable where asked. 1 yes, 0 no, -2 error. */
static int
plain_list(PyObject *items, int is_root, Py_ssize_t size, PyObject *like, int writable)
{
    if (!is_root)
        return items == Py_None;
    if (!PyList_CheckExact(items) || PyList_GET_SIZE(items) != size)
        return 0;
    PyObject *shape = PyObject_GetAttr(like, s_shape);
    int verdict = shape == NULL ? -2 : 1;
    for (Py_ssize_t i = 0; verdict == 1 && i < size; i++) {
        PyObject *a = PyList_GET_ITEM(items, i);
        if (Py_TYPE(a) != array_type || ARRAY_DESCR(a) != ARRAY_DESCR(like) ||
            (writable && !(ARRAY_FLAGS(a) & WRITEABLE))) {
            verdict = 0;
            break;
        }
        PyObject *sh = PyObject_GetAttr(a, s_shape);
        int same = sh == NULL ? -1 : PyObject_RichCompareBool(sh, shape, Py_EQ);
        Py_XDECREF(sh);
        verdict = same < 0 ? -2 : same;
    }
    Py_XDECREF(shape);
    return verdict;
}

/* After p.go() gave result (a new reference: False, not complete; NULL, it raised): the group layer's rest
 * (g, call, p, out, seq, slot, exception or None), which waits, or fences the group and raises. Its result. */
static PyObject *
rest(PyObject *result, PyObject *g, PyObject *call, PyObject *p, PyObject *out, PyObject *seq, PyObject *slot)
{
    PyObject *exc = NULL;
    if (result == NULL) { /* go raised: rest() raises it as the group's failure */
        PyObject *type, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (exc != NULL && tb != NULL)
            PyException_SetTraceback(exc, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
    }
    Py_XDECREF(result);
    result = PyObject_CallFunctionObjArgs(fr_rest, g, call, p, out, seq, slot, exc ? exc : Py_None, NULL);
    Py_XDECREF(exc);
    return result;
}

/* run_ready: number the call, record its start, p.go(inp, out), record its end; rest() where go did not
 * complete or raised (it waits, or fences the group and raises). A new reference to None, or NULL. */
static PyObject *
run_recorded(PyObject *g, PyObject *call, PyObject *p, PyObject *inp, PyObject *out)
{
    PyObject *old = attr(g, s_seq);
    if (old == NULL)
        return NULL;
    PyObject *seq = PyNumber_Add(old, fr_one);
    Py_DECREF(old);
    if (seq == NULL)
        return NULL;
    PyObject *slot = NULL, *dtype = NULL, *count = NULL, *t = NULL, *entry = NULL, *go = NULL, *result = NULL;
    if (set_attr(g, s_seq, seq) < 0 || (slot = PyIter_Next(fr_slots)) == NULL)
        goto fail;
    if ((dtype = attr(p, s_dtype)) == NULL || (count = attr(p, s_count)) == NULL)
        goto fail;
    if ((t = now_ns()) == NULL || (entry = PyTuple_Pack(6, g, call, dtype, count, seq, t)) == NULL)
        goto fail;
    if (PyObject_SetItem(fr_starts, slot, entry) < 0 || (go = attr(p, s_go)) == NULL)
        goto fail;
    PyObject *pair[2] = {inp, out};
    result = PyObject_Vectorcall(go, pair, 2, NULL);
    if (result == Py_True) {
        Py_CLEAR(t);
        if ((t = now_ns()) == NULL || PyObject_SetItem(fr_ends, slot, t) < 0)
            goto fail;
        Py_INCREF(Py_None);
        Py_SETREF(result, Py_None);
    }
    else
        result = rest(result, g, call, p, out, seq, slot);
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_DECREF(seq);
    Py_XDECREF(slot);
    Py_XDECREF(dtype);
    Py_XDECREF(count);
    Py_XDECREF(t);
    Py_XDECREF(entry);
    Py_XDECREF(go);
    return result;
}

/* The group of a blocking call (new reference in *g, also on failure) and its ready table `table` (new
 * reference in *ops; table NULL: the group's sums, all_reduce's table): 1; 0 when the group cannot run a ready
 * operation now (not a ProcessGroup, no ready tables, calls pending); -1 on error. */
static int
group_ops(PyObject *group, PyObject *table, PyObject **g, PyObject **ops)
{
    *ops = NULL;
    if (group == Py_None)
        *g = attr(fr_state, s_world);
    else {
        Py_INCREF(group);
        *g = group;
    }
    if (*g == NULL)
        return -1;
    if (Py_TYPE(*g) != fr_group_type)
        return 0;
    PyObject *ready = attr(*g, table ? s_ready : s_sums), *pending = ready ? attr(*g, s_pending) : NULL;
    int busy = pending ? PyObject_IsTrue(pending) : -1, result = busy < 0 ? -1 : 0;
    if (busy == 0 && ready != Py_None) {
        *ops = table ? PyObject_GetItem(ready, table) : Py_NewRef(ready);
        result = *ops ? 1 : -1;
    }
    Py_XDECREF(ready);
    Py_XDECREF(pending);
    return result;
}

/* ops[key] (a new reference), or NULL: none (no error set) or an error. */
static PyObject *
lookup(PyObject *ops, PyObject *key)
{
    PyObject *p = PyDict_CheckExact(ops) ? PyDict_GetItemWithError(ops, key) : NULL;
    Py_XINCREF(p);
    return p;
}

/* A front door's group (*g, a new reference, also on failure) and ready operation (*p, a new reference or NULL):
 * the group's table `table` (NULL: its sums), entry (tensor's shape, tensor's dtype, a, b) (a, b: NULL for none;
 * tensor NULL: the entry ()). 1 found; 0 the generic path; -1 error. */
static int
ready_for(PyObject *group, PyObject *table, PyObject *tensor, PyObject *a, PyObject *b, PyObject **g, PyObject **p)
{
    PyObject *ops, *shape = NULL, *key = NULL;
    *p = NULL;
    int verdict = group_ops(group, table, g, &ops);
    if (verdict == 1 && tensor == NULL)
        key = PyTuple_New(0);
    else if (verdict == 1 && (shape = PyObject_GetAttr(tensor, s_shape)) != NULL) {
        PyObject *descr = ARRAY_DESCR(tensor);
        key = a == NULL ? PyTuple_Pack(2, shape, descr)
                        : b == NULL ? PyTuple_Pack(3, shape, descr, a) : PyTuple_Pack(4, shape, descr, a, b);
    }
    if (verdict == 1)
        verdict = key == NULL ? -1 : (*p = lookup(ops, key)) != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
    Py_XDECREF(ops);
    Py_XDECREF(shape);
    Py_XDECREF(key);
    return verdict;
}

/* The end of every front door but peer(): where verdict is 1 run p (run_recorded); release g and p; answer True
 * (ran), False (verdict 0: the generic path) or NULL (-1: an error raised). */
static PyObject *
answer(int verdict, PyObject *g, PyObject *call, PyObject *p, PyObject *inp, PyObject *out)
{
    if (verdict == 1) {
        PyObject *r = run_recorded(g, call, p, inp, out);
        verdict = r != NULL ? 1 : -1;
        Py_XDECREF(r);
    }
    Py_XDECREF(g);
    Py_XDECREF(p);
    return verdict < 0 ? NULL : PyBool_FromLong(verdict);
}

/* 0 where a front door got its `want` arguments after setup_rooted(); else -1 with a TypeError giving its usage. */
static int
arity(Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs == want && fr_rest != NULL)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s, after setup_rooted()", usage);
    return -1;
}

/* A front door: a METH_FASTCALL function of the module taking exactly `n` arguments (after setup_rooted(); else a
 * TypeError giving `usage`), documented as `usage` then `doc` (DOOR_METHOD makes its entry in the module's table).
 * FRONT_DOOR(name, n, usage, doc) { body } defines name() and its body, which reads args[0] to args[n - 1]; the body
 * has one caller and is inlined. */
#define FRONT_DOOR(name, n, usage, doc)                                                                             \
    PyDoc_STRVAR(name##_doc, usage doc);                                                                            \
    static inline PyObject *name##_body(PyObject *const *args);                                                     \
    static PyObject *name(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)                     \
    {                                                                                                               \
        return arity(nargs, n, usage) < 0 ? NULL : name##_body(args);                                               \
    }                                                                                                               \
    static inline PyObject *name##_body(PyObject *const *args)
#define DOOR_METHOD(name) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, name##_doc}

/* ready_for() then answer(): the doors whose operation needs nothing more than its key. */
static PyObject *
ready_answer(PyObject *group, PyObject *table, PyObject *tensor, PyObject *call, PyObject *inp, PyObject *out)
{
    PyObject *g, *p;
    int verdict = ready_for(group, table, tensor, NULL, NULL, &g, &p);
    return answer(verdict, g, call, p, inp, out);
}

FRONT_DOOR(rooted, 8, "rooted(call, tensor, root, group, group_root, async_op, mode, items)",
           " -> bool | None: a blocking broadcast/reduce (mode 0), gather (1) or scatter (2) through the group's "
           "ready operation (see the source)")
{
    PyObject *call = args[0], *tensor = args[1], *root = args[2], *items = args[7];
    long mode = PyLong_AsLong(args[6]);
    int async_op = PyObject_IsTrue(args[5]);
    if ((mode == -1 && PyErr_Occurred()) || async_op < 0)
        return NULL;
    if (async_op || Py_TYPE(tensor) != array_type || !PyLong_CheckExact(root) || args[4] != Py_None)
        Py_RETURN_FALSE;
    int want = mode == 1 ? C_CONTIGUOUS : CARRAY; /* gather only reads its tensor */
    if ((ARRAY_FLAGS(tensor) & want) != want)
        Py_RETURN_FALSE;
    PyObject *g, *p;
    int verdict = ready_for(args[3], call, tensor, root, NULL, &g, &p);
    PyObject *inp = tensor, *out = tensor;
    if (verdict == 1 && mode) {
        PyObject *rank = attr(g, s_rank), *size = rank ? attr(g, s_size) : NULL;
        int is_root = size == NULL ? -1 : PyObject_RichCompareBool(rank, root, Py_EQ);
        Py_ssize_t n = size == NULL ? 0 : PyLong_AsSsize_t(size);
        Py_XDECREF(rank);
        Py_XDECREF(size);
        verdict = is_root < 0 || (n == -1 && PyErr_Occurred()) ? -1 : plain_list(items, is_root, n, tensor, mode == 1);
        if (mode == 1)
            out = items;
        else
            inp = items;
    }
    return answer(verdict, g, call, p, inp, out);
}

/* A non-empty list of ints (not bools) as a tuple (new reference); NULL without an error when it is not one. */
static PyObject *
int_tuple(PyObject *sizes)
{
    if (!PyList_CheckExact(sizes) || PyList_GET_SIZE(sizes) == 0)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sizes); i++) {
        if (!PyLong_CheckExact(PyList_GET_ITEM(sizes, i)))
            return NULL;
    }
    return PyList_AsTuple(sizes);
}

/* paired(call, table, output, input, group, async_op, input_splits, output_splits): all_gather, reduce_scatter
 * (SUM), all_to_all (splits None) and the uneven all_to_all (splits: lists of ints) through the group's ready
 * operation, as commlib._collectives.ready_paired and run_ready do: True ran it, False the generic path. */
FRONT_DOOR(paired, 8, "paired(call, table, output, input, group, async_op, input_splits, output_splits)",
           " -> bool: a blocking all_gather, reduce_scatter or all_to_all through the group's ready operation "
           "(see the source)")
{
    PyObject *call = args[0], *output = args[2], *input = args[3], *ins = args[6], *outs = args[7];
    int async_op = PyObject_IsTrue(args[5]);
    if (async_op < 0)
        return NULL;
    if (async_op || Py_TYPE(input) != array_type || Py_TYPE(output) != array_type ||
        !(ARRAY_FLAGS(input) & C_CONTIGUOUS) || (ARRAY_FLAGS(output) & CARRAY) != CARRAY)
        Py_RETURN_FALSE;
    PyObject *splits = NULL, *g = NULL, *ops = NULL, *in_shape = NULL, *out_shape = NULL, *key = NULL, *p = NULL;
    int verdict = 0;
    if (ins != Py_None || outs != Py_None) { /* the uneven all_to_all: both split lists, of ints */
        PyObject *a = int_tuple(ins), *b = a ? int_tuple(outs) : NULL;
        if (b != NULL)
            splits = PyTuple_Pack(2, a, b);
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (splits == NULL)
            return PyErr_Occurred() ? NULL : PyBool_FromLong(0);
    }
    verdict = group_ops(args[4], args[1], &g, &ops);
    if (verdict == 1) {
        verdict = -1;
        if ((in_shape = PyObject_GetAttr(input, s_shape)) != NULL &&
            (out_shape = PyObject_GetAttr(output, s_shape)) != NULL) {
            PyObject *i_d = ARRAY_DESCR(input), *o_d = ARRAY_DESCR(output);
            key = splits ? PyTuple_Pack(5, in_shape, i_d, out_shape, o_d, splits) : PyTuple_Pack(4, in_shape, i_d, out_shape, o_d);
            if (key != NULL)
                verdict = (p = lookup(ops, key)) != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
        }
    }
    Py_XDECREF(splits);
    Py_XDECREF(ops);
    Py_XDECREF(in_shape);
    Py_XDECREF(out_shape);
    Py_XDECREF(key);
    return answer(verdict, g, call, p, input, output);
}

/* plain(call, group): a call without arrays (barrier) through the group's ready operation, as the Python
 * preamble of commlib._barrier.barrier and run_ready do: True ran it, False the generic path. */
FRONT_DOOR(plain, 2, "plain(call, group)",
           " -> bool: a barrier through the group's ready operation (see the source)")
{
    return ready_answer(args[1], args[0], NULL, args[0], Py_None, Py_None);
}

/* summed(tensor, op, group, async_op): a blocking in-place SUM all_reduce of a numpy array through the group's
 * ready operation (Backend.sums, keyed by shape and dtype), as commlib._collectives.all_reduce's Python fast
 * path and run_ready do (numbered and recorded): True ran it, False the generic path. */
FRONT_DOOR(summed, 4, "summed(tensor, op, group, async_op)",
           " -> bool: a blocking SUM all_reduce through the group's ready operation (see the source)")
{
    PyObject *tensor = args[0];
    int async_op = PyObject_IsTrue(args[3]);
    if (async_op < 0)
        return NULL;
    if (async_op || args[1] != fr_sum || Py_TYPE(tensor) != array_type || (ARRAY_FLAGS(tensor) & CARRAY) != CARRAY)
        Py_RETURN_FALSE;
    return ready_answer(args[2], NULL, tensor, s_all_reduce, tensor, tensor);
}

/* peer(call, tensor, peer, group, tag, group_peer): a blocking send or recv (call "send" or "recv") of a numpy
 * array to or from a global rank through the group's ready operation, as commlib._p2p's Python fallback does
 * (point to point: neither numbered nor recorded): True ran it, False the generic path. */
FRONT_DOOR(peer, 6, "peer(call, tensor, peer, group, tag, group_peer)",
           " -> bool: a blocking send or recv through the group's ready operation (see the source)")
{
    PyObject *call = args[0], *tensor = args[1], *who = args[2], *tag = args[4];
    int sending = PyUnicode_CheckExact(call) && PyUnicode_CompareWithASCIIString(call, "send") == 0;
    int want = sending ? C_CONTIGUOUS : CARRAY; /* a send only reads its tensor */
    if (Py_TYPE(tensor) != array_type || !PyLong_CheckExact(who) || !PyLong_CheckExact(tag) || args[5] != Py_None ||
        (ARRAY_FLAGS(tensor) & want) != want)
        Py_RETURN_FALSE;
    PyObject *g, *p, *result = NULL;
    int verdict = ready_for(args[3], call, tensor, who, tag, &g, &p);
    PyObject *go = verdict == 1 ? attr(p, s_go) : NULL;
    if (go != NULL) {
        PyObject *out = sending ? Py_None : tensor, *pair[2] = {sending ? tensor : Py_None, out};
        result = PyObject_Vectorcall(go, pair, 2, NULL);
        Py_DECREF(go);
        if (result != Py_True) /* not complete, or go raised */
            result = rest(result, g, call, p, out, fr_zero, fr_minus_one);
        Py_XDECREF(result);
    }
    verdict = verdict == 1 && result == NULL ? -1 : verdict;
    Py_XDECREF(g);
    Py_XDECREF(p);
    return verdict < 0 ? NULL : PyBool_FromLong(verdict);
}

static PyObject *
setup_rooted(PyObject *module, PyObject *args)
{
    PyObject *state, *group_type, *starts, *ends, *slots, *rest, *sum;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO!OOOOO", &state, &PyType_Type, &group_type, &starts, &ends, &slots, &rest, &sum))
        return NULL;
    if (!PyIter_Check(slots) || !PyCallable_Check(rest) || array_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "setup_rooted: slots must be an iterator, rest a callable; setup_array first");
        return NULL;
    }
    const char *names[] = {"world", "ready", "pending", "rank", "size", "seq", "shape", "dtype", "count", "go",
                           "sums", "all_reduce"};
    PyObject **slots_of[] = {&s_world, &s_ready, &s_pending, &s_rank, &s_size,  &s_seq,
                             &s_shape, &s_dtype, &s_count,   &s_go,   &s_sums, &s_all_reduce};
    PyObject **numbers[] = {&fr_one, &fr_zero, &fr_minus_one};
    for (int i = 0; i < 3; i++) {
        if (*numbers[i] == NULL && (*numbers[i] = PyLong_FromLong(1 - i)) == NULL)
            return NULL;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*slots_of[i] == NULL && (*slots_of[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    }
    PyObject *objects[] = {state, group_type, starts, ends, slots, rest, sum};
    PyObject **targets[] = {&fr_state, (PyObject **)&fr_group_type, &fr_starts, &fr_ends, &fr_slots, &fr_rest, &fr_sum};
    for (size_t i = 0; i < sizeof objects / sizeof objects[0]; i++) {
        Py_INCREF(objects[i]);
        Py_XSETREF(*targets[i], objects[i]);
    }
    Py_RETURN_NONE;
}

static PyObject *
setup_array(PyObject *module, PyObject *args)
{
    PyObject *type;
    Py_ssize_t data, nd, dims, flags, descr;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!nnnnn", &PyType_Type, &type, &data, &nd, &dims, &flags, &descr))
        return NULL;
    Py_ssize_t basic = ((PyTypeObject *)type)->tp_basicsize, head = (Py_ssize_t)sizeof(PyObject);
    Py_ssize_t at[5] = {data, nd, dims, flags, descr}, size[5] = {sizeof(char *), sizeof(int), sizeof(Py_ssize_t *),
                                                                  sizeof(int), sizeof(PyObject *)};
    for (int i = 0; i < 5; i++) {
        if (at[i] < head || at[i] + size[i] > basic) {
            PyErr_SetString(PyExc_ValueError, "setup_array: every field must lie inside the array's struct");
            return NULL;
        }
    }
    off_data = data;
    off_nd = nd;
    off_dims = dims;
    off_flags = flags;
    off_descr = descr;
    Py_INCREF(type);
    Py_XSETREF(array_type, (PyTypeObject *)type);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(MPI_Start, MPI_Startall, MPI_Test, MPI_Testall, sizeof(MPI_Request), sizeof(MPI_Status), MPI.Exception, "
     "spread, pack, MPI.Request, offset of a Request's handle)"},
    DOOR_METHOD(rooted),
    DOOR_METHOD(paired),
    DOOR_METHOD(plain),
    DOOR_METHOD(summed),
    DOOR_METHOD(peer),
    {"setup_rooted", setup_rooted, METH_VARARGS,
     "setup_rooted(world state, ProcessGroup, ring starts, ring ends, ring slots, rest, ReduceOp.SUM), after "
     "setup_array()"},
    {"setup_array", setup_array, METH_VARARGS,
     "setup_array(ndarray, data, nd, dimensions, flags, descr offsets): where numpy keeps an array's fields"},
    {"span", span, METH_O,
     "span(parts) -> (root, root address or -1, root bytes, start, end) | False | None: whether the arrays lie back "
     "to back in one root array"},
    {"setup_direct", setup_direct, METH_VARARGS,
     "setup_direct((MPI_Iallreduce, _Ibcast, _Ireduce, _Iallgather, _Ireduce_scatter_block, _Ialltoall, _Igather, "
     "_Iscatter, _Isend, _Irecv), (MPI_Reduce_local, MPI_Get_count), MPI_IN_PLACE, sizeof(MPI_Comm), "
     "MPI_ERR_TRUNCATE): after setup(), for Direct"},
    {"spin", (PyCFunction)(void (*)(void))spin, METH_FASTCALL,
     "spin(request, seconds) -> bool | None: MPI_Test in a loop without the GIL until done (True) or seconds pass "
     "(False); None: another thread spins"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ready",
    .m_doc = "commlib's hot paths in C: Runner, spin, span, the front doors summed/rooted/paired/plain/peer (see the source).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__ready(void)
{
    if (PyType_Ready(&RunnerType) < 0 || PyType_Ready(&DirectType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Runner", (PyObject *)&RunnerType) < 0 ||
        PyModule_AddObjectRef(m, "Direct", (PyObject *)&DirectType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
