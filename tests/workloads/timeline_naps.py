"""--timeline's workload: a thread named `napper` naps 100 ms once a second
and prints each nap's own clock (`nap T0 T1`, CLOCK_MONOTONIC ns, read just
before and after it).  With `wakers`: a thread `waiter` waits on an Event
that a thread `setter` sets every 200 ms.  The main thread only waits, so
that no one holds the GIL when a nap ends."""
import sys
import threading
import time


def nap():
    time.sleep(0.1)


def napper():
    while True:
        t0 = time.monotonic_ns()
        nap()
        t1 = time.monotonic_ns()
        print(f"nap {t0} {t1}", flush=True)
        time.sleep(0.9)


def waiter(ev):
    while True:
        ev.wait()
        ev.clear()


def setter(ev):
    while True:
        time.sleep(0.2)
        ev.set()


threading.Thread(target=napper, name="napper", daemon=True).start()
if "wakers" in sys.argv[1:]:
    ev = threading.Event()
    threading.Thread(target=waiter, args=(ev,), name="waiter", daemon=True).start()
    threading.Thread(target=setter, args=(ev,), name="setter", daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
