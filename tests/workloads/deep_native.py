"""A native stack deeper than the walk's 128 frames.

    python deep_native.py SECONDS [LEVELS]

Recurses LEVELS times (default 40) through a C function (sorted's key
callback: each level is several native frames, builtin_sorted, the list
sort, the vectorcall and an eval loop), then alternates 20 ms of spinning and
20 ms of sleep for SECONDS: on-CPU samples and switch-outs whose native
walks are cut at the depth limit, by the perf event's tail-call chain and by
sched_switch's (which is two calls longer).
"""
import sys
import time


def bottom(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic() + 0.02
        while time.monotonic() < t:
            pass                                # SPIN
        time.sleep(0.02)                        # SLEEP


def down(n, seconds):
    if n == 0:
        bottom(seconds)
    else:
        sorted([0], key=lambda _: down(n - 1, seconds))


print("ready", flush=True)
down(int(sys.argv[2]) if len(sys.argv) > 2 else 40, float(sys.argv[1]))
