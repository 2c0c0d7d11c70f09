"""A short job (tests/test_short_jobs.py): spends SECONDS of CPU (0.3 by
default) in work(), then exits.

    python short_job.py [SECONDS]
"""
import sys
import time


def work(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:    # WORK_LINE
        pass


work(float(sys.argv[1]) if len(sys.argv) > 1 else 0.3)
