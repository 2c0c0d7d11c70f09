"""A thread that allocates reference cycles without pause, so that the
cyclic collector runs often, for long enough each time (a high threshold)
to be sampled (tests/test_thread_names.py's GC test).  gc.callbacks
measure the collector's own time: `gc SECONDS of SECONDS` at the end.

Prints `ready`, runs argv[1] seconds.
"""
import gc
import sys
import time

END = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 10.0)
in_gc = 0.0
began = None


def measure(phase, info):
    global in_gc, began
    if phase == "start":
        began = time.perf_counter()
    elif began is not None:
        in_gc += time.perf_counter() - began
        began = None


class Node(object):
    def __init__(self):
        self.me = self                  # a cycle: only the collector frees it
        self.data = [1, 2, 3]           # DATA


def allocate():
    junk = []
    for _ in range(1000):
        junk.append(Node())            # ALLOC
    return len(junk)


gc.set_threshold(50000, 10, 10)
gc.callbacks.append(measure)
print("ready", flush=True)
t0 = time.perf_counter()
while time.monotonic() < END:
    allocate()
print("gc %.6f of %.6f" % (in_gc, time.perf_counter() - t0), flush=True)
