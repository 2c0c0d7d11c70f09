"""A workload whose wall-time split is built in (the test's ground truth).

Main thread, in 200 ms cycles: 100 ms in cpu_work (on CPU), 50 ms in
time.sleep, 50 ms blocked in lock.acquire until the `releaser` thread lets
go: 50% / 25% / 25%.  Runs for argv[1] seconds (default: forever), prints
"ready" once its threads are up, and exits by itself.
Written to run on every CPython from 3.6 on.
"""
import sys
import threading
import time

CPU_S, SLEEP_S, LOCK_S = 0.100, 0.050, 0.050

lock = threading.Lock()
go = threading.Event()


def cpu_work(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end: n += 1  # HOT
    return n


def releaser():
    while True:
        go.wait()
        go.clear()
        time.sleep(LOCK_S)
        lock.release()


def main():
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else float("inf")
    threading.current_thread().name = "main"
    lock.acquire()
    threading.Thread(target=releaser, name="releaser", daemon=True).start()
    print("ready", flush=True)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        cpu_work(CPU_S)
        time.sleep(SLEEP_S)
        go.set()
        lock.acquire()


if __name__ == "__main__":
    main()
