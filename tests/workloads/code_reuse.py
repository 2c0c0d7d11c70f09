"""Code objects freed and made again at the same address (tests/test_code_reuse.py):
GENERATIONS functions, each compiled from its own source, run for SECONDS of
CPU, then dropped with everything that refers to it, so the next one's code
object (and its name, file name and line table) may take the freed memory.
Prints the id of each generation's code object, one per line, and after
each its spin's wall time (`took SECONDS`: more than SECONDS of CPU where
the machine gave the CPU to something else meanwhile).

    python code_reuse.py [GENERATIONS] [SECONDS]
"""
import gc
import sys
import time

GENERATIONS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 0.15

SOURCE = """
def spin_{i:02d}(seconds, clock):
    end = clock() + seconds
    while clock() < end:
        pass
"""

for i in range(GENERATIONS):
    ns = {}
    exec(compile(SOURCE.format(i=i), "<generated>", "exec"), ns)
    fn = ns["spin_%02d" % i]
    print(id(fn.__code__), flush=True)
    began = time.monotonic()
    fn(SECONDS, time.process_time)
    print("took %.6f" % (time.monotonic() - began), flush=True)
    del fn, ns
    gc.collect()
