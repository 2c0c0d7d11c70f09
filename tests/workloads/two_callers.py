"""One blocking helper called from two lines of one caller (issue 8).

The main thread runs `caller`, which calls `wait_on` -- one helper, one C
call (time.sleep), hence the same user PC, the same stack pointer and, from
either line, the same innermost Python frame -- from two lines, A and B, in
the fixed pattern A B B A B B A B B B: 3 blocks from line A and 7 from
line B per cycle, every block the same length (BLOCK_S).  So by construction
30% of the caller's blocked (off-CPU) time is under line A and 70% under line
B; block-length jitter (timer slack, wake-up latency) is the same on both
lines and does not move the split.  Most blocks follow a block from the
other line: a profiler that reuses the previous capture when the helper
blocks "in the same place" charges one line with everything.

Single-threaded (no GIL hand-offs); the CPU part is a few microseconds per
block, BLOCK_S long (argv[2], default 1 ms: 100 us for the sampled waits
of tests/test_offcpu_sampling.py).  Prints "ready", runs for argv[1]
seconds (default: forever), then
prints its own clock's split: "split A=<%> B=<%> blocks=<n>".  On a loaded
machine a 1 ms sleep overshoots by varying amounts and the time split drifts
from 30/70: SIGUSR1 restarts the count (at the start of a recording) and
SIGUSR2 prints the split since then, the ground truth of that window.
Written to run on every CPython from 3.7 on.
"""
import signal
import sys
import time

BLOCK_S = 0.001
PATTERN = "ABBABBABBB"          # 3 x A, 7 x B


def wait_on(seconds):
    time.sleep(seconds)         # the one blocking call


spent = {"A": 0.0, "B": 0.0, "blocks": 0}


def caller(end):
    clock = time.perf_counter
    while time.monotonic() < end:
        for step in PATTERN:
            t0 = clock()
            if step == "A":
                wait_on(BLOCK_S)  # LINE A
            else:
                wait_on(BLOCK_S)  # LINE B
            spent[step] += clock() - t0
            spent["blocks"] += 1


def report(*_):
    total = (spent["A"] + spent["B"]) or 1.0
    print("split A=%.3f B=%.3f blocks=%d" % (100 * spent["A"] / total, 100 * spent["B"] / total,
                                             spent["blocks"]), flush=True)


def restart(*_):
    spent.update(A=0.0, B=0.0, blocks=0)


def main():
    global BLOCK_S
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else float("inf")
    if len(sys.argv) > 2:
        BLOCK_S = float(sys.argv[2])
    signal.signal(signal.SIGUSR1, restart)
    signal.signal(signal.SIGUSR2, report)
    print("ready", flush=True)
    caller(time.monotonic() + duration)
    report()


if __name__ == "__main__":
    main()
