"""Case 7: a synthetic Profile through one exporter, in a process of its own.

    python exporters.py FORMAT OUTPUT [SAMPLES] [STACKS]

Builds a Profile of SAMPLES samples (default 1,000,000) over STACKS distinct
stacks (default 50,000), deterministic, shaped like a real one (a tree of
calls shared by prefix, Python / native / kernel frames, on- and off-CPU,
8 threads), writes it with pyoffcpu's exporter for FORMAT, and prints one JSON
line: build_s, export_s, rss_after_build (bytes), maxrss (bytes, ru_maxrss of
this process), output size.
"""
import json
import os
import random
import resource
import sys
import time

from pyoffcpu.export import write_profile
from pyoffcpu.profile.model import (OFF_RUNQUEUE, OFF_SLEEP, OFF_DISK, Metadata, Profile, StackKey,
                                    kernel_frame, native_frame, python_frame)

PID = 4242
THREADS = [PID] + [PID + i for i in range(1, 8)]
PERIOD_NS = 1_000_000_000 // 99


def frame_pool(rng):
    py = [python_frame(f"Class{i % 97}.method_{i}", f"/opt/app/lib/python3.11/site-packages/pkg{i % 40}/"
                       f"module{i % 300}.py", rng.randint(1, 3000)) for i in range(4000)]
    native = [native_frame(f"native_function_{i}(int, char const*)", "/usr/lib/libfoo.so")
              for i in range(600)]
    kernel = [kernel_frame(f"kernel_fn_{i}") for i in range(150)]
    return py, native, kernel


def synthetic_profile(samples: int, stacks: int, seed: int = 12345) -> Profile:
    rng = random.Random(seed)
    py, native, kernel = frame_pool(rng)
    prof = Profile(Metadata(target=f"pid {PID}", command_line="python3 synthetic.py",
                            python_version="3.11.7", mode="wall", start_time=time.time(),
                            duration_s=600.0, frequency_hz=99))
    prof.processes[PID] = "python3"
    for i, tid in enumerate(THREADS):
        prof.threads[tid] = "MainThread" if i == 0 else f"worker-{i}"
        prof.thread_pid[tid] = PID
    # Zipf-like sample counts: a few hot stacks, a long tail; every stack >= 1
    raw = [1.0 / (i + 1) ** 0.9 for i in range(stacks)]
    scale = (samples - stacks) / sum(raw)
    counts = [1 + int(r * scale) for r in raw]
    counts[0] += samples - sum(counts)
    seen = set()
    paths = []          # generated frame tuples, to share prefixes with
    n = 0
    while n < stacks:
        if paths and rng.random() < 0.9:
            parent = paths[rng.randrange(len(paths))]
            frames = list(parent[:rng.randint(1, len(parent))])
        else:
            frames = [py[rng.randrange(20)]]              # a few roots
        depth = rng.randint(8, 40)
        while len(frames) < depth:
            frames.append(py[rng.randrange(len(py))])
        leaf = rng.random()
        if leaf < 0.5:
            frames.extend(native[rng.randrange(len(native))] for _ in range(rng.randint(1, 4)))
        if leaf < 0.15:
            frames.extend(kernel[rng.randrange(len(kernel))] for _ in range(rng.randint(1, 6)))
        frames = tuple(frames)
        tid = THREADS[rng.randrange(len(THREADS))]
        k = rng.random()
        off = None if k < 0.6 else OFF_SLEEP if k < 0.85 else OFF_RUNQUEUE if k < 0.95 else OFF_DISK
        key = StackKey(PID, tid, frames, off)
        if key in seen:
            continue
        seen.add(key)
        paths.append(frames)
        c = counts[n]
        ns = c * PERIOD_NS if off is None else c * rng.randint(1_000, 50_000_000)
        prof.add(key, ns, c)
        n += 1
    return prof


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    fmt, out = sys.argv[1], sys.argv[2]
    samples = int(sys.argv[3]) if len(sys.argv) > 3 else 1_000_000
    stacks = int(sys.argv[4]) if len(sys.argv) > 4 else 50_000
    t0 = time.perf_counter()
    prof = synthetic_profile(samples, stacks)
    t1 = time.perf_counter()
    rss_build = rss_now()
    write_profile(prof, out, fmt, title="pyoffcpu bench: synthetic profile")
    t2 = time.perf_counter()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"format": fmt, "build_s": t1 - t0, "export_s": t2 - t1,
                      "rss_after_build": rss_build, "maxrss": maxrss,
                      "bytes": os.path.getsize(out),
                      "samples": sum(prof.sample_counts.values()), "stacks": len(prof.weights)}))


if __name__ == "__main__":
    main()
