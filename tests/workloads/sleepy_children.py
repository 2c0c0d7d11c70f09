"""Two multiprocessing children (fork) that sleep SECONDS from their start
in nap(), forked as soon as the script runs (tests/test_subprocesses.py: a
launched command's children, blocked before its interpreter is found).

    python sleepy_children.py [SECONDS]
"""
import multiprocessing
import sys
import time


def nap(seconds):
    time.sleep(seconds)                         # NAP


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=nap, args=(seconds,)) for _ in range(2)]
    for c in children:
        c.start()
    for c in children:
        c.join()
