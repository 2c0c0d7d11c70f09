"""Two Python threads spinning in pure Python: each spends about half of
its time waiting for the GIL (take_gil).  Runs argv[1] seconds; prints
"ready" once both run."""
import sys
import threading
import time


def spinner(end):
    n = 0
    while time.monotonic() < end:
        n += 1


def main():
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    end = time.monotonic() + duration
    threads = [threading.Thread(target=spinner, args=(end,), name=f"spinner{i}") for i in range(2)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
