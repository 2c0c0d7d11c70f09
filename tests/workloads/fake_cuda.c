/* A stand-in for NVIDIA's driver library, built as libcuda.so.1 by
 * tests/test_reasons_bpf.py (there is no GPU here).  How it maps to the
 * real thing:
 *   cuCtxSynchronize(ms)   CUDA's default sync: the driver spins on the CPU,
 *                          polling for the GPU's completion -> [gpu-spin]
 *   cuEventSynchronize(fd) a blocking sync (cudaDeviceScheduleBlockingSync,
 *                          cudaEventBlockingSync): the driver waits in poll()
 *                          on a /dev/nvidia* descriptor until the GPU's
 *                          interrupt -> [off-cpu: gpu]; here a FIFO that a
 *                          writer fills plays the device.
 * Built -O2 -fomit-frame-pointer, like the real library: its frames are
 * found through .eh_frame. */
#include <poll.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

__attribute__((noinline)) static int spin_until(double end)
{
    volatile unsigned long n = 0;
    while (now() < end)
        n++;
    return (int)(n & 1);
}

int cuCtxSynchronize(int ms)
{
    volatile int r = spin_until(now() + ms / 1000.0);  /* a call, not a tail call: */
    return r;                                          /* its frame stays, as the driver's */
}

int cuEventSynchronize(int fd)
{
    struct pollfd p = {fd, POLLIN, 0};
    char c;
    if (poll(&p, 1, -1) != 1)
        return -1;
    return read(fd, &c, 1) == 1 ? 0 : -1;
}
