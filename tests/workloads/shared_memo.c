/* Threads whose native stacks match everywhere but one return address.
 *
 *     shared_memo SECONDS
 *
 * Four threads run the same loop: block in nanosleep (1 ms) through
 * block_here(), called from via_a() by threads 0 and 2 and from via_b() by
 * threads 1 and 3.  via_a and via_b have the same frame, so every thread
 * blocks with the same leaf pc at the same distance under its thread
 * pointer (the shared switch memo's key), and every word of the stack is the
 * same but the return address into via_a or via_b: a memo that reused one
 * thread's walk for another on anything less than that word would name the
 * wrong caller.  Built without frame pointers; prints "ready" and the
 * threads' ids ("tid N a|b"), runs SECONDS.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

static volatile int running = 1;

__attribute__((noinline)) static void block_here(void)
{
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
    asm volatile("" ::: "memory");
}

__attribute__((noinline)) void via_a(void)
{
    block_here();
    asm volatile("" ::: "memory");
}

__attribute__((noinline)) void via_b(void)
{
    block_here();
    asm volatile("" ::: "memory");
}

static void *worker(void *arg)
{
    long which = (long)arg;
    printf("tid %ld %c\n", (long)syscall(SYS_gettid), which & 1 ? 'b' : 'a');
    fflush(stdout);
    while (running) {
        if (which & 1)
            via_b();
        else
            via_a();
    }
    return NULL;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 5;
    pthread_t t[4];
    for (long i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, worker, (void *)i);
    usleep(100000);
    printf("ready\n");
    fflush(stdout);
    usleep((useconds_t)(seconds * 1e6));
    running = 0;
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    return 0;
}
