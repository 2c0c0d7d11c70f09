"""Ten threads doing every kind of thing a thread does with its time.

  main          time.sleep in 10 ms steps
  hash-0..2     CPU-bound outside the GIL (sha256 of a 16 MiB buffer, which
                releases the GIL): with the spinner, four threads want the
                two CPUs, so the scheduler preempts them (runqueue time)
  spinner       pure Python, spins the whole run and never blocks in its own
                code (it only hands the GIL over when other threads ask)
  burst         pure Python: 5 ms of CPU, then 5 ms of sleep (GIL contention)
  lock-holder   holds `lock` for 20 ms (asleep), lets go for 2 ms
  lock-waiter   blocked in lock.acquire while the holder has it
  pipe-writer   writes a byte to a pipe every 2 ms
  pipe-reader   blocked in os.read on that pipe

Every thread is started before "ready" and runs until the end: each is alive
for the whole of any recording that starts after "ready".  Before "ready" it
prints "tid <name> <kernel tid>" for each thread.  Runs for argv[1] seconds
(default: forever).  Stdlib only, CPython 3.7 on.
"""
import ctypes
import hashlib
import os
import platform
import sys
import threading
import time

BUF = bytes(16 << 20)
lock = threading.Lock()
pipe_r, pipe_w = os.pipe()
tids = {}
started = threading.Barrier(10)
END = [float("inf")]


def gettid():
    if hasattr(threading, "get_native_id"):         # 3.8+
        return threading.get_native_id()
    nr = {"x86_64": 186, "aarch64": 178}[platform.machine()]
    return ctypes.CDLL(None, use_errno=True).syscall(nr)


def running():
    return time.monotonic() < END[0]


def hasher():
    while running():
        hashlib.sha256(BUF).digest()


def spinner():
    n = 0
    while running():
        n += 1


def burst():
    while running():
        t = time.perf_counter() + 0.005
        while time.perf_counter() < t:
            pass
        time.sleep(0.005)


def lock_holder():
    while running():
        with lock:
            time.sleep(0.020)
        time.sleep(0.002)


def lock_waiter():
    while running():
        lock.acquire()
        lock.release()
        time.sleep(0.001)


def pipe_writer():
    while running():
        time.sleep(0.002)
        os.write(pipe_w, b"x")


def pipe_reader():
    while running():
        os.read(pipe_r, 1)


def sleeper():
    while running():
        time.sleep(0.010)


def thread(name, fn):
    def body():
        tids[name] = gettid()
        started.wait()
        fn()
    return threading.Thread(target=body, name=name, daemon=True)


def main():
    if len(sys.argv) > 1:
        END[0] = time.monotonic() + float(sys.argv[1])
    threading.current_thread().name = "main"
    threads = [thread("hash-%d" % i, hasher) for i in range(3)]
    threads += [thread("spinner", spinner), thread("burst", burst),
                thread("lock-holder", lock_holder), thread("lock-waiter", lock_waiter),
                thread("pipe-writer", pipe_writer), thread("pipe-reader", pipe_reader)]
    for t in threads:
        t.start()
    tids["main"] = gettid()
    started.wait()                  # all ten have their tids
    for name in sorted(tids):
        print("tid %s %d" % (name, tids[name]))
    print("ready", flush=True)
    sleeper()
    os.write(pipe_w, b"x" * 8)      # let the reader see the end


if __name__ == "__main__":
    main()
