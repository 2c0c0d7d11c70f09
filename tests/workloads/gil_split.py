"""Threads with a known relation to the GIL (tests/test_gil_bpf.py):

  spinner0, spinner1   pure Python loops: they hold the GIL while on a CPU,
                       and wait for it while the other holds it
  hasher               hashlib.sha256 over 8 MiB: on a CPU without the GIL
                       (hashlib lets it go for inputs of 2 KiB and more)

Prints `tid NAME NATIVE_ID` per thread, then `ready`; runs argv[1] seconds.
With argv[2] == "spinners", only the two spinners run.
"""
import hashlib
import sys
import threading
import time

END = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
ONLY_SPINNERS = len(sys.argv) > 2 and sys.argv[2] == "spinners"
started = []
lock = threading.Lock()


def native_id():
    try:
        return threading.get_native_id()
    except AttributeError:              # 3.7
        import ctypes
        return ctypes.CDLL(None).syscall(186)


def announce(name):
    with lock:
        started.append((name, native_id()))


def spinner(name):
    announce(name)
    n = 0
    while time.monotonic() < END:
        n += 1


def hasher():
    announce("hasher")
    data = b"x" * (8 << 20)
    while time.monotonic() < END:
        hashlib.sha256(data).digest()


def main():
    threads = [threading.Thread(target=spinner, args=(f"spinner{i}",)) for i in range(2)]
    if not ONLY_SPINNERS:
        threads.append(threading.Thread(target=hasher))
    for t in threads:
        t.start()
    while len(started) < len(threads):
        time.sleep(0.01)
    for name, tid in started:
        print("tid", name, tid)
    print("ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
