"""Starts a thread once told to (SIGUSR1, sent after the profiler attached):
prints `ready`, waits for the signal, runs `late_spin` in a new thread for
argv[1] seconds of its own CPU time (thread_time: however loaded the machine
is, the thread is on the CPU that long), prints `late <native id>` and exits."""
import signal
import sys
import threading
import time

go = threading.Event()


def late_spin(seconds):
    end = time.thread_time() + seconds
    n = 0
    while time.thread_time() < end: n += 1  # HOT
    return n


def main():
    spin = float(sys.argv[1])
    signal.signal(signal.SIGUSR1, lambda *a: go.set())
    print("ready", flush=True)
    while not go.wait(0.05):
        pass
    t = threading.Thread(target=late_spin, args=(spin,), name="late")
    t.start()
    print("late", t.native_id, flush=True)
    t.join()


if __name__ == "__main__":
    main()
