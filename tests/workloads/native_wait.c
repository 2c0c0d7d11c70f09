/* A native program (no Python) that crashes at a known chain:
 * main -> nw_caller -> nw_leaf, which reads through NULL (SIGSEGV).
 *     native_wait          prints "ready", crashes once a line comes on stdin
 *     native_wait now      crashes at once
 * (tests/test_crashes.py: `crashes -a`, and an image replaced by exec). */
#include <stdio.h>
#include <string.h>

__attribute__((noipa)) int nw_leaf(volatile int *p)
{
    return *p;
}

__attribute__((noipa)) int nw_caller(volatile int *p)
{
    int r = nw_leaf(p);
    __asm__ volatile("");
    return r;
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "now") != 0) {
        char b[8];
        puts("ready");
        fflush(stdout);
        if (!fgets(b, sizeof b, stdin))
            return 2;
    }
    int r = nw_caller(0);
    __asm__ volatile("");
    return r;
}
