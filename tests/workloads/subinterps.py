"""Subinterpreters with a known split (tests/test_subinterpreters.py).

`threads` (3.12+): the main thread spins in main_spin(); two threads call
run_in(), which runs source in a fresh subinterpreter (3.12
_xxsubinterpreters, 3.13 _interpreters, 3.14+ concurrent.interpreters):
one spins in sub_spin(), the other sleeps in sub_sleep() after it has
started a thread of the subinterpreter's own that sleeps in sub_thread().
`crash`: a thread whose subinterpreter calls sub_crash(), which aborts
the process after 3 s.
`pool` (3.14+): an InterpreterPoolExecutor of 4 workers, each running
subinterp_work.pool_spin() for ever (PYTHONPATH must name this folder).

Prints `tid NAME TID` for each thread (the sub-thread's is printed by the
subinterpreter itself, once it runs), then `ready`; runs until killed."""
import os
import select
import sys
import threading
import time

SUB_SPIN = """
def sub_spin():
    n = 0
    while True:
        n += 1

sub_spin()
"""

SUB_SLEEP = """
import os, threading, time

def sub_thread():
    while True:
        time.sleep(0.05)

def sub_sleep():
    t = threading.Thread(target=sub_thread, name="sub_thread")   # (no daemons there)
    t.start()
    while t.native_id is None:
        time.sleep(0.001)
    os.write(1, b"tid sub_thread %d\\n" % t.native_id)
    os.write(STARTED_W, b"x")
    while True:
        time.sleep(0.05)

sub_sleep()
"""
# the pipe the sleeper's subinterpreter tells the main thread on that its
# thread has printed its tid (descriptors are the process's, not an
# interpreter's)
STARTED_R, STARTED_W = os.pipe()
SUB_SLEEP = SUB_SLEEP.replace("STARTED_W", str(STARTED_W))

SUB_CRASH = """
import os, time

def sub_crash():
    time.sleep(3)
    os.abort()

sub_crash()
"""


def run_in(source):
    """Run source in a new subinterpreter, from this (the main) one."""
    if sys.version_info >= (3, 14):
        from concurrent import interpreters
        interpreters.create().exec(source)
    elif sys.version_info >= (3, 13):
        import _interpreters
        _interpreters.exec(_interpreters.create(), source)
    else:
        import _xxsubinterpreters
        _xxsubinterpreters.run_string(_xxsubinterpreters.create(), source)


def main_spin():
    n = 0
    while True:
        n += 1


def started(name, source, seen):
    def body():
        # one write each: the two threads' lines never interleave
        os.write(1, b"tid %s %d\n" % (name.encode(), threading.get_native_id()))
        seen.release()
        run_in(source)
    threading.Thread(target=body, name=name, daemon=True).start()


def threads_case():
    seen = threading.Semaphore(0)
    started("spinner", SUB_SPIN, seen)
    started("sleeper", SUB_SLEEP, seen)
    seen.acquire()
    seen.acquire()
    # the subinterpreter's thread has printed its tid (else the sleeper
    # failed: exit, and the test says so)
    if not select.select([STARTED_R], [], [], 60)[0]:
        sys.exit("the sleeper's subinterpreter thread did not start")
    print("tid main %d" % threading.get_native_id())
    print("ready", flush=True)
    main_spin()


def crash_case():
    seen = threading.Semaphore(0)
    started("crasher", SUB_CRASH, seen)
    seen.acquire()
    print("ready", flush=True)
    while True:
        time.sleep(1)


def pool_case():
    from concurrent.futures import InterpreterPoolExecutor
    from subinterp_work import pool_spin
    pool = InterpreterPoolExecutor(max_workers=4)
    for _ in range(4):
        pool.submit(pool_spin)
    time.sleep(1.0)                 # every worker has its interpreter and runs
    print("tid main %d" % threading.get_native_id())
    print("ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    {"threads": threads_case, "crash": crash_case, "pool": pool_case}[sys.argv[1]]()
