"""Two threads in a lock-order inversion (tests/test_dump.py): `first`
takes lock_a then lock_b, `second` lock_b then lock_a; both end up in
acquire for good.  `holder` locks a pthread mutex (through ctypes) and
keeps it, `waiter` then blocks locking it.  `spinner` spins in C holding
the GIL (sum over a huge range: no eval breaker in it), `sleeper` sleeps.
Prints `tid NAME NATIVE_ID` per thread, then `ready`.  argv[1] "nospin":
no spinner."""
import ctypes
import sys
import threading
import time

lock_a, lock_b = threading.Lock(), threading.Lock()
both = threading.Barrier(2)
started = []
SPIN = len(sys.argv) < 2 or sys.argv[1] != "nospin"


def native_id():
    try:
        return threading.get_native_id()
    except AttributeError:              # 3.7
            return ctypes.CDLL(None).syscall(186)


def first():
    started.append(("first", native_id()))
    with lock_a:
        both.wait()
        lock_b.acquire()                # FIRST_BLOCKS


def second():
    started.append(("second", native_id()))
    with lock_b:
        both.wait()
        lock_a.acquire()                # SECOND_BLOCKS


libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)     # zeroed: PTHREAD_MUTEX_INITIALIZER
held = threading.Event()


def holder():
    started.append(("holder", native_id()))
    libc.pthread_mutex_lock(mutex)
    held.set()
    while True:
        time.sleep(0.1)


def waiter():
    started.append(("waiter", native_id()))
    held.wait()
    libc.pthread_mutex_lock(mutex)      # WAITER_BLOCKS


def spinner():
    started.append(("spinner", native_id()))
    time.sleep(0.3)                     # let the others block first
    sum(range(10 ** 13))                # SPIN_IN_C


def sleeper():
    started.append(("sleeper", native_id()))
    while True:
        time.sleep(0.1)                 # SLEEPS


def main():
    names = [first, second, sleeper, holder, waiter] + ([spinner] if SPIN else [])
    for fn in names:
        threading.Thread(target=fn, name=fn.__name__, daemon=True).start()
    time.sleep(0.2)
    for name, tid in started:
        print("tid", name, tid)
    print("ready", flush=True)
    while True:
        time.sleep(1)                   # MAIN_SLEEPS


if __name__ == "__main__":
    main()
