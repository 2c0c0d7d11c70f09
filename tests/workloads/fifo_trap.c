/* A process of any user's that plants a FIFO where root's profiler reads
 * (tests/test_untrusted.py): it loads a copy of a shared library from a
 * directory of its own, deletes the file and puts a FIFO at its path, so
 * its /proc/PID/maps names a path that blocks whoever opens it to read.
 *
 *     gcc -o fifo_trap fifo_trap.c -ldl
 *     fifo_trap DIR LIBRARY        (prints "ready", then waits to be killed) */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    char path[4096];
    snprintf(path, sizeof path, "%s/libtrap.so", argv[1]);
    int in = open(argv[2], O_RDONLY), out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0755);
    char buf[65536];
    ssize_t n;
    while (in >= 0 && out >= 0 && (n = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, n) != n)
            return 1;
    close(in);
    close(out);
    if (!dlopen(path, RTLD_NOW) || unlink(path) != 0 || mkfifo(path, 0644) != 0)
        return 1;
    printf("ready\n");
    fflush(stdout);
    for (;;)
        pause();
}
