"""An unprivileged process that plants a FIFO where root's profiler reads
(tests/test_untrusted.py): it loads a copy of a shared library from a
directory of its own, deletes the file and puts a FIFO at its path, so its
/proc/PID/maps names a path that blocks anyone who opens it for reading.

    python fifo_trap.py DIR LIBRARY

Prints "ready", then spins in Python until killed."""
import ctypes
import os
import shutil
import sys
import time


def main():
    d, lib = sys.argv[1], sys.argv[2]
    path = os.path.join(d, "libtrap.so")
    shutil.copy(lib, path)
    ctypes.CDLL(path)
    os.unlink(path)
    os.mkfifo(path)
    print("ready", flush=True)
    n = 0
    while True:
        n += 1
        if n % 1000000 == 0:
            time.sleep(0)


if __name__ == "__main__":
    main()
