"""What the crash watcher (collect/crashcapture.py) costs: BPF ns per
signal delivery (bpf_stats: crash_signal's run time includes its tail
calls) for a non-fatal signal (the filter only: what nothing crashing costs),
a native crash and a Python crash; the end-to-end time of a signal with and
without the watcher; the maps' memory.  Root; run from the repository:

    .venv/bin/python tools/crash_cost.py [--signals N] [--crashes N]
"""
import argparse
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "pytool"))

from pyoffcpu.collect.crashcapture import CrashCapture  # noqa: E402
from pyoffcpu.cpython import detect  # noqa: E402

SIGLOOP = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static volatile long n;
static void h(int s) { (void)s; n++; }
int main(int argc, char **argv) {
    long count = atol(argv[1]);
    signal(SIGUSR1, h);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < count; i++) raise(SIGUSR1);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / count);
    return 0;
}
"""
NULL = "int main(void) { return *(volatile int *)0; }\n"


def build(tmp, name, src):
    path = os.path.join(tmp, name)
    with open(path + ".c", "w") as f:
        f.write(src)
    subprocess.run(["gcc", "-O2", "-o", path, path + ".c"], check=True)
    return path


def no_core():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def delta(cap, before):
    runs, ns = cap.stats()["crash_signal"]
    return runs - before[0], ns - before[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--signals", type=int, default=200000)
    ap.add_argument("--crashes", type=int, default=20)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    sigloop, null = build(tmp, "sigloop", SIGLOOP), build(tmp, "null", NULL)
    lib = os.path.join(tmp, "crash_fixture.so")
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", lib,
                    os.path.join(ROOT, "tests", "workloads", "crash_fixture.c")], check=True)

    def loop_ns():
        return float(subprocess.run([sigloop, str(a.signals)], capture_output=True, text=True,
                                    check=True).stdout)
    base = min(loop_ns() for _ in range(3))
    cap = CrashCapture()
    cap.enable_stats()
    try:
        s0 = cap.stats()["crash_signal"]
        watched = min(loop_ns() for _ in range(3))
        runs, ns = delta(cap, s0)
        print(f"non-fatal signal (SIGUSR1): BPF {ns / max(runs, 1):.0f} ns per delivery ({runs} runs); "
              f"raise()+handler {base:.0f} ns without the watcher, {watched:.0f} ns with it")

        s0 = cap.stats()["crash_signal"]
        for _ in range(a.crashes):
            subprocess.run([null], preexec_fn=no_core)
        runs, ns = delta(cap, s0)
        evs = cap.poll(1.0)
        print(f"native crash (SIGSEGV, C program): BPF {ns / max(runs, 1) / 1000:.1f} us per run over "
              f"{runs} runs (the deliveries of other signals meanwhile included), {len(evs)} events")

        total_ns = total_runs = n = 0
        for _ in range(max(a.crashes // 4, 1)):
            p = subprocess.Popen([a.python, os.path.join(ROOT, "tests", "workloads", "crashes.py"), lib,
                                  "null", "--wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, preexec_fn=no_core)
            for line in p.stdout:
                if line.strip() == "ready":
                    break
            cap.register_python(p.pid, detect.find_python(p.pid))
            s0 = cap.stats()["crash_signal"]
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait()
            runs, ns = delta(cap, s0)
            total_ns += ns
            total_runs += runs
            n += len(cap.poll(1.0))
            cap.unregister(p.pid)
        print(f"Python crash (SIGSEGV, 4 Python frames, {a.python}): BPF {total_ns / max(n, 1) / 1000:.1f} us "
              f"per crash ({n} events, {total_runs} deliveries)")
        mem = cap.map_memory()
        print("memory: " + ", ".join(f"{k} {v // 1024} KiB" for k, v in sorted(mem.items(), key=lambda kv: -kv[1]))
              + f"; total {sum(mem.values()) // 1024} KiB")
    finally:
        cap.close()


if __name__ == "__main__":
    main()
