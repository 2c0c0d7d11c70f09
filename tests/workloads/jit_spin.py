"""Workload for tests/test_jit_bpf.py: Python calls C (jit_outer ->
jit_caller) that spins in code made at run time (workloads/jit_spin.c).

    python jit_spin.py LIBJIT_SPIN.so SECONDS

Prints "ready" once the code is made, then spins in chunks of 50 ms."""
import ctypes
import sys
import time


def spin_jit(lib, seconds):
    lib.jit_outer(ctypes.c_double(seconds))


def main():
    lib = ctypes.CDLL(sys.argv[1])
    if lib.jit_make() != 0:
        sys.exit("cannot make the code")
    end = time.monotonic() + float(sys.argv[2])
    print("ready", flush=True)
    while time.monotonic() < end:
        spin_jit(lib, 0.05)


if __name__ == "__main__":
    main()
