"""Four threads, each spinning in a function of its own, all at once: on a
free-threaded build they run Python truly in parallel (no GIL), so a walker
that mixed up thread states would show one thread's function in another.

Usage: parallel_spinners.py SECONDS

Prints `tid <n> <native id>` for spinner n = 0..3, then `ready`.  Each spinner
loops on one line of its own function (`# S:<n>` markers) until SECONDS have
passed.  Needs 3.8+ (threading.get_native_id).
"""
import sys
import threading
import time

DEADLINE = [0.0]


def spin_0():
    n = 0
    while time.monotonic() < DEADLINE[0]: n += 1  # S:0
    return n


def spin_1():
    n = 0
    while time.monotonic() < DEADLINE[0]: n += 1  # S:1
    return n


def spin_2():
    n = 0
    while time.monotonic() < DEADLINE[0]: n += 1  # S:2
    return n


def spin_3():
    n = 0
    while time.monotonic() < DEADLINE[0]: n += 1  # S:3
    return n


SPINNERS = [spin_0, spin_1, spin_2, spin_3]


def main():
    DEADLINE[0] = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
    ids = {}
    up = threading.Barrier(len(SPINNERS) + 1)

    def run(i):
        ids[i] = threading.get_native_id()
        up.wait()
        SPINNERS[i]()

    threads = [threading.Thread(target=run, args=(i,), name="spin-%d" % i, daemon=True)
               for i in range(len(SPINNERS))]
    for t in threads:
        t.start()
    up.wait()
    for i in sorted(ids):
        print("tid %d %d" % (i, ids[i]), flush=True)
    print("ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
