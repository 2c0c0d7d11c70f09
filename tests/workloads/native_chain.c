/* A C extension whose native stacks are known by construction, for the
 * .eh_frame unwinder tests.  Built by the tests with
 *     gcc -O2 -fomit-frame-pointer -shared -fPIC
 * so that only DWARF CFI can walk it.
 *
 *   spin(seconds)           nc_outer -> nc_middle -> nc_inner, which spins
 *   call_chain(func, n)     cb_outer -> cb_middle -> cb_inner -> func(), n times
 *   deep(depth, seconds, sleep_us)
 *                           nc_deep recursing depth times, then spinning
 *                           (sleep_us 0) or sleeping sleep_us at a time
 *                           (tools/bpf_cost.py: 30 native frames)
 *   start_thread()          a pthread (no Python state) looping
 *                           th_outer -> th_middle -> th_inner: 50 ms spinning,
 *                           then 50 ms in nanosleep; returns its tid
 *
 * noipa keeps gcc from inlining or cloning the chain (names stay plain);
 * the empty asm after each call keeps the calls from becoming jumps. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KEEP __attribute__((noipa))
#define AFTER_CALL() __asm__ volatile("" ::: "memory")

static volatile unsigned long sink;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

KEEP unsigned long nc_inner(double seconds)
{
    double end = now_s() + seconds;
    unsigned long n = 1;
    do {
        for (int i = 0; i < 20000; i++)
            n = n * 6364136223846793005UL + (unsigned long)i;
        sink = n;
    } while (now_s() < end);
    return n;
}

KEEP unsigned long nc_middle(double seconds)
{
    unsigned long r = nc_inner(seconds);
    AFTER_CALL();
    return r + 1;
}

KEEP unsigned long nc_outer(double seconds)
{
    unsigned long r = nc_middle(seconds);
    AFTER_CALL();
    return r + 2;
}

KEEP unsigned long nc_deep(int depth, double seconds, int sleep_us)
{
    unsigned long r = 0;
    if (depth > 1) {
        r = nc_deep(depth - 1, seconds, sleep_us);
    } else if (sleep_us > 0) {
        double end = now_s() + seconds;
        struct timespec ts = {sleep_us / 1000000, (sleep_us % 1000000) * 1000L};
        while (now_s() < end)
            nanosleep(&ts, NULL);
    } else {
        r = nc_inner(seconds);
    }
    AFTER_CALL();
    return r + 1;
}

KEEP PyObject *cb_inner(PyObject *func)
{
    PyObject *r = PyObject_CallNoArgs(func);
    AFTER_CALL();
    return r;
}

KEEP PyObject *cb_middle(PyObject *func)
{
    PyObject *r = cb_inner(func);
    AFTER_CALL();
    return r;
}

KEEP PyObject *cb_outer(PyObject *func)
{
    PyObject *r = cb_middle(func);
    AFTER_CALL();
    return r;
}

KEEP void th_inner(void)
{
    double end = now_s() + 0.050;
    unsigned long n = 1;
    do {
        for (int i = 0; i < 20000; i++)
            n = n * 2862933555777941757UL + (unsigned long)i;
        sink = n;
    } while (now_s() < end);
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    AFTER_CALL();
}

KEEP void th_middle(void)
{
    th_inner();
    AFTER_CALL();
}

KEEP void th_outer(void)
{
    th_middle();
    AFTER_CALL();
}

static volatile long thread_tid;

static void *th_main(void *arg)
{
    (void)arg;
    thread_tid = syscall(SYS_gettid);
    for (;;) {
        th_outer();
        AFTER_CALL();
    }
    return NULL;
}

static PyObject *py_spin(PyObject *self, PyObject *arg)
{
    double s = PyFloat_AsDouble(arg);
    if (s == -1.0 && PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLong(nc_outer(s));
}

static PyObject *py_deep(PyObject *self, PyObject *args)
{
    int depth, sleep_us = 0;
    double s;
    if (!PyArg_ParseTuple(args, "id|i", &depth, &s, &sleep_us))
        return NULL;
    return PyLong_FromUnsignedLong(nc_deep(depth, s, sleep_us));
}

static PyObject *py_call_chain(PyObject *self, PyObject *args)
{
    PyObject *func;
    int n = 1;
    if (!PyArg_ParseTuple(args, "O|i", &func, &n))
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *r = cb_outer(func);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *py_start_thread(PyObject *self, PyObject *noargs)
{
    pthread_t t;
    if (pthread_create(&t, NULL, th_main, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_detach(t);
    while (thread_tid == 0)
        usleep(1000);
    return PyLong_FromLong(thread_tid);
}

static PyMethodDef methods[] = {
    {"spin", py_spin, METH_O, "nc_outer -> nc_middle -> nc_inner spinning for SECONDS"},
    {"deep", py_deep, METH_VARARGS, "nc_deep DEPTH times, then spin or sleep"},
    {"call_chain", py_call_chain, METH_VARARGS, "cb_outer -> cb_middle -> cb_inner -> func()"},
    {"start_thread", py_start_thread, METH_NOARGS, "a C thread; returns its tid"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_native_chain(void)
{
    return PyModule_Create(&module);
}
