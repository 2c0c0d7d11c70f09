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
block.  Prints "ready", runs for argv[1] seconds (default: forever), then
prints its own clock's split: "split A=<%> B=<%> blocks=<n>".
Written to run on every CPython from 3.7 on.
"""
import sys
import time

BLOCK_S = 0.001
PATTERN = "ABBABBABBB"          # 3 x A, 7 x B


def wait_on(seconds):
    time.sleep(seconds)         # the one blocking call


def caller(end):
    clock = time.perf_counter
    spent = {"A": 0.0, "B": 0.0}
    blocks = 0
    while time.monotonic() < end:
        for step in PATTERN:
            t0 = clock()
            if step == "A":
                wait_on(BLOCK_S)  # LINE A
            else:
                wait_on(BLOCK_S)  # LINE B
            spent[step] += clock() - t0
            blocks += 1
    return spent, blocks


def main():
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else float("inf")
    print("ready", flush=True)
    spent, blocks = caller(time.monotonic() + duration)
    total = spent["A"] + spent["B"]
    print("split A=%.3f B=%.3f blocks=%d" % (100 * spent["A"] / total, 100 * spent["B"] / total,
                                             blocks), flush=True)


if __name__ == "__main__":
    main()
