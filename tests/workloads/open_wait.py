"""A wait that begins during a recording and is still open at its end
(tests/test_offcpu_sampling.py): thread `blocker` sleeps 10 ms at a time
for argv[1] seconds (default 1) after SIGUSR1, then waits on an Event
nobody sets, for good.  The main thread sleeps all along.  Prints
`tid blocker NATIVE_ID`, then `ready`."""
import signal
import sys
import threading
import time

BUSY_S = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
go = threading.Event()
never = threading.Event()
ids = []


def blocker():
    ids.append(threading.get_native_id())
    go.wait()
    end = time.monotonic() + BUSY_S
    while time.monotonic() < end:
        time.sleep(0.01)
    never.wait()                # OPEN WAIT


def main():
    signal.signal(signal.SIGUSR1, lambda *_: go.set())
    t = threading.Thread(target=blocker, name="blocker", daemon=True)
    t.start()
    while not ids:
        time.sleep(0.001)
    print(f"tid blocker {ids[0]}", flush=True)
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
