/* Crashes whose native chains are known by construction (tests/test_crashes.py).
 * A plain shared library, called through ctypes: no Python headers, so one
 * build serves every interpreter the tests run (pyenv, Debian's, the chroot's).
 *
 *   crash_null()     cf_outer -> cf_middle -> cf_inner, which reads through NULL
 *                    (SIGSEGV, fault address 0)
 *   crash_abort()    ab_outer -> ab_middle -> ab_inner -> abort()  (SIGABRT)
 *   crash_divide(d)  dv_outer -> dv_inner, an integer division by d (SIGFPE at 0)
 *
 * Built with -O2 -fomit-frame-pointer: only the .eh_frame tables walk it.
 * noipa keeps gcc from inlining, cloning or proving anything noreturn; the
 * empty asm after each call keeps the calls from becoming jumps. */
#include <stdlib.h>

#ifdef CHANGED
int changed_since(void) { return 1; }
#endif

#define KEEP __attribute__((noipa))
#define AFTER_CALL() __asm__ volatile("" ::: "memory")

KEEP int cf_inner(volatile int *p)
{
    return *p + 1;
}

KEEP int cf_middle(volatile int *p)
{
    int r = cf_inner(p);
    AFTER_CALL();
    return r + 2;
}

KEEP int cf_outer(volatile int *p)
{
    int r = cf_middle(p);
    AFTER_CALL();
    return r + 3;
}

int crash_null(void)
{
    return cf_outer((volatile int *)0);
}

KEEP void ab_inner(void)
{
    abort();
}

KEEP void ab_middle(void)
{
    ab_inner();
    AFTER_CALL();
}

KEEP void ab_outer(void)
{
    ab_middle();
    AFTER_CALL();
}

void crash_abort(void)
{
    ab_outer();
}

KEEP int dv_inner(volatile int d)
{
    return 1000 / d;
}

KEEP int dv_outer(int d)
{
    int r = dv_inner(d);
    AFTER_CALL();
    return r;
}

int crash_divide(int d)
{
    return dv_outer(d);
}
