"""Starts a short-lived thread every argv[1] seconds for argv[3] seconds:
each spins argv[2] seconds of its own CPU time (thread_time) in `churn_spin`
and ends.  Prints `ready` first, and at the end one line
`ends JSON`: [[native id, time.time() as the thread's function returned], ...]."""
import json
import sys
import threading
import time

ends = []


def churn_spin(seconds):
    end = time.thread_time() + seconds
    n = 0
    while time.thread_time() < end: n += 1  # HOT
    ends.append((threading.get_native_id(), time.time()))
    return n


def main():
    every, spin, seconds = (float(a) for a in sys.argv[1:4])
    print("ready", flush=True)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        t = threading.Thread(target=churn_spin, args=(spin,), name="churn")
        t.start()
        t.join()
        time.sleep(every)
    print("ends", json.dumps(ends), flush=True)


if __name__ == "__main__":
    main()
