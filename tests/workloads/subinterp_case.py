"""Run inside a sub-interpreter by known_stacks.py (CPython 3.12+): sits in
sub_case -> sub_burn until the given monotonic deadline, idle until a byte
arrives on the file descriptor `go`, then burning the CPU."""
import select
import time

GO = []         # the readable fds once `go` has its byte


def sub_burn(seconds, go):
    # Only C calls on the loop's line: the stack is the same idle or busy.
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end: n += 1 if GO else time.sleep(0.01) or GO.extend(select.select([go], [], [], 0)[0]) or 0  # L:sub_burn
    return n


def sub_case(deadline, go):
    while time.monotonic() < deadline:
        sub_burn(0.5, go)  # L:sub_case
