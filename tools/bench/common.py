"""What every bench case shares: the paths, the log, the processes it
starts (and ends on the way out), the profilers it compares, the Tools
each case gets, the Results it fills, and the /proc readings of the
server cases."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

sys.path.insert(0, os.path.join(ROOT, "tools"))

import bpfstats  # noqa: E402
import startup as starts  # noqa: E402,F401  (tools/startup.py, for the cases: one start of pyoffcpu, measured)
from harness import proc_stat_cpu_ticks, proc_stat_tree_ticks, proc_status_kib  # noqa: E402

WORKLOADS = os.path.join(HERE, "workloads.py")
EXPORTERS = os.path.join(HERE, "exporters.py")
FLOOR = os.path.join(HERE, "floor.py")
THREADSERVER = os.path.join(HERE, "threadserver.py")
RESULTS = os.path.join(HERE, "results.md")
BENCH_VENV = os.path.join(HERE, ".venv")
PYSPY_VERSION = "0.4.3"
SETTLE_S = 0.3              # after a profiler says it is sampling, before the work starts

T0 = time.monotonic()
_procs: List[subprocess.Popen] = []      # everything started here, to end on the way out


def log(msg: str):
    sys.stderr.write(f"[bench {time.monotonic() - T0:6.1f}s] {msg}\n")
    sys.stderr.flush()

# -- processes -----------------------------------------------------------------------
class Proc:
    """A child with its stdout lines in a queue and its stderr lines timestamped."""

    def __init__(self, argv: List[str], stdin: bool = False, merge: bool = False,
                 env: Optional[Dict[str, str]] = None):
        """merge: stdout and stderr both into the timestamped lines (py-spy
        says `Sampling process` on stdout)."""
        self.argv = argv
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                                  bufsize=1, errors="replace", env=env)
        self.started = time.monotonic()
        _procs.append(self.p)
        self.pid = self.p.pid
        self.out: "queue.Queue[str]" = queue.Queue()
        self.err: List[Tuple[float, str]] = []
        self._err_cv = threading.Condition()
        if merge:
            threading.Thread(target=self._read_err, args=(self.p.stdout,), daemon=True).start()
        else:
            threading.Thread(target=self._read_out, daemon=True).start()
            threading.Thread(target=self._read_err, args=(self.p.stderr,), daemon=True).start()

    def _read_out(self):
        for line in self.p.stdout:
            self.out.put(line.rstrip("\n"))
        self.out.put(None)

    def _read_err(self, stream):
        for line in stream:
            with self._err_cv:
                self.err.append((time.monotonic(), line.rstrip("\n")))
                self._err_cv.notify_all()
        with self._err_cv:
            self.err.append((time.monotonic(), None))
            self._err_cv.notify_all()

    def err_line(self, pattern: str) -> Optional[float]:
        """When a stderr line matching `pattern` came, or None (not yet)."""
        rx = re.compile(pattern)
        with self._err_cv:
            for t, line in self.err:
                if line is not None and rx.search(line):
                    return t
        return None

    def wait_err(self, pattern: str, timeout: float) -> float:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        with self._err_cv:
            while True:
                for t, line in self.err[seen:]:
                    if line is None:
                        raise RuntimeError(f"{self.argv[0]} exited before {pattern!r}: {self.stderr_tail()}")
                    if rx.search(line):
                        return t
                seen = len(self.err)
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{os.path.basename(self.argv[0])}: no {pattern!r} after {timeout:.0f}s: "
                                       f"{self.stderr_tail()}")
                self._err_cv.wait(min(left, 0.5))

    def stderr_tail(self, n: int = 3) -> str:
        with self._err_cv:
            lines = [line for _, line in self.err if line]
        return " | ".join(lines[-n:])

    def send(self, line: str):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def expect(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {prefix!r} from {self.argv[1:3]} after {timeout:.0f}s")
            try:
                line = self.out.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.argv[1:3]} exited before {prefix!r}: {self.stderr_tail()}")
            if line.startswith(prefix):
                return line

    def interrupt(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{os.path.basename(self.argv[0])} did not exit within {timeout:.0f}s")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def close(self, timeout: float = 5):
        """A process that reads commands on stdin: `exit`, then killed if it
        has not gone within timeout."""
        if self.p.poll() is None:
            try:
                self.send("exit")
                self.p.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Worker(Proc):
    def __init__(self, python: str, kind: str):
        """kind: a workload of workloads.py, with its argument if any ("pingpong 40")."""
        super().__init__(self.command(python, kind), stdin=True)
        self.expect("ready", 30)

    @staticmethod
    def command(python: str, kind: str) -> List[str]:
        return [python, WORKLOADS, *kind.split()]

    def run(self, n, timeout: float = 300) -> Tuple[float, dict]:
        self.send(f"run {n}")
        _, dt, extra = self.expect("done ", timeout).split(" ", 2)
        return float(dt), json.loads(extra)

    def start_run(self, n):
        """Start work without waiting for it (startup/teardown targets)."""
        self.send(f"run {n}")


# -- profilers ---------------------------------------------------------------------------
@dataclass
class Profiler:
    label: str
    argv: Callable[[int, str], List[str]]     # (pid, output path without extension)
    ready: str                                # stderr line that says it samples
    pyoffcpu: bool
    stats: bool = False                       # read its BPF programs' run times
    merge: bool = False                       # its ready line comes on stdout (py-spy)
    start_s: float = 1.0                      # without a ready line: its start-up, waited out
    folded: Optional[Callable[[str], str]] = None   # output path without extension -> folded
                                                    # text; None: o.folded (pyoffcpu), o.txt

    def read_folded(self, o: str) -> str:
        """Its profile written to `o` (the path argv got), as folded stacks."""
        if self.folded is not None:
            return self.folded(o)
        with open(o + (".folded" if self.pyoffcpu else ".txt"), errors="replace") as f:
            return f.read()


EMPTY_PAIR = "reference: empty programs on sched_switch and rseq_update (raw)"   # case 4's floor (issue 37)
EXACT = "pyoffcpu --mode wall --off-cpu exact"     # a stack at every switch (issue 37's row)
TIMELINE = "pyoffcpu --mode wall --timeline"        # and every wait of 100 us or more sent whole (issue 41)


def profilers(tools: "Tools") -> Dict[str, Profiler]:
    po, ps = tools.pyoffcpu, tools.pyspy
    out = {
        "pyoffcpu --mode cpu -F 99": Profiler(
            "pyoffcpu --mode cpu -F 99",
            lambda pid, o: po + ["-p", str(pid), "--mode", "cpu", "-F", "99", "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
        "pyoffcpu --mode wall": Profiler(
            "pyoffcpu --mode wall",
            lambda pid, o: po + ["-p", str(pid), "--mode", "wall", "-F", "99", "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
        EXACT: Profiler(
            EXACT,
            lambda pid, o: po + ["-p", str(pid), "--mode", "wall", "-F", "99", "--off-cpu", "exact",
                                 "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
        TIMELINE: Profiler(
            TIMELINE,
            lambda pid, o: po + ["-p", str(pid), "--mode", "wall", "-F", "99", "--timeline",
                                 o + ".timeline.json", "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
        "pyoffcpu --mode wall --wakers": Profiler(
            "pyoffcpu --mode wall --wakers",
            lambda pid, o: po + ["-p", str(pid), "--mode", "wall", "-F", "99", "--wakers",
                                 "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
    }
    for kind, label in (("tp-empty", "reference: empty program on the sched_switch tracepoint"),
                        ("raw-filter", "reference: raw tracepoint, 2 hash lookups"),
                        ("raw-empty-pair", EMPTY_PAIR)):
        out[label] = Profiler(label, (lambda kind: lambda pid, o: [sys.executable, FLOOR, kind])(kind),
                              r"^floor: attached", False, stats=True)
    if ps:
        for label, extra in (("py-spy record -r 100", []), ("py-spy record --native -r 100", ["--native"]),
                             ("py-spy record --idle -r 100", ["--idle"])):
            out[label] = Profiler(
                label,
                (lambda extra: lambda pid, o: ps + ["record", "-p", str(pid), "-r", "100", *extra,
                                                    "-f", "raw", "-o", o + ".txt"])(extra),
                r"py-spy> Sampling process", False, merge=True)
    return out


@dataclass
class Tools:
    python: str
    pyoffcpu: List[str]
    pyspy: Optional[List[str]]
    pyspy_version: str = ""
    outdir: str = ""
    env: Optional[Dict[str, str]] = None       # for pyoffcpu and the exporters (--tree)
    sysctl: Optional[bpfstats.StatsSysctl] = None
    profs: Dict[str, "Profiler"] = field(default_factory=dict)
    cache_dir: str = ""                         # the bench's PYOFFCPU_CACHE_DIR (cases 6 and 11)
    workers: Callable[[str, str], "Worker"] = None  # (python, kind) -> a target; None: Worker

    def worker(self, kind: str) -> "Worker":
        """A target process running workloads.py `kind` (case 16: in the chroot)."""
        return (self.workers or Worker)(self.python, kind)


def setup_pyspy() -> Tuple[Optional[List[str]], str]:
    """py-spy from PyPI in tools/bench/.venv (made once, idempotent)."""
    exe = os.path.join(BENCH_VENV, "bin", "py-spy")

    def version():
        try:
            return subprocess.run([exe, "--version"], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except OSError:
            return ""
    v = version()
    if v != f"py-spy {PYSPY_VERSION}":
        log(f"installing py-spy {PYSPY_VERSION} into {os.path.relpath(BENCH_VENV, ROOT)}")
        try:
            if not os.path.exists(os.path.join(BENCH_VENV, "bin", "pip")):
                subprocess.run(["/usr/bin/python3", "-m", "venv", BENCH_VENV], check=True)
            subprocess.run([os.path.join(BENCH_VENV, "bin", "pip"), "install", "-q",
                            "--disable-pip-version-check", f"py-spy=={PYSPY_VERSION}"], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            log(f"py-spy unavailable ({e}): its rows are left out")
            return None, ""
        v = version()
    return [exe], v


# -- results ---------------------------------------------------------------------------------
@dataclass
class Results:
    overhead: List[dict] = field(default_factory=list)
    bpf: List[dict] = field(default_factory=list)
    accuracy: Optional[dict] = None
    startup: Optional[dict] = None
    exporters: List[dict] = field(default_factory=list)
    longrun: Optional[dict] = None
    server: Optional[dict] = None               # case 10
    multi: Optional[dict] = None                # case 11
    allprocs: Optional[dict] = None             # case 12
    dump: Optional[dict] = None                 # case 13
    unwind: Optional[dict] = None               # case 14
    torch: Optional[dict] = None                # case 15
    py315: Optional[dict] = None                # case 16
    asyncio: Optional[dict] = None              # case 17
    crashes: Optional[dict] = None              # case 18
    threads: Optional[dict] = None              # case 19
    shadow: List[dict] = field(default_factory=list)   # sampled against exact (shadow.py), per case
    notes: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


# -- /proc readings of the server cases (9-12) -------------------------------------------------
def read_file(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None

def proc_reading(pid: int) -> Optional[dict]:
    """RSS, peak RSS (KiB), threads and CPU ticks of a live process; None once it is gone."""
    st, stat = read_file(f"/proc/{pid}/status"), read_file(f"/proc/{pid}/stat")
    if st is None or stat is None:
        return None
    try:
        ticks = proc_stat_cpu_ticks(stat)
    except (ValueError, IndexError):
        return None
    return {"rss_kib": proc_status_kib(st, "VmRSS"), "hwm_kib": proc_status_kib(st, "VmHWM"),
            "threads": proc_status_kib(st, "Threads"), "ticks": ticks}

def end_server(srv: Proc, cli: Optional[Proc]):
    """Stop the load client (SIGINT, then kill), then the server ("exit", then kill)."""
    if cli:
        cli.interrupt()
        try:
            cli.p.wait(20)
        except subprocess.TimeoutExpired:
            pass
        cli.kill()
    srv.close(10)

def server_stats(srv: Proc) -> dict:
    srv.send("stats")
    return json.loads(srv.expect("stats ", 10).split(" ", 1)[1])

def tree_cpu_s(pid: int) -> Optional[float]:
    """User+system seconds of a live process, its children's it waited for,
    and those of its live descendants (pyoffcpu's helper processes: the
    tables and symbol indexes of its targets' files, a compile); None once
    it is gone."""
    st = read_file(f"/proc/{pid}/stat")
    if st is None:
        return None
    parent: Dict[int, int] = {}
    ticks: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        text = read_file(f"/proc/{name}/stat")
        if text is None:
            continue
        try:
            parent[int(name)], ticks[int(name)] = proc_stat_tree_ticks(text)
        except (ValueError, IndexError):
            continue
    if pid not in ticks:
        return None
    total = 0
    for p, t in ticks.items():
        q, hops = p, 0
        while q and q != pid and hops < 64:
            q, hops = parent.get(q, 0), hops + 1
        if q == pid:
            total += t
    return total / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> Optional[float]:
    """User+system seconds of a live process (all its threads), None once it is gone."""
    st = read_file(f"/proc/{pid}/stat")
    if st is None:
        return None
    try:
        return proc_stat_cpu_ticks(st) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError):
        return None
