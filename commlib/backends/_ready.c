/* commlib.backends._ready: the mpi backend's executor in C. Optional: without it (no compiler at install,
 * or COMMLIB_NATIVE=0) the same plans run in Python (commlib/backends/_steps.py), exchanging the very same
 * messages, and the tests run both.
 *
 * - Steps (_steps.c): a plan of commlib.backends._plans run in C: its messages posted, tested, their stamps
 *   checked, its reductions computed. What the group layer does around a call (its checks, numbering and
 *   records) stays in Python: this module knows MPI and byte regions, nothing of groups.
 * - spin(request, seconds): a large wait, MPI_Test in a loop without the GIL until done or a deadline.
 * - span(parts): whether a list of arrays lies back to back in one buffer (commlib._collectives.packed).
 *
 * No MPI header and no link to MPI: the MPI functions are the addresses in the library mpi4py loaded (set
 * once by setup()), and handles are MPICH's ints, so this file builds with a C compiler and numpy's headers
 * and follows mpi4py's MPI. numpy arrays are read through numpy's C API.
 */
#define COMMLIB_READY_MAIN
#include "_ready.h"

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
static PyTypeObject *request_type; /* mpi4py.MPI.Request */
static Py_ssize_t handle_offset;   /* where a Request object keeps its MPI_Request handle */

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

/* setup(functions, sizeof(MPI_Request), sizeof(MPI_Status), sizeof(MPI_Comm), MPI_BYTE, MPI.Exception,
 * MPI.Request, offset of a Request's handle): functions are the addresses of MPI_Start, MPI_Test,
 * MPI_Send_init, MPI_Recv_init, MPI_Isend_c, MPI_Irecv_c, MPI_Get_count_c and MPI_Request_free. */
static PyObject *
setup(PyObject *module, PyObject *args)
{
    unsigned long long f[8];
    int comm_size, byte;
    PyObject *exception, *req_type;
    Py_ssize_t offset;
    (void)module;
    if (!PyArg_ParseTuple(args, "(KKKKKKKK)nniiOO!n", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7],
                          &request_size, &status_size, &comm_size, &byte, &exception, &PyType_Type, &req_type,
                          &offset))
        return NULL;
    for (int i = 0; i < 8; i++) {
        if (!f[i]) {
            PyErr_SetString(PyExc_ValueError, "setup: an MPI function is missing");
            return NULL;
        }
    }
    if (comm_size != (int)sizeof(handle_t) || request_size != (Py_ssize_t)sizeof(handle_t) || status_size < 1 ||
        status_size > 256 || offset < (Py_ssize_t)sizeof(PyObject) ||
        offset + request_size > ((PyTypeObject *)req_type)->tp_basicsize) {
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
    Py_INCREF(req_type);
    Py_XSETREF(request_type, (PyTypeObject *)req_type);
    handle_offset = offset;
    Py_RETURN_NONE;
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
    double due = monotonic() + seconds;
    for (unsigned i = 1; !(code = mpi_test(handle, &flag, status)) && !flag; i++) {
        if ((i & 15) == 0 && monotonic() >= due)
            break;
    }
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

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup((MPI_Start, MPI_Test, MPI_Send_init, MPI_Recv_init, MPI_Isend_c, MPI_Irecv_c, MPI_Get_count_c, "
     "MPI_Request_free), sizeof(MPI_Request), sizeof(MPI_Status), sizeof(MPI_Comm), MPI_BYTE, MPI.Exception, "
     "MPI.Request, offset of a Request's handle)"},
    {"span", span, METH_O,
     "span(parts) -> (root, root address or -1, root bytes, start, end) | False | None: whether the arrays lie back "
     "to back in one root array"},
    {"spin", (PyCFunction)(void (*)(void))spin, METH_FASTCALL,
     "spin(request, seconds) -> bool | None: MPI_Test in a loop without the GIL until done (True) or seconds pass "
     "(False); None: another thread spins"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ready",
    .m_doc = "The mpi backend's executor in C: Steps, spin, span (see the source).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__ready(void)
{
    import_array();
    if (PyType_Ready(&StepsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Steps", (PyObject *)&StepsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
