/* A C extension calling assembly kernels that have no CFI
 * (nocfi_kernel.S), reached from Python through two C frames, for the
 * unwinder's no-CFI tests.  Built by the tests with
 *     gcc -O2 -fomit-frame-pointer -shared -fPIC nocfi.c nocfi_kernel.S
 *
 *   spin(seconds)      nf_outer -> nf_middle -> nocfi_spin (the kernel's own loop)
 *   call(seconds)      nf_outer_cb -> nf_middle_cb -> nocfi_call -> nf_callback (C)
 *   start_thread()     a pthread (no Python state): nf_thread -> nf_th_outer -> nocfi_spin
 *   rbp(seconds)       nf_fp_outer -> nf_fp_middle (both with frame pointers: their CFA
 *                      is rbp-based) -> nocfi_rbp, which takes rbp: the walk must end
 *                      at the kernel, never go on from its counter
 *   realign(seconds)   nf_outer_ra -> nf_drap (its stack realigned by GCC: the CFA
 *                      kept in the frame, DW_OP_deref) -> nocfi_realign (rsp in rbx,
 *                      the stack aligned, rbp taken: OpenBLAS's GEMM kernels' shape)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KEEP __attribute__((noipa))
#define AFTER_CALL() __asm__ volatile("" ::: "memory")

unsigned long nocfi_spin(unsigned long iters);
unsigned long nocfi_call(unsigned long iters, unsigned long (*fn)(void));
unsigned long nocfi_rbp(unsigned long iters);
unsigned long nocfi_realign(unsigned long iters);
#define FRAMED __attribute__((noipa, optimize("no-omit-frame-pointer")))

static volatile unsigned long sink;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

KEEP unsigned long nf_callback(void)
{
    unsigned long n = 1;
    for (int i = 0; i < 2000; i++)
        n = n * 2862933555777941757UL + 3037000493UL;
    sink = n;
    return n;
}

/* The two C frames of a chain: MIDDLE calls the kernel (CALL) in a loop
 * for `seconds`, OUTER calls MIDDLE. */
#define CHAIN(attr, middle, outer, call)                        \
    attr unsigned long middle(double seconds)                   \
    {                                                           \
        double end = now_s() + seconds;                         \
        unsigned long n = 0;                                    \
        do {                                                    \
            n += call;                                          \
            AFTER_CALL();                                       \
        } while (now_s() < end);                                \
        return n;                                               \
    }                                                           \
    attr unsigned long outer(double seconds)                    \
    {                                                           \
        unsigned long n = middle(seconds);                      \
        AFTER_CALL();                                           \
        return n + 1;                                           \
    }

CHAIN(KEEP, nf_middle, nf_outer, nocfi_spin(2000000))
CHAIN(KEEP, nf_middle_cb, nf_outer_cb, nocfi_call(200000, nf_callback))
CHAIN(FRAMED, nf_fp_middle, nf_fp_outer, nocfi_rbp(2000000))

KEEP void nf_args(volatile double *buf, long a, long b, long c, long d, long e, long f, long g)
{
    buf[0] += a + b + c + d + e + f + g;
}

/* A 64-byte aligned local and a call with arguments on the stack: GCC
 * realigns the stack with a DRAP register and describes the CFA as the
 * word at rbp - N (DW_CFA_def_cfa_expression; DW_OP_deref). */
KEEP unsigned long nf_drap(double seconds, long a, long b, long c, long d, long e, long f, long g)
{
    volatile double buf[8] __attribute__((aligned(64)));
    double end = now_s() + seconds;
    unsigned long n = 0;
    for (int i = 0; i < 8; i++)
        buf[i] = a + b * i;
    do {
        n += nocfi_realign(2000000 + (c ^ d ^ e ^ f));
        AFTER_CALL();
        buf[n & 7] += g;
    } while (now_s() < end);
    nf_args(buf, a, b, c, d, e, f, g);
    sink = (unsigned long)buf[3];
    return n;
}

KEEP unsigned long nf_outer_ra(double seconds)
{
    unsigned long n = nf_drap(seconds, 1, 2, 3, 4, 5, 6, 7);
    AFTER_CALL();
    return n + 1;
}

/* The Python-facing frame of each chain: py_NAME(seconds) runs FN(seconds)
 * without the GIL. */
#define TIMED_METHOD(name, fn)                                  \
    static PyObject *py_##name(PyObject *self, PyObject *args)  \
    {                                                           \
        double seconds;                                         \
        if (!PyArg_ParseTuple(args, "d", &seconds))             \
            return NULL;                                        \
        unsigned long n;                                        \
        Py_BEGIN_ALLOW_THREADS                                  \
        n = fn(seconds);                                        \
        Py_END_ALLOW_THREADS                                    \
        return PyLong_FromUnsignedLong(n);                      \
    }

TIMED_METHOD(realign, nf_outer_ra)
TIMED_METHOD(rbp, nf_fp_outer)
TIMED_METHOD(spin, nf_outer)
TIMED_METHOD(call, nf_outer_cb)
KEEP unsigned long nf_th_outer(void)
{
    unsigned long n = nf_middle(3600.0);
    AFTER_CALL();
    return n;
}

static volatile long thread_tid;

static void *nf_thread(void *arg)
{
    (void)arg;
    thread_tid = syscall(SYS_gettid);
    nf_th_outer();
    return NULL;
}

static PyObject *py_start_thread(PyObject *self, PyObject *noargs)
{
    pthread_t t;
    if (pthread_create(&t, NULL, nf_thread, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    while (!thread_tid)
        usleep(1000);
    return PyLong_FromLong(thread_tid);
}

static PyMethodDef methods[] = {
    {"spin", py_spin, METH_VARARGS, "nf_outer -> nf_middle -> nocfi_spin for `seconds`"},
    {"call", py_call, METH_VARARGS, "nf_outer_cb -> nf_middle_cb -> nocfi_call -> nf_callback"},
    {"start_thread", py_start_thread, METH_NOARGS, "a pthread in nocfi_spin; returns its tid"},
    {"rbp", py_rbp, METH_VARARGS, "nf_fp_outer -> nf_fp_middle -> nocfi_rbp (takes rbp)"},
    {"realign", py_realign, METH_VARARGS, "nf_outer_ra -> nf_drap (DRAP) -> nocfi_realign"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "nocfi", NULL, -1, methods};

PyMODINIT_FUNC PyInit_nocfi(void) { return PyModule_Create(&module); }
