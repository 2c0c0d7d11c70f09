"""Threads with names of their own, for thread names and `dump --locals`
(tests/test_thread_names.py).  Twelve threads block in hold() with known
arguments and locals: worker-0 .. worker-9, a non-ASCII name, and one
named `before-rename` that SIGUSR1 renames `after-rename`; the main
thread stays MainThread.

Prints `tid NAME NATIVE_ID` per thread, then `ready`; runs argv[1] seconds.
"""
import ctypes
import signal
import sys
import threading
import time

END = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
NAMES = ["worker-%d" % i for i in range(10)] + [u"\u00fcn\u00efcode-\u540d\u524d", "before-rename"]
libc = ctypes.CDLL(None, use_errno=True)
started = []
lock = threading.Lock()
go = threading.Event()


def hold(count, label, blob, *rest, **opts):
    total = count * 2
    items = [1, 2, 3]
    mapping = {"k": None}
    with lock:
        started.append((threading.current_thread().name, libc.syscall(186)))
    go.wait(END - time.monotonic())     # HOLD
    return total, items, mapping


threads = [threading.Thread(target=hold, args=(42, "hello", b"x" * 10), name=n) for n in NAMES]
for t in threads:
    t.start()
while len(started) < len(threads):
    time.sleep(0.01)


def rename(signum, frame):
    threads[-1].name = "after-rename"


signal.signal(signal.SIGUSR1, rename)
for name, tid in sorted(started) + [("MainThread", libc.syscall(186))]:
    print("tid %s %d" % (name, tid))
print("ready", flush=True)
while time.monotonic() < END:
    time.sleep(0.05)
go.set()
