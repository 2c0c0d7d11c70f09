/* Code made at run time, as a JIT compiler or oneDNN makes it
 * (tests/test_jit_bpf.py, through jit_spin.py and ctypes).
 *
 *     gcc -O2 -fno-omit-frame-pointer -shared -fPIC -o libjit_spin.so jit_spin.c
 *
 * jit_outer() -> jit_caller() -> a loop copied into anonymous executable
 * memory.  The loop leaves rbp alone, so rbp still holds jit_caller's frame
 * pointer: a frame-pointer step out of it returns into jit_outer and skips
 * jit_caller, the frame that called it.  A profiler must not show that
 * edge (jit_outer calling the JIT code). */
#define _GNU_SOURCE
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef void (*loop_fn)(unsigned long);

static loop_fn made;

/* dec %rdi; jnz back to it; ret */
static const unsigned char LOOP[] = {0x48, 0xff, 0xcf, 0x75, 0xfb, 0xc3};

int jit_make(void)
{
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return -1;
    memcpy(p, LOOP, sizeof LOOP);
    if (mprotect(p, 4096, PROT_READ | PROT_EXEC) != 0)
        return -1;
    made = (loop_fn)p;
    return 0;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void jit_caller(double seconds)
{
    double end = now() + seconds;
    while (now() < end)
        made(2000000);
    __asm__ volatile("" ::: "memory");     /* not a tail call */
}

__attribute__((noinline)) void jit_outer(double seconds)
{
    jit_caller(seconds);
    __asm__ volatile("" ::: "memory");
}
