"""Workload for the crash-storm tests (tests/test_crash_storm.py): one Python
process that segfaults in C (ctypes reads address 8) when a line arrives on
stdin, inside storm_victim() (its marked line), called from main().

    python storm.py

Prints "ready" once it waits for the line."""
import ctypes
import sys


def storm_victim():
    ctypes.string_at(8)     # STORM_LINE


def main():
    print("ready", flush=True)
    sys.stdin.readline()
    storm_victim()


main()
