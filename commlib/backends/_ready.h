/* What the two C files of commlib.backends._ready share: _ready.c (Runner, spin, span, the front doors, the
 * module) and _direct.c (Direct: a large blocking call posted on the caller's own buffers). See _ready.c's
 * header for the module as a whole. */
#ifndef COMMLIB_READY_H
#define COMMLIB_READY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int (*start_fn)(void *request);
typedef int (*startall_fn)(int count, void *requests);
typedef int (*test_fn)(void *request, int *flag, void *status);
typedef int (*testall_fn)(int count, void *requests, int *flag, void *statuses);

/* MPI, as set up by setup() (_ready.c) */
extern test_fn mpi_test;
extern testall_fn mpi_testall;
extern Py_ssize_t request_size, status_size;
extern PyTypeObject *request_type; /* mpi4py.MPI.Request */
extern Py_ssize_t handle_offset;   /* where a Request object keeps its MPI_Request handle */
extern int spinning;               /* a thread is in a spin without the GIL (read and set holding the GIL) */

/* numpy's array struct, as set up by setup_array() (_ready.c); array_type NULL: not known */
extern PyTypeObject *array_type;
extern Py_ssize_t off_data, off_nd, off_dims, off_flags, off_descr;
#define ARRAY_DATA(a) (*(char **)((char *)(a) + off_data))
#define ARRAY_ND(a) (*(int *)((char *)(a) + off_nd))
#define ARRAY_DIMS(a) (*(Py_ssize_t **)((char *)(a) + off_dims))
#define ARRAY_FLAGS(a) (*(int *)((char *)(a) + off_flags))
#define ARRAY_DESCR(a) (*(PyObject **)((char *)(a) + off_descr))
#define C_CONTIGUOUS 0x0001
#define ALIGNED 0x0100
#define WRITEABLE 0x0400
#define CARRAY (C_CONTIGUOUS | ALIGNED | WRITEABLE)

/* raise mpi4py.MPI.Exception(code); returns -1 */
int raise_mpi(int code);
/* CLOCK_MONOTONIC in seconds */
double monotonic(void);
/* MPI_Test on handle in a loop until it completes (*flag set) or seconds pass; call without the GIL. MPI's
 * error code. */
int test_until(void *handle, double seconds, int *flag, void *status);
/* 0 where a go(inp, out) method got its 2 arguments; else -1 with a TypeError */
int go_arity(Py_ssize_t nargs);
/* a tp_dealloc's body: drop refs (NULLs allowed), PyMem_Free blocks, free self */
void release(PyObject *self, PyObject *const *refs, int nrefs, void *const *blocks, int nblocks);
/* whether a is a plain numpy array of dtype descr, C-contiguous (and writable if asked), of len bytes */
int array_fits(PyObject *a, PyObject *descr, Py_ssize_t itemsize, Py_ssize_t len, int writable);

/* _direct.c: the Direct type (added to the module by PyInit__ready) and its setup function */
extern PyTypeObject DirectType;
PyObject *setup_direct(PyObject *module, PyObject *args);

#endif
