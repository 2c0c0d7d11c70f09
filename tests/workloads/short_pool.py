"""multiprocessing.Pool(2, maxtasksperchild=1): 8 tasks, each spinning 0.3 s
of its worker's CPU time in task(); every worker lives for one task, ~0.4 s
(tests/test_subprocesses.py: workers that live less than a look at /proc).

    python short_pool.py METHOD [DELAY]

METHOD: fork or spawn (a new interpreter that execs).  DELAY: print `ready`
and wait for SIGUSR1 (at most DELAY seconds) before the pool starts.
"""
import multiprocessing
import signal
import sys
import time


def task(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass                                    # TASK
    return seconds


if __name__ == "__main__":
    if len(sys.argv) > 2:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        print("ready", flush=True)
        signal.sigtimedwait([signal.SIGUSR1], float(sys.argv[2]))
    with multiprocessing.get_context(sys.argv[1]).Pool(2, maxtasksperchild=1) as pool:
        pool.map(task, [0.3] * 8, chunksize=1)
