"""Workload for the crash tests (tests/test_crashes.py): a Python process that
dies in C code, at known lines, with a thread blocked at a known line.

    python crashes.py LIBRARY CASE [--wait]

LIBRARY is crash_fixture.c built as a shared library; CASE:
  null    the main thread: main -> run_case -> crash_in_native -> crash_null()
          (cf_outer -> cf_middle -> cf_inner reads through NULL: SIGSEGV)
  abort   a second thread "aborter": abort_thread -> crash_abort()
          (ab_outer -> ab_middle -> ab_inner -> abort(): SIGABRT), once
          the main thread waits in join_aborter
  divide  the main thread: main -> run_case -> divide_in_native -> crash_divide(0)
Always: a thread "blocked" waits in blocked_wait on a lock the main thread
holds.  Prints "tid NAME TID" per thread, then "ready"; with --wait it
crashes once a line arrives on stdin (a watcher has seen it start), else
at once.
"""
import ctypes
import sys
import threading


def blocked_wait(lock):
    lock.acquire()          # BLOCKED_LINE


def crash_in_native(lib):
    lib.crash_null()        # NULL_LINE


def divide_in_native(lib):
    lib.crash_divide(0)     # DIVIDE_LINE


def abort_thread(lib, main_tid):
    # once the main thread has come to join_aborter and blocks there
    while not joining or not sleeping(main_tid):
        pass
    lib.crash_abort()       # ABORT_LINE


def join_aborter(t):
    t.join()                # JOIN_LINE


joining = False


def sleeping(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def run_case(lib, case):
    if case == "null":
        crash_in_native(lib)    # RUN_NULL_LINE
    elif case == "divide":
        divide_in_native(lib)   # RUN_DIVIDE_LINE
    else:
        global joining
        t = threading.Thread(target=abort_thread, args=(lib, threading.get_native_id()), name="aborter")
        t.start()
        joining = True
        join_aborter(t)         # RUN_JOIN_LINE


def main():
    lib = ctypes.CDLL(sys.argv[1])
    case = sys.argv[2]
    lock = threading.Lock()
    lock.acquire()
    ready = threading.Event()
    blocked = threading.Thread(target=lambda: (ready.set(), blocked_wait(lock)), name="blocked", daemon=True)
    blocked.start()
    ready.wait()
    print("tid main", threading.get_native_id(), flush=True)
    print("tid blocked", blocked.native_id, flush=True)
    # the blocked thread is in acquire() once it no longer runs
    while not sleeping(blocked.native_id):
        pass
    print("ready", flush=True)
    if len(sys.argv) > 3 and sys.argv[3] == "--wait":
        sys.stdin.readline()
    run_case(lib, case)         # MAIN_LINE


main()                      # MODULE_LINE
