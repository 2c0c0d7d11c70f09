"""Threads that each make many keys: every thread waits in KEYS functions
of its own name (waiter_00, waiter_01, ...: KEYS Python stacks, so KEYS
off-CPU keys), 12 ms each, then ends; four at a time, one after another.

    python thread_keys.py KEYS SECONDS DELAY

Prints `ready`; a thread that ends at once a second in (pyoffcpu loads its
fold of ended threads when a target starts one); the rest start DELAY
seconds after `ready` and run for SECONDS.
"""
import sys
import threading
import time

KEYS = int(sys.argv[1])
SECONDS, DELAY = float(sys.argv[2]), float(sys.argv[3])

WAITERS = []
for i in range(KEYS):
    ns = {"time": time}
    exec(f"def waiter_{i:02d}():\n    time.sleep(0.012)\n", ns)
    WAITERS.append(ns[f"waiter_{i:02d}"])


def many_keys():
    for waiter in WAITERS:
        waiter()


def main():
    print("ready", flush=True)
    time.sleep(min(1.0, DELAY / 2))
    threading.Thread(target=lambda: None).start()
    time.sleep(DELAY - min(1.0, DELAY / 2))
    until = time.monotonic() + SECONDS
    while time.monotonic() < until:
        batch = [threading.Thread(target=many_keys) for _ in range(4)]
        for t in batch:
            t.start()
        for t in batch:
            t.join()


if __name__ == "__main__":
    main()
