"""Bench workloads, driven over stdin/stdout by tools/bench/run.py.

    python workloads.py KIND [ARG]

prints `ready` once set up (threads started), then reads commands, one a line:
    run N    do the fixed work N (iterations, round trips or seconds), then
             print `done ELAPSED_S JSON` (ELAPSED_S timed around the work only; JSON
             has cpu_s, the process's CPU time, and rq_s, its threads' run-queue wait)
    exit     leave

KIND:
    cpu       one thread of pure-Python CPU work; N = work units
    threads   the same work on the main thread while 150 threads block on an Event
    pingpong [K]  the main thread and an echo thread bounce a byte over two pipes, both
              pinned to one CPU (BENCH_PINGPONG_CPU, default 0), the main thread doing K
              iterations of Python work before each round trip (default 0); N = round trips
    idle      a thread that wakes every 50 ms to do almost nothing (a bystander target)
    split     two threads with a built-in wall-time split (CPU / sleep / lock / I/O);
              N = seconds; JSON holds the time each thread measured in each function
Plain CPython 3.7+, nothing imported beyond the standard library.
"""
import json
import os
import socket
import sys
import threading
import time


def runqueue_wait():
    """Seconds this process's threads have spent runnable but waiting for a CPU
    (/proc/self/task/*/schedstat, second field): how much the machine's other
    load delayed the work."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def ctx_switches():
    """Voluntary + involuntary context switches of all this process's threads."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


# -- CPU work ----------------------------------------------------------------------
def leaf(x):
    return (x * 7 + 3) % 1000003


def middle(n):
    s = 0
    for i in range(n):
        s += leaf(i)
    return s


def cpu_unit():
    return middle(1000)


def cpu_run(n):
    s = 0
    for _ in range(n):
        s += cpu_unit()
    return s


# -- kinds -----------------------------------------------------------------------------
class Cpu:
    def run(self, n):
        cpu_run(n)
        return {}


class Threads(Cpu):
    N_BLOCKED = 150

    def __init__(self):
        self.event = threading.Event()
        self.threads = [threading.Thread(target=self.event.wait, name=f"blocked-{i}", daemon=True)
                        for i in range(self.N_BLOCKED)]
        for t in self.threads:
            t.start()


def spin(k):
    """k iterations of plain Python work between two round trips."""
    s = 0
    for i in range(k):
        s += i
    return s


class PingPong:
    def __init__(self, spin_iterations="0"):
        self.spin = int(spin_iterations)
        # Both threads on one CPU: every switch is a local one. Spread over two
        # vCPUs the round trip is dominated by waking an idle vCPU (a hypervisor
        # exit), which varies tenfold from run to run and hides what a switch costs.
        cpu = int(os.environ.get("BENCH_PINGPONG_CPU", "0"))
        if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
            os.sched_setaffinity(0, {cpu})
        self.to_echo_r, self.to_echo_w = os.pipe()
        self.from_echo_r, self.from_echo_w = os.pipe()
        threading.Thread(target=self.echo, name="echo", daemon=True).start()

    def echo(self):
        while True:
            b = os.read(self.to_echo_r, 1)
            if not b:
                return
            os.write(self.from_echo_w, b)

    def run(self, n):
        before = ctx_switches()
        t0 = time.perf_counter()
        w, r, k = self.to_echo_w, self.from_echo_r, self.spin
        for _ in range(n):
            if k:
                spin(k)
            os.write(w, b"x")
            os.read(r, 1)
        dt = time.perf_counter() - t0
        return {"switches": ctx_switches() - before, "seconds": dt}


class Idle:
    def __init__(self):
        threading.Thread(target=self.tick, name="ticker", daemon=True).start()

    @staticmethod
    def tick():
        n = 0
        while True:
            time.sleep(0.05)
            n += 1

    def run(self, n):
        time.sleep(n)
        return {}


# The split: per thread, the milliseconds of one cycle in each function. The
# run measures what each function really took (perf_counter) and reports it.
SPLIT = {
    "main_loop": {"cpu_work": 80, "do_sleep": 40, "wait_lock": 40, "do_io": 40},     # 40/20/20/20 %
    "worker_loop": {"cpu_work": 20, "do_sleep": 60, "wait_lock": 30, "do_io": 90},   # 10/30/15/45 %
}
FUNCTIONS = ("cpu_work", "do_sleep", "wait_lock", "do_io")

held = threading.Lock()
held.acquire()          # never released: acquire(timeout=t) blocks for t


def cpu_work(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def do_sleep(seconds):
    time.sleep(seconds)


def wait_lock(seconds):
    held.acquire(timeout=seconds)


def do_io(sock, seconds):
    sock.settimeout(seconds)
    try:
        sock.recv(1)            # nothing is ever sent: a poll() that times out
    except socket.timeout:
        pass


def _loop(plan, seconds, out):
    sock, _peer = socket.socketpair()
    spent = {f: 0.0 for f in FUNCTIONS}
    pc = time.perf_counter
    start = pc()
    end = start + seconds
    while pc() < end:
        t = pc()
        cpu_work(plan["cpu_work"] / 1e3)
        t1 = pc()
        do_sleep(plan["do_sleep"] / 1e3)
        t2 = pc()
        wait_lock(plan["wait_lock"] / 1e3)
        t3 = pc()
        do_io(sock, plan["do_io"] / 1e3)
        t4 = pc()
        spent["cpu_work"] += t1 - t
        spent["do_sleep"] += t2 - t1
        spent["wait_lock"] += t3 - t2
        spent["do_io"] += t4 - t3
    out["total"] = pc() - start
    out["spent"] = spent
    sock.close()
    _peer.close()


def main_loop(seconds, out):
    _loop(SPLIT["main_loop"], seconds, out)


def worker_loop(seconds, out):
    _loop(SPLIT["worker_loop"], seconds, out)


class Split:
    def run(self, seconds):
        worker_out, main_out = {}, {}
        t = threading.Thread(target=worker_loop, args=(seconds, worker_out), name="worker")
        t.start()
        main_loop(seconds, main_out)
        t.join()
        return {"main_loop": main_out, "worker_loop": worker_out}


class Async:
    """An asyncio loop (case 17): a task doing n units of cpu_run work, one
    unit per step (`await asyncio.sleep(0)` between), beside a ticker
    (asyncio.sleep(0.01)), a queue fed by a producer task every 5 ms, and
    N_IDLE tasks waiting on an event; a run ends when the worker is done."""
    N_IDLE = 200

    def run(self, n):
        import asyncio
        return asyncio.run(self.main(n))

    async def main(self, n):
        import asyncio
        ev, queue = asyncio.Event(), asyncio.Queue()

        async def ticker():
            while True:
                await asyncio.sleep(0.01)

        async def producer():
            while True:
                await asyncio.sleep(0.005)
                queue.put_nowait(1)

        async def consumer():
            while True:
                await queue.get()

        others = [asyncio.create_task(c()) for c in (ticker, producer, consumer)]
        others += [asyncio.create_task(ev.wait()) for _ in range(self.N_IDLE)]
        for _ in range(n):
            cpu_unit()
            await asyncio.sleep(0)
        ev.set()
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        return {}


KINDS = {"cpu": Cpu, "threads": Threads, "pingpong": PingPong, "idle": Idle, "split": Split,
         "async": Async}


def main():
    threading.current_thread().name = "main"
    w = KINDS[sys.argv[1]](*sys.argv[2:])
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "run":
            n = float(cmd[1]) if sys.argv[1] in ("split", "idle") else int(cmd[1])
            rq0, c0 = runqueue_wait(), time.process_time()
            t0 = time.perf_counter()
            extra = w.run(n)
            dt = time.perf_counter() - t0
            extra["cpu_s"] = time.process_time() - c0
            extra["rq_s"] = runqueue_wait() - rq0
            print(f"done {dt:.6f} {json.dumps(extra)}", flush=True)


if __name__ == "__main__":
    main()
