/* commlib.backends._executor: the mpi backend's executor in C. Optional: without it (no compiler at install,
 * or COMMLIB_NATIVE=0) the same plans run in Python (commlib/backends/_steps.py), exchanging the very same
 * messages, and the tests run both.
 *
 * - Steps (_steps.c): a plan of commlib.backends._plans run in C: its messages posted, tested, their stamps
 *   checked, its reductions computed. What the group layer does around a call (its checks, numbering and
 *   records) stays in Python: this module knows MPI and byte regions, nothing of groups.
 * - CONSTANTS: the numbers the C code and the Python twin must share (the stamp's size, the tags' span, the
 *   plan encoding's buffer and action codes, the reduce op codes); commlib.backends._native compares them
 *   with Python's when it loads this module, and runs the Python executor where they differ.
 *
 * No MPI header and no link to MPI: the MPI functions are the addresses in the library mpi4py loaded (set
 * once by setup()), and handles are MPICH's ints, so this file builds with a C compiler and numpy's headers
 * and follows mpi4py's MPI. numpy arrays are read through numpy's C API.
 */
#define COMMLIB_EXECUTOR_MAIN
#include "_executor.h"

start_fn mpi_start;
test_fn mpi_test;
init_fn mpi_send_init, mpi_recv_init;
post_fn mpi_isend, mpi_irecv;
count_fn mpi_get_count;
free_fn mpi_request_free;
handle_t mpi_byte;
Py_ssize_t request_size, status_size;
int spinning;
static PyObject *mpi_exception; /* mpi4py.MPI.Exception */

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

double
monotonic(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* -- the record of completed runs -------------------------------------------------------------------------
 * go() completes most blocking calls at once; it records each such run here (its executor's label, the run's
 * sequence number, CLOCK_MONOTONIC in ns): no Python object is made per call (the group layer's tuple and clock
 * reading were ~0.2 us of a 0.6 us call). commlib.backends._steps.executed() reads them for the recorder of
 * commlib._diagnostics. A slot keeps a reference to its label. */
typedef struct {
    PyObject *label;
    uint32_t seq;
    int64_t t;
} run_t;

static run_t *runs;
static Py_ssize_t runs_size, runs_next;

void
record_run(PyObject *label, uint32_t seq)
{
    if (runs_size == 0 || label == NULL || label == Py_None)
        return;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    run_t *e = &runs[runs_next];
    PyObject *old = e->label;
    Py_INCREF(label);
    e->label = label;
    e->seq = seq;
    e->t = (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
    if (++runs_next == runs_size)
        runs_next = 0;
    Py_XDECREF(old); /* last: a label's last reference may run Python code */
}

/* runs_init(size): a ring of size slots (0: record nothing), emptied */
static PyObject *
runs_init(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "runs_init: size must be >= 0");
        return NULL;
    }
    run_t *fresh = n ? PyMem_Calloc((size_t)n, sizeof(run_t)) : NULL;
    if (n && fresh == NULL)
        return PyErr_NoMemory();
    run_t *old = runs;
    Py_ssize_t old_size = runs_size;
    runs = fresh;
    runs_size = n;
    runs_next = 0;
    for (Py_ssize_t i = 0; i < old_size; i++)
        Py_XDECREF(old[i].label);
    PyMem_Free(old);
    Py_RETURN_NONE;
}

/* completed_runs() -> [(label, seq, t_ns)], oldest first */
static PyObject *
completed_runs(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t k = 0; out != NULL && k < runs_size; k++) {
        run_t *e = &runs[(runs_next + k) % runs_size];
        if (e->label == NULL)
            continue;
        PyObject *item = Py_BuildValue("(OkL)", e->label, (unsigned long)e->seq, (long long)e->t);
        if (item == NULL || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

/* setup(functions, sizeof(MPI_Request), sizeof(MPI_Status), sizeof(MPI_Comm), MPI_BYTE, MPI.Exception): functions
 * are the addresses of MPI_Start, MPI_Test, MPI_Send_init, MPI_Recv_init, MPI_Isend_c, MPI_Irecv_c,
 * MPI_Get_count_c and MPI_Request_free. */
static PyObject *
setup(PyObject *module, PyObject *args)
{
    unsigned long long f[8];
    int comm_size, byte;
    PyObject *exception;
    (void)module;
    if (!PyArg_ParseTuple(args, "(KKKKKKKK)nniiO", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7],
                          &request_size, &status_size, &comm_size, &byte, &exception))
        return NULL;
    for (int i = 0; i < 8; i++) {
        if (!f[i]) {
            PyErr_SetString(PyExc_ValueError, "setup: an MPI function is missing");
            return NULL;
        }
    }
    if (comm_size != (int)sizeof(handle_t) || request_size != (Py_ssize_t)sizeof(handle_t) || status_size < 1 ||
        status_size > 256) {
        PyErr_SetString(PyExc_ValueError, "setup: MPI's handles are not ints (not MPICH's ABI), or bad sizes");
        return NULL;
    }
    void **into[8] = {(void **)&mpi_start,   (void **)&mpi_test,  (void **)&mpi_send_init, (void **)&mpi_recv_init,
                      (void **)&mpi_isend,   (void **)&mpi_irecv, (void **)&mpi_get_count, (void **)&mpi_request_free};
    for (int i = 0; i < 8; i++)
        *into[i] = (void *)(uintptr_t)f[i]; /* POSIX: function and data pointers alike */
    mpi_byte = byte;
    Py_INCREF(exception);
    Py_XSETREF(mpi_exception, exception);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup((MPI_Start, MPI_Test, MPI_Send_init, MPI_Recv_init, MPI_Isend_c, MPI_Irecv_c, MPI_Get_count_c, "
     "MPI_Request_free), sizeof(MPI_Request), sizeof(MPI_Status), sizeof(MPI_Comm), MPI_BYTE, MPI.Exception)"},
    {"runs_init", runs_init, METH_O, "runs_init(size): the ring of completed runs, size slots (0: none)"},
    {"completed_runs", completed_runs, METH_NOARGS, "completed_runs() -> [(label, seq, t_ns)], oldest first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_executor",
    .m_doc = "The mpi backend's executor in C: Steps, and the CONSTANTS it shares with Python (see the source).",
    .m_size = -1,
    .m_methods = module_methods,
};

/* CONSTANTS: name -> value, from the header's table (what the Python side must agree with) */
static PyObject *
constants(void)
{
    PyObject *d = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "STAMP", STAMP, "TAG_SPAN", TAG_SPAN, "IN", B_IN,
        "OUT", B_OUT, "TMP", B_TMP, "COPY", A_COPY, "REDUCE", A_REDUCE, "SUM", O_SUM, "PRODUCT", O_PRODUCT, "MIN",
        O_MIN, "MAX", O_MAX, "AVG", O_AVG, "BAND", O_BAND, "BOR", O_BOR, "BXOR", O_BXOR);
    return d;
}

PyMODINIT_FUNC
PyInit__executor(void)
{
    import_array();
    if (PyType_Ready(&StepsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *c = constants();
    if (c == NULL || PyModule_AddObjectRef(m, "Steps", (PyObject *)&StepsType) < 0 ||
        PyModule_AddObject(m, "CONSTANTS", c) < 0) {
        Py_XDECREF(c);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
