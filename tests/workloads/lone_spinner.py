"""A thread that never leaves the CPU of its own accord.

`spinner` spins in pure Python for the whole run; the other threads block
for good before "ready" (two parked on an Event nobody sets, the main thread
in one long time.sleep), so no thread ever asks for the GIL and the spinner
never switches voluntarily: it is on the CPU all the time except when the
scheduler preempts it for another task on the machine.  It is pinned to
the last CPU, so that a test can keep its own processes off that one.
Prints "tid <name> <kernel tid>" for each thread, "cpu <N>" (or "cpu -" on
one CPU), then "ready"; exits after argv[1] seconds (default: an hour).
Stdlib only, CPython 3.7 on.
"""
import ctypes
import os
import platform
import sys
import threading
import time

never = threading.Event()
tids = {}
# the spinner's own CPU (the last one); the test keeps pyoffcpu off it
_cpus = sorted(os.sched_getaffinity(0))
CPU = _cpus[-1] if len(_cpus) > 1 else None
up = threading.Barrier(4)


def gettid():
    if hasattr(threading, "get_native_id"):         # 3.8+
        return threading.get_native_id()
    nr = {"x86_64": 186, "aarch64": 178}[platform.machine()]
    return ctypes.CDLL(None, use_errno=True).syscall(nr)


def parked(name):
    tids[name] = gettid()
    up.wait()
    never.wait()


def spinner():
    tids["spinner"] = gettid()
    if CPU is not None:
        os.sched_setaffinity(0, {CPU})      # this thread only
    up.wait()
    n = 0
    while True:
        n += 1


def main():
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0
    threading.current_thread().name = "main"
    tids["main"] = gettid()
    for i in range(2):
        threading.Thread(target=parked, args=("parked-%d" % i,), name="parked-%d" % i,
                         daemon=True).start()
    threading.Thread(target=spinner, name="spinner", daemon=True).start()
    up.wait()
    for name in sorted(tids):
        print("tid %s %d" % (name, tids[name]))
    print("cpu %s" % ("-" if CPU is None else CPU))
    print("ready", flush=True)
    time.sleep(duration)


if __name__ == "__main__":
    main()
