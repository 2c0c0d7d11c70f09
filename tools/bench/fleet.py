"""Bench case 12's machine: many Python processes of several interpreters at once.

    python fleet.py [--procs 50] [--busy 4] [--busy-duty 0.02] [--short-every 0.5]
                    [--short-life 1.0] PYTHON [PYTHON ...]

The parent starts, round-robin over the PYTHONs, the long-lived children
(`--procs` less the short-lived ones alive at a time, short-life / short-every
of them): the first `--busy` of them busy, spinning --busy-duty of every 50 ms;
the others idle, waking every 100 ms for 0.2 ms of Python work (so that an
on-CPU profiler meets each a few times in 20 s), half of them sleeping in
time.sleep between, half in a lock's acquire(timeout). Every idle child has a
second thread parked on a lock for good. Once all of them are up it prints

    ready JSON      {"parent": PID, "long": [{"pid", "python", "version", "role"}...],
                     "short_alive": K, "short_every": S, "short_life": L}

and then starts a short-lived child every --short-every seconds (the
interpreters in turn), each living --short-life seconds: it sleeps 0.2 s,
spins 30 ms of Python work, sleeps out the rest of its life.

Commands on stdin, one a line:
    shorts    print `shorts JSON`: every short-lived child so far,
              [{"pid", "python", "start", "end"}] (time.monotonic(), the
              system's clock; end null while it lives)
    exit      end every child and leave (EOF on stdin, SIGINT, SIGTERM and
              SIGHUP too)

Every child reads its stdin (a pipe from the parent) in a thread and leaves at
its EOF, so they go with the parent however it goes (SIGKILL included); a
parent death signal (prctl) is asked for as well where ctypes is there.
Standard library only; the children run under CPython 3.7 and later.
"""
import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

IDLE_PERIOD_S = 0.1             # an idle child wakes this often ...
IDLE_WORK_S = 0.0002            # ... for this much Python work
BUSY_PERIOD_S = 0.05            # a busy child's cycle
SHORT_SLEEP_S = 0.2             # a short-lived child: sleeps, then works ...
SHORT_WORK_S = 0.03             # ... this long, then sleeps out its life


# -- the children ------------------------------------------------------------------
def _leave_with_parent():
    """Leave at EOF on stdin (the parent's end of the pipe closed: it is gone
    or asks us to go); and a death signal from the kernel where ctypes works."""
    def watch():
        try:
            while os.read(0, 512):
                pass
        except OSError:
            pass
        os._exit(0)
    threading.Thread(target=watch, name="watch-parent", daemon=True).start()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(0)
    except Exception:           # noqa: BLE001 - no ctypes in this build: the pipe is enough
        pass


def blip(seconds):
    """Pure-Python work for `seconds`."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def idle_sleep_loop():
    while True:
        time.sleep(IDLE_PERIOD_S)
        blip(IDLE_WORK_S)


def idle_lock_loop(held):
    while True:
        held.acquire(timeout=IDLE_PERIOD_S)
        blip(IDLE_WORK_S)


def parked(lock):
    lock.acquire()


def busy_loop(duty):
    work = BUSY_PERIOD_S * duty
    nxt = time.monotonic()
    while True:
        blip(work)
        nxt += BUSY_PERIOD_S
        time.sleep(max(0.0, nxt - time.monotonic()))


def short_life(life):
    t0 = time.monotonic()
    time.sleep(SHORT_SLEEP_S)
    blip(SHORT_WORK_S)
    time.sleep(max(0.0, life - (time.monotonic() - t0)))


def child(role, arg):
    _leave_with_parent()
    threading.current_thread().name = role
    if role == "short":
        short_life(float(arg))
        return
    held = threading.Lock()
    held.acquire()                      # never released
    threading.Thread(target=parked, args=(held,), name="parked", daemon=True).start()
    sys.stdout.write("ready %s\n" % sys.version.split()[0])
    sys.stdout.flush()
    if role == "busy":
        busy_loop(float(arg))
    elif role == "idle-lock":
        idle_lock_loop(held)
    else:
        idle_sleep_loop()


# -- the parent ------------------------------------------------------------------------
class Fleet:
    def __init__(self, args):
        self.args = args
        self.children = []              # every Popen, to end
        self.long = []
        self.shorts = []                # [Popen, record]
        self.next_short = 0
        self._long_popens = set()

    def spawn(self, python, role, arg, stdout):
        p = subprocess.Popen([python, os.path.abspath(__file__), "child", role, str(arg)],
                             stdin=subprocess.PIPE, stdout=stdout, close_fds=True)
        self.children.append(p)
        return p

    def start_long(self):
        a = self.args
        short_alive = int(round(a.short_life / a.short_every)) if a.short_every > 0 else 0
        n_long = max(0, a.procs - short_alive)
        started = []
        for i in range(n_long):
            py = a.pythons[i % len(a.pythons)]
            if i < a.busy:
                role, arg = "busy", a.busy_duty
            else:
                role, arg = ("idle-sleep" if (i - a.busy) % 2 == 0 else "idle-lock"), 0
            started.append((self.spawn(py, role, arg, subprocess.PIPE), py, role))
        for p, py, role in started:
            line = p.stdout.readline().decode(errors="replace").split()
            p.stdout.close()
            if len(line) != 2 or line[0] != "ready":
                raise RuntimeError("%s (%s) did not start: exit %s" % (py, role, p.poll()))
            self.long.append({"pid": p.pid, "python": py, "version": line[1], "role": role})
        return short_alive

    def start_short(self):
        a = self.args
        py = a.pythons[self.next_short % len(a.pythons)]
        self.next_short += 1
        p = self.spawn(py, "short", a.short_life, subprocess.DEVNULL)
        self.shorts.append([p, {"pid": p.pid, "python": py, "start": time.monotonic(), "end": None}])

    def reap(self):
        now = time.monotonic()
        for p, rec in self.shorts:
            if rec["end"] is None and p.poll() is not None:
                rec["end"] = now
        # a short-lived child reaped is no longer one to end
        self.children = [p for p in self.children if p.returncode is None or p in self._long_popens]

    def end(self):
        for p in self.children:
            try:
                p.stdin.close()         # its watcher thread sees EOF and leaves
            except OSError:
                pass
        deadline = time.monotonic() + 3
        for p in self.children:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def run(self):
        a = self.args
        short_alive = self.start_long()
        self._long_popens = set(self.children)
        print("ready " + json.dumps({"parent": os.getpid(), "long": self.long, "short_alive": short_alive,
                                     "short_every": a.short_every, "short_life": a.short_life}), flush=True)
        fd = sys.stdin.fileno()
        buf = b""
        nxt = time.monotonic()
        while True:
            now = time.monotonic()
            if a.short_every > 0 and now >= nxt:
                self.start_short()
                nxt += a.short_every
                if nxt < now:
                    nxt = now + a.short_every
            wait = 0.05 if a.short_every <= 0 else min(0.05, max(0.0, nxt - time.monotonic()))
            r, _, _ = select.select([fd], [], [], wait)
            self.reap()
            if not r:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = line.decode(errors="replace").strip()
                if cmd == "exit":
                    return
                if cmd == "shorts":
                    print("shorts " + json.dumps([rec for _, rec in self.shorts]), flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=50)
    ap.add_argument("--busy", type=int, default=4)
    ap.add_argument("--busy-duty", type=float, default=0.02)
    ap.add_argument("--short-every", type=float, default=0.5)
    ap.add_argument("--short-life", type=float, default=1.0)
    ap.add_argument("pythons", nargs="+")
    args = ap.parse_args()
    fleet = Fleet(args)

    def leave(signum, _frame):
        raise SystemExit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, leave)
    try:
        fleet.run()
    finally:
        fleet.end()


if __name__ == "__main__":
    main()
