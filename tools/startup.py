#!/usr/bin/env python3
"""Start-up of `pyoffcpu -p PID --mode wall -d 1` against tests/workloads/split.py:
seconds from spawn to the first sample (first entry in its `agg` map:
tools/bench/bpfstats.FirstSampleProbe), to the `recording` line; peak RSS of
the pyoffcpu process (VmHWM, polled until it exits) and of it with its
children (ru_maxrss from wait4: a compile child counts); its CPU time.

    sudo PYOFFCPU_CACHE_DIR=/tmp/pc .venv/bin/python tools/startup.py [--cold] [-n RUNS]

PYOFFCPU_CMD: the command (default .venv/bin/pyoffcpu); --cold empties
$PYOFFCPU_CACHE_DIR/bpf (the compiled programs and BTF offsets) before each
run.  Medians on stdout, each run on stderr.

Bench case 6 (tools/bench/run.py) measures its warm and cold starts with the
functions here: measure() follows one command from spawn to exit, and
start_run() is one such start of pyoffcpu, warm or cold.
"""
import os
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
import bpfstats  # noqa: E402
from harness import proc_status_kib, spread  # noqa: E402

RECORDING = b"pyoffcpu: recording"


def _hwm_kib(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return proc_status_kib(f.read(), "VmHWM")
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _tree_rss_kib(pid: int) -> int:
    """VmRSS of pid and of every process below it, summed, now: its helper
    processes (unwind tables, symbol indexes) run beside it, and their
    memory counts as its own.  A child with pid's own command line is a
    fork not yet exec'd (a helper being started): its pages are pid's, not
    counted twice."""
    total, todo, seen = 0, [pid], set()
    own = _cmdline(pid)
    while todo and len(seen) < 4096:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        if p != pid and own and _cmdline(p) == own:
            continue
        try:
            with open(f"/proc/{p}/status") as f:
                total += proc_status_kib(f.read(), "VmRSS") or 0
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def measure(cmd: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 120.0,
            first_sample: bool = True,
            during: Optional[Callable[[int, float], None]] = None) -> dict:
    """Spawn `cmd`, a pyoffcpu command line that ends by itself (-d), and follow
    it to its exit. Returns seconds from the spawn to the first entry in its
    `agg` map (`first`, None if none was seen; first_sample=False: not
    looked for) and to its `recording` line (`recording`, None without one);
    `hwm_mib`, its own peak RSS (VmHWM, the last reading before it exited);
    `maxrss_mib`, ru_maxrss of it and its children (wait4: the largest
    one, not their sum); `tree_mib`, the peak of the sum of the RSS of it
    and all its descendants at once (sampled at every poll); `cpu_s`, their
    user+system time; `rc`; `stderr`. `during(pid, seconds since the
    recording line)` is called at every poll after that line. Raises
    RuntimeError past `timeout` (the process is killed)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=env)
    fd = p.stderr.fileno()
    os.set_blocking(fd, False)
    probe = bpfstats.FirstSampleProbe(p.pid) if first_sample else None
    first = rec = None
    hwm = tree = 0
    err = b""
    eof = False
    status = ru = None
    pid = 0
    try:
        while True:
            now = time.monotonic()
            if now - t0 > timeout:
                raise RuntimeError(f"{os.path.basename(cmd[0])} still running after {timeout:.0f} s: "
                                   + err.decode(errors="replace").strip()[-300:])
            if probe is not None and first is None:
                try:
                    if probe.poll():
                        first = now - t0
                except OSError:
                    pass            # its map fd went away (it is exiting)
            h = _hwm_kib(p.pid)
            if h:
                hwm = max(hwm, h)
            tree = max(tree, _tree_rss_kib(p.pid))
            if rec is not None and during is not None:
                during(p.pid, now - t0 - rec)
            # fast polls until both moments are seen, then only the peak to follow
            # (VmHWM is the kernel's high-water mark: the last reading is the peak)
            busy = rec is None or (probe is not None and first is None)
            if not eof:
                r, _, _ = select.select([fd], [], [], 0.003 if busy else 0.02)
                if r:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        eof = True
                    err += chunk
                    if rec is None and RECORDING in err:
                        rec = time.monotonic() - t0
            else:
                time.sleep(0.003 if busy else 0.02)
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
    finally:
        if probe is not None:
            probe.close()
        if not pid:                               # left early (timeout, an error, Ctrl-C): end it
            p.kill()
            os.wait4(p.pid, 0)
            p.returncode = -9
            p.stderr.close()
    p.returncode = os.waitstatus_to_exitcode(status)
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            err += chunk
    except (BlockingIOError, OSError):
        pass
    p.stderr.close()
    text = err.decode(errors="replace")
    if rec is None and RECORDING.decode() in text:
        rec = time.monotonic() - t0       # the line came with its last words
    return {"first": first, "recording": rec, "hwm_mib": hwm / 1024, "maxrss_mib": ru.ru_maxrss / 1024,
            "tree_mib": tree / 1024,
            "cpu_s": ru.ru_utime + ru.ru_stime, "rc": p.returncode, "stderr": text,
            "total_s": time.monotonic() - t0}


def start_run(cmd: List[str], pid: int, out: str, cache: Optional[str], cold: bool,
              env: Optional[Dict[str, str]] = None, seconds: float = 1.0) -> dict:
    """One `CMD -p PID --mode wall -d SECONDS -o OUT` start, measured (measure()).
    cache: its PYOFFCPU_CACHE_DIR (None: the environment's); cold: its
    `bpf` subdirectory (programs and BTF offsets) is removed first."""
    env = dict(env if env is not None else os.environ)
    if cache is not None:
        env["PYOFFCPU_CACHE_DIR"] = cache
    if cold:
        d = env.get("PYOFFCPU_CACHE_DIR")
        if not d:
            raise ValueError("a cold start empties $PYOFFCPU_CACHE_DIR/bpf: give a cache directory")
        shutil.rmtree(os.path.join(d, "bpf"), ignore_errors=True)
    r = measure(cmd + ["-p", str(pid), "--mode", "wall", "-d", f"{seconds:g}", "-o", out], env=env)
    r["cold"] = cold
    if r["rc"] != 0:
        raise RuntimeError(f"pyoffcpu exited {r['rc']}: " + " | ".join(r["stderr"].strip().splitlines()[-3:]))
    return r


def notices(stderr: str) -> List[str]:
    """The lines of a run's stderr worth showing: errors, cache notices."""
    return [ln for ln in stderr.splitlines() if "error" in ln or ("notice" in ln and "cache" in ln)]


def main():
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
    try:
        for i in range(n):
            r = start_run(cmd, w.pid, out, None, cold)
            r["first"] = r["first"] if r["first"] is not None else float("inf")
            r["recording"] = r["recording"] if r["recording"] is not None else float("inf")
            rows.append(r)
            print(f"  run {i + 1}: rc {r['rc']}  first sample {r['first']:.3f} s  recording line "
                  f"{r['recording']:.3f} s  VmHWM {r['hwm_mib']:.0f} MiB  with children {r['maxrss_mib']:.0f} MiB  "
                  f"cpu {r['cpu_s']:.2f} s (whole 1 s run)  load {open('/proc/loadavg').read().split()[0]}",
                  file=sys.stderr)
            for line in notices(r["stderr"]):
                print("     ", line, file=sys.stderr)
    finally:
        w.kill()
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)

    def med(k):
        return spread([r[k] for r in rows])["median"]
    print(f"{'cold' if cold else 'warm'} ({' '.join(cmd)}): median of {n}: first sample {med('first'):.3f} s, "
          f"recording line {med('recording'):.3f} s, VmHWM {med('hwm_mib'):.0f} MiB, with children "
          f"{med('maxrss_mib'):.0f} MiB, cpu {med('cpu_s'):.2f} s")


if __name__ == "__main__":
    main()
