"""The workload `make demo` profiles: two threads sharing a lock.

main:    parse_records (CPU), then save_results (holds the lock, sleeps as if
         writing to a slow disk), then time.sleep between batches.
worker:  crunch (CPU), then waits for the lock main holds (off-CPU).
Run: python3 tools/demo_app.py [SECONDS]
"""
import json
import sys
import threading
import time

lock = threading.Lock()
stop = threading.Event()


def parse_records(n):
    blob = json.dumps([{"id": i, "name": "item%d" % i, "tags": ["a", "b"]} for i in range(n)])
    return json.loads(blob)


def save_results(records):
    with lock:
        time.sleep(0.06)        # a slow write, with the lock held
    return len(records)


def crunch(n):
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def worker():
    while not stop.is_set():
        crunch(200000)
        with lock:              # waits while main is "writing"
            pass


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    t = threading.Thread(target=worker, name="worker")
    t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        save_results(parse_records(3000))
        time.sleep(0.04)
    stop.set()
    t.join()


if __name__ == "__main__":
    main()
