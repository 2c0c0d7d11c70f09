"""An ML-shaped process for the native unwinder: numpy's OpenBLAS kernels
(hand-written assembly without CFI) on a thread of their own and on
OpenBLAS's worker threads, beside a pool sorting arrays and a thread doing
JSON.  Prints "ready" once every thread runs; runs until killed or for
argv[1] seconds."""
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

N = 600


def matmul_loop(stop):
    a = np.random.rand(N, N)
    b = np.random.rand(N, N)
    while not stop.is_set():
        a @ b


def sort_one(seed):
    rng = np.random.default_rng(seed)
    return float(np.sort(rng.random(200_000))[0])


def sort_loop(stop):
    with ThreadPoolExecutor(max_workers=2) as pool:
        seed = 0
        while not stop.is_set():
            list(pool.map(sort_one, range(seed, seed + 4)))
            seed += 4


def json_loop(stop):
    doc = {"rows": [{"id": i, "name": "row%d" % i, "vals": list(range(20))} for i in range(200)]}
    while not stop.is_set():
        json.loads(json.dumps(doc))


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0
    stop = threading.Event()
    threads = [threading.Thread(target=f, args=(stop,), name=f.__name__)
               for f in (matmul_loop, sort_loop, json_loop)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    print("ready", flush=True)
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
