/* What the C files of commlib.backends._executor share: _executor.c (the module, setup, CONSTANTS) and _steps.c
 * (Steps: a plan of commlib.backends._plans run in C). See _executor.c's header for the module as a whole. */
#ifndef COMMLIB_EXECUTOR_H
#define COMMLIB_EXECUTOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL commlib_executor_ARRAY_API
#ifndef COMMLIB_EXECUTOR_MAIN
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

/* MPICH's ABI: communicator, datatype and request handles are ints (setup() refuses another size) */
typedef int handle_t;
typedef long long count_t; /* MPI_Count */

typedef int (*start_fn)(void *request);
typedef int (*test_fn)(void *request, int *flag, void *status);
typedef int (*init_fn)(void *buf, int count, handle_t dtype, int peer, int tag, handle_t comm, void *request);
typedef int (*post_fn)(void *buf, count_t count, handle_t dtype, int peer, int tag, handle_t comm, void *request);
typedef int (*count_fn)(const void *status, handle_t dtype, count_t *count);
typedef int (*free_fn)(void *request);

/* The numbers the C code shares with its Python twin (exported as CONSTANTS, checked by commlib.backends._native
 * when it loads this module): the stamp's bytes (commlib.backends._stamp.SIZE), the tags a collective's steps cycle
 * through (commlib.backends._steps.TAG_SPAN), the plan encoding's buffers and actions (commlib.backends._plans),
 * and the reduce ops' codes (commlib.backends._call.OP_CODES: ReduceOp's order, from 1). */
#define STAMP 32
#define TAG_SPAN 32000
enum { B_IN = 1, B_OUT = 2, B_TMP = 3 };
enum { A_COPY = 1, A_REDUCE = 2 };
enum { O_SUM = 1, O_PRODUCT, O_MIN, O_MAX, O_AVG, O_BAND, O_BOR, O_BXOR };

/* MPI, as set up by setup() (_executor.c) */
extern start_fn mpi_start;
extern test_fn mpi_test;
extern init_fn mpi_send_init, mpi_recv_init;
extern post_fn mpi_isend, mpi_irecv; /* MPI_Isend_c, MPI_Irecv_c (MPI-4's large counts) */
extern count_fn mpi_get_count;       /* MPI_Get_count_c */
extern free_fn mpi_request_free;
extern handle_t mpi_byte;            /* MPI_BYTE */
extern Py_ssize_t request_size, status_size;
extern int spinning; /* a thread is in a spin without the GIL (read and set holding the GIL) */

/* raise mpi4py.MPI.Exception(code); returns -1 */
int raise_mpi(int code);
/* CLOCK_MONOTONIC in seconds */
double monotonic(void);

/* The record of the runs go() completed (_executor.c): label, the run's sequence number, CLOCK_MONOTONIC
 * in ns (Python's perf_counter_ns); nothing while the ring has no slots (runs_init(0), the default) */
void record_run(PyObject *label, uint32_t seq);

/* _steps.c: the Steps type (added to the module by PyInit__executor) */
extern PyTypeObject StepsType;

#endif
