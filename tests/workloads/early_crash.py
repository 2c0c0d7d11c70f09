"""Workload for tests/test_crash_births.py: a Python process that crashes in
C (ctypes reads address 8) soon after it starts, before a scan of /proc could
find it.

    python early_crash.py soon SECONDS   sleeps SECONDS in soon(), then crashes
    python early_crash.py import         crashes while its second module
                                         (early_crash_mod.py) is imported
    python early_crash.py fork SECONDS [BEFORE]
                                         forks (after BEFORE seconds); the child
                                         crashes SECONDS after the fork in
                                         child(), the parent waits for it and
                                         prints its pid
"""
import ctypes
import os
import sys
import time


def soon(seconds):
    time.sleep(seconds)
    ctypes.string_at(8)     # SOON_LINE


def child(seconds):
    time.sleep(seconds)
    ctypes.string_at(8)     # CHILD_LINE


def main():
    what = sys.argv[1]
    if what == "soon":
        soon(float(sys.argv[2]))     # SOON_CALL
    elif what == "import":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import early_crash_mod  # noqa: F401  IMPORT_LINE
    elif what == "fork":
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
        pid = os.fork()
        if pid == 0:
            child(float(sys.argv[2]))   # FORK_LINE
            os._exit(0)
        print(pid, flush=True)
        os.waitpid(pid, 0)


main()                      # MAIN_LINE
