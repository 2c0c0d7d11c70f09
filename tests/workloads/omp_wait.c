/* OpenMP threads that wait, with a known split (tests/test_omp_bpf.py).
 *
 *     gcc -O2 -fopenmp -o omp_wait omp_wait.c
 *     OMP_WAIT_POLICY=active|passive ./omp_wait SECONDS
 *
 * Each parallel region has two threads.  Thread 0 does all of the region's
 * work (omp_work, about 5 ms); thread 1 has none and goes straight to the
 * barrier that ends the region, where it waits for thread 0: spinning on
 * the CPU with OMP_WAIT_POLICY=active (libgomp's spin, libomp's with
 * KMP_BLOCKTIME=infinite), asleep in futex with passive (KMP_BLOCKTIME=0).
 * So thread 1 spends nearly all of its time waiting in the OpenMP runtime,
 * and thread 0 nearly all of its on-CPU time in omp_work. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) static double omp_work(double until)
{
    double x = 1.0;
    while (now() < until)
        for (int i = 0; i < 1000; i++)
            x = x * 1.0000001 + 1e-9;
    return x;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    double end = now() + seconds, sink = 0;
    int regions = 0;
    printf("ready\n");
    fflush(stdout);
    while (now() < end) {
#pragma omp parallel num_threads(2) reduction(+ : sink)
        {
            if (omp_get_thread_num() == 0)
                sink += omp_work(now() + 0.005);
        }
        regions++;
    }
    printf("done %d regions %g\n", regions, sink);
    return 0;
}
