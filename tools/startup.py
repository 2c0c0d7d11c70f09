#!/usr/bin/env python3
"""Start-up of `pyoffcpu -p PID -d 1` against tests/workloads/split.py:
seconds from spawn to the first sample (first entry in its `agg` map:
tools/bench/bpfstats.FirstSampleProbe, as bench case 6), to the `recording`
line; peak RSS of the pyoffcpu process (VmHWM, polled until it exits) and of
it with its children (ru_maxrss from wait4: a compile child counts); its CPU
time.

    sudo PYOFFCPU_CACHE_DIR=/tmp/pc .venv/bin/python tools/startup.py [--cold] [-n RUNS]

PYOFFCPU_CMD: the command (default .venv/bin/pyoffcpu); --cold empties
$PYOFFCPU_CACHE_DIR/bpf (the compiled programs and BTF offsets) before each
run.  Medians on stdout, each run on stderr.
"""
import os
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
import bpfstats  # noqa: E402

args = sys.argv[1:]
cold = "--cold" in args
n = int(args[args.index("-n") + 1]) if "-n" in args else 5
cmd = shlex.split(os.environ.get("PYOFFCPU_CMD", os.path.join(ROOT, ".venv/bin/pyoffcpu")))
cache = os.environ.get("PYOFFCPU_CACHE_DIR")
if cold and not cache:
    sys.exit("startup.py: --cold empties $PYOFFCPU_CACHE_DIR/bpf: set PYOFFCPU_CACHE_DIR")
rows = []
out = os.path.join(tempfile.mkdtemp(prefix="pyoffcpu-startup-"), "x.folded")
w = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workloads/split.py"), "900"],
                     stdout=subprocess.PIPE, text=True)
assert w.stdout.readline().strip() == "ready"


def hwm(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None


try:
    for i in range(n):
        if cold:
            shutil.rmtree(os.path.join(cache, "bpf"), ignore_errors=True)
        t0 = time.monotonic()
        p = subprocess.Popen(cmd + ["-p", str(w.pid), "-d", "1", "-o", out],
                             stderr=subprocess.PIPE, text=True)
        probe = bpfstats.FirstSampleProbe(p.pid)
        first = rec = None
        peak = 0.0
        err = ""
        os.set_blocking(p.stderr.fileno(), False)
        while time.monotonic() - t0 < 120:
            if first is None and probe.poll():
                first = time.monotonic() - t0
            h = hwm(p.pid)
            if h:
                peak = max(peak, h)
            r, _, _ = select.select([p.stderr], [], [], 0.003)
            if r:
                err += p.stderr.read() or ""
                if rec is None and "pyoffcpu: recording" in err:
                    rec = time.monotonic() - t0
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
        probe.close()
        if not pid:
            pid, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err += p.stderr.read() or ""
        cpu = ru.ru_utime + ru.ru_stime
        row = dict(first=first if first else float("inf"), rec=rec or float("inf"), hwm=peak,
                   maxrss=ru.ru_maxrss / 1024, cpu=cpu)
        rows.append(row)
        print(f"  run {i + 1}: rc {p.returncode}  first sample {row['first']:.3f} s  recording line "
              f"{row['rec']:.3f} s  VmHWM {peak:.0f} MiB  with children {row['maxrss']:.0f} MiB  "
              f"cpu {cpu:.2f} s (whole 1 s run)  load {open('/proc/loadavg').read().split()[0]}",
              file=sys.stderr)
        for line in err.splitlines():
            if "error" in line or ("notice" in line and "cache" in line):
                print("     ", line, file=sys.stderr)
finally:
    w.kill()
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)


def med(k):
    return statistics.median(r[k] for r in rows)


print(f"{'cold' if cold else 'warm'} ({' '.join(cmd)}): median of {n}: first sample {med('first'):.3f} s, "
      f"recording line {med('rec'):.3f} s, VmHWM {med('hwm'):.0f} MiB, with children {med('maxrss'):.0f} MiB, "
      f"cpu {med('cpu'):.2f} s")
