"""One thread per kind of wait, each waiting almost all of its time in one
place (tests/test_reasons_bpf.py):

  sleeper    time.sleep(0.05) in a loop                          -> sleep
  reader     os.read on a pipe the writer fills every 50 ms      -> io
  selector   select.select on a pipe that stays empty, 50 ms     -> poll
  locked     lock.acquire of a lock the holder keeps 40 of 50 ms,
             then an Event until the holder's next turn          -> lock
  holder     holds that lock: time.sleep(0.04) inside, 0.01 out  -> sleep
  writer     time.sleep(0.05), then one byte into the pipe       -> sleep
  owner      holds lock2 40 of every 50 ms                       -> sleep
  contender  lock2.acquire, then sleeps 20 ms: woken by the owner's release

Prints `tid NAME NATIVE_ID` per thread, then `ready`; runs argv[1] seconds.
"""
import os
import select
import signal
import sys
import threading
import time

END = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
lock = threading.Lock()
lock2 = threading.Lock()
turn = threading.Event()
data_r, data_w = os.pipe()
empty_r, _empty_w = os.pipe()


# The longest wait of a thread since the last SIGUSR2 (its own clock), by name
LONGEST = {"sleeper": 0, "reader": 0, "contender": 0}


def waited(name, t0):
    """The wait since t0, kept if it is the thread's longest."""
    took = time.monotonic_ns() - t0
    LONGEST[name] = max(LONGEST[name], took)
    return took


def sleeper():
    while time.monotonic() < END:
        t0 = time.monotonic_ns()
        time.sleep(0.05)            # SLEEP
        waited("sleeper", t0)


def reader():
    while time.monotonic() < END:
        t0 = time.monotonic_ns()
        os.read(data_r, 1)          # READ
        waited("reader", t0)


def writer():
    while time.monotonic() < END:
        time.sleep(0.05)
        os.write(data_w, b"x")


def selector():
    while time.monotonic() < END:
        select.select([empty_r], [], [], 0.05)      # SELECT


def holder():
    while time.monotonic() < END:
        with lock:
            time.sleep(0.04)
        turn.set()
        time.sleep(0.01)


def locked():
    # waits in the lock while the holder has it, then in an Event (a lock
    # inside) until the holder's next turn: every wait of it is a lock's
    while time.monotonic() < END:
        lock.acquire()              # ACQUIRE
        lock.release()
        turn.clear()
        turn.wait(1)


def owner():
    while time.monotonic() < END:
        lock2.acquire()
        time.sleep(0.04)
        lock2.release()             # RELEASE
        time.sleep(0.01)


# The contender's own clock of its lock waits: SIGUSR2 prints `contended NS
# WINDOW_NS longest sleeper=NS reader=NS contender=NS`, the wait since the
# last SIGUSR2 (a wait under way is cut at the signal), the time since it, and
# the longest wait of those threads since it.
CONTENDED = [0, None]               # ns counted, start of the wait under way
LAST_MARK = [time.monotonic_ns()]


def contender():
    while time.monotonic() < END:
        CONTENDED[1] = time.monotonic_ns()
        lock2.acquire()             # CONTEND
        CONTENDED[0] += waited("contender", CONTENDED[1])
        CONTENDED[1] = None
        lock2.release()
        time.sleep(0.02)


def mark(*_):
    now = time.monotonic_ns()
    since = CONTENDED[1]
    total = CONTENDED[0] + (now - since if since is not None else 0)
    CONTENDED[0] = 0
    if since is not None:
        CONTENDED[1] = now
    window, LAST_MARK[0] = now - LAST_MARK[0], now
    longest = " ".join("%s=%d" % kv for kv in sorted(LONGEST.items()))
    LONGEST.update(dict.fromkeys(LONGEST, 0))
    print("contended", total, window, "longest", longest, flush=True)


def main():
    signal.signal(signal.SIGUSR2, mark)
    started = []
    for fn in (sleeper, reader, writer, selector, holder, locked, owner, contender):
        def run(fn=fn):
            started.append((fn.__name__, threading.get_native_id()))
            fn()
        t = threading.Thread(target=run, name=fn.__name__, daemon=True)
        t.start()
    while len(started) < 8:
        time.sleep(0.01)
    for name, tid in started:
        print("tid", name, tid, flush=True)
    print("ready", flush=True)
    while time.monotonic() < END:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
