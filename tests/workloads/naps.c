/* --timeline's workload in C: a thread named `napper` naps 100 ms once a
 * second and prints each nap's own clock, read right before and after the
 * system call (`nap T0 T1`, CLOCK_MONOTONIC ns): no interpreter between
 * the clock and the switch.  The main thread joins it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <time.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *napper(void *arg)
{
    (void)arg;
    struct timespec nap = {0, 100000000}, rest = {0, 900000000};
    for (;;) {
        long long t0 = now_ns();
        clock_nanosleep(CLOCK_MONOTONIC, 0, &nap, NULL);
        long long t1 = now_ns();
        printf("nap %lld %lld\n", t0, t1);
        fflush(stdout);
        clock_nanosleep(CLOCK_MONOTONIC, 0, &rest, NULL);
    }
    return NULL;
}

int main(void)
{
    pthread_t t;
    pthread_create(&t, NULL, napper, NULL);
    pthread_setname_np(t, "napper");
    printf("ready\n");
    fflush(stdout);
    pthread_join(t, NULL);
    return 0;
}
