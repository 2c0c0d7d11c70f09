"""multiprocessing.Pool(4) (fork): each worker spins in work() for SECONDS of
its CPU time; the parent waits in pool.map.

    python pool.py SECONDS [DELAY]

DELAY: print `ready` and wait for SIGUSR1 (at most DELAY seconds) before
the pool starts, so a profiler attached with -p has the parent registered
before any worker is forked.  $POOL_SLEEP: seconds each worker sleeps in
work() before it spins (0).
"""
import multiprocessing
import os
import signal
import sys
import time

SLEEP = float(os.environ.get("POOL_SLEEP", "0"))


def work(seconds):
    time.sleep(SLEEP)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass                                    # WORK
    return seconds


def main(seconds):
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        pool.map(work, [seconds] * 4)           # WAIT


if __name__ == "__main__":
    if len(sys.argv) > 2:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        print("ready", flush=True)
        signal.sigtimedwait([signal.SIGUSR1], float(sys.argv[2]))
    main(float(sys.argv[1]))
