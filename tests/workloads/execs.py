"""A process that becomes another interpreter by exec, same PID.

    python execs.py NEXT_PYTHON SECONDS

Spins in before_exec() for SECONDS (CPU time of its own thread, so waiting
for a CPU does not shorten the work), then execs NEXT_PYTHON on this file
with `after`, which spins in after_exec() for SECONDS and exits.  NEXT_PYTHON
is another CPython version on purpose: its struct layouts differ, so a
profiler that keeps the old image's offsets after the exec reads garbage.
"""
import os
import sys
import time


def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass                                    # SPIN


def before_exec(seconds):
    spin(seconds)


def after_exec(seconds):
    spin(seconds)


if __name__ == "__main__":
    # $EXECS_SLEEP: seconds asleep before the work (a process started during
    # a recording is found meanwhile, not while it spins)
    time.sleep(float(os.environ.get("EXECS_SLEEP", "0")))
    if sys.argv[1] == "after":
        after_exec(float(sys.argv[2]))
    else:
        before_exec(float(sys.argv[2]))
        sys.stdout.flush()
        os.execv(sys.argv[1], [sys.argv[1], os.path.abspath(__file__), "after", sys.argv[2]])
