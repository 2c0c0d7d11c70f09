# -*- coding: utf-8 -*-
"""Known Python stacks in known threads: the ground truth of
tests/test_cpython_versions.py.  Runs on every CPython from 3.7 on.

Usage: known_stacks.py SECONDS

Each case runs in its own thread (named after the case) and spends its time in
`burn`, reached through a stack whose every frame (qualified name, file, line)
the test knows from the `# L:<tag>` markers below:

  nested   case_nested -> outer -> outer.<locals>.inner -> Wörker.méthode
           -> Wörker.gen (a generator) -> its lambda -> 计算 -> 𠀀 -> burn
           (Latin-1, UCS-2 and UCS-4 names)
  async    case_async -> asyncio.run(...) ... -> main_coro -> child_coro -> burn
  init     case_init -> Klass.__init__ -> burn (a specialised class call on 3.13+)
  lock     case_lock -> wait_lock, blocked in lock.acquire (off-CPU, GIL released)
  recurse  case_recurse -> recurse x 300 -> burn (deeper than the BPF limit)
  late     case_late -> burn, started on SIGUSR1 (after the profiler attached)
  subinterp  (3.12+ only) a sub-interpreter running <module> (<string>) ->
           subinterp_case.sub_case -> sub_burn

Prints `tid <case> <native id>` per case thread and then `ready`.  The
threads set their stacks up and idle (in `burn`) until SIGUSR1, sent once the
profiler records: then they burn and the late thread starts (`tid late <native id>`).  Exits after
SECONDS (or when killed).
"""
import asyncio
import os
import queue
import signal
import sys
import threading
import time

CHUNK = 1e9             # seconds per burn call: it returns only when the run ends (STOP)
WARMUP = 64             # unspecialised calls before the timed ones (3.13 CALL_ALLOC_AND_ENTER_INIT)
DEPTH = 300
DEADLINE = 0.0          # monotonic end of the run (main sets it)
GO_PIPE = os.pipe()     # `go` for the sub-interpreter: a byte is written on SIGUSR1

stop = threading.Event()
GO = []                     # non-empty from SIGUSR1 on: the threads idle until the profiler runs
STOP = []                   # non-empty once the run ends: every burn returns
lock = threading.Lock()


def burn(seconds):
    # Until GO (SIGUSR1) the loop idles: the same line, only C calls in between,
    # so the stack is the same whether it burns or waits.  A case's burn does
    # not return while the profiler records: a return runs other lines
    # (stop.is_set() is a Python call), and a thread that loses the GIL there
    # waits for it, five threads' switch intervals long, in a stack that is
    # right but not the one the test expects (1% of a 3 s recording, seen).
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end and not STOP: n += 1 if GO else time.sleep(0.01) or 0  # L:burn
    return n


# -- nested: functions, a nested function, a method, a generator, a lambda,
#    non-ASCII names (Latin-1 class and method, UCS-2 and UCS-4 functions) --
def 𠀀(seconds):
    return burn(seconds)  # L:astral


def 计算(seconds):
    return 𠀀(seconds)  # L:cjk


class Wörker:
    def méthode(self, seconds):
        for _ in self.gen(seconds):  # L:method
            if stop.is_set():
                return

    def gen(self, seconds):
        while True:
            yield (lambda: 计算(seconds))()  # L:gen


def outer(seconds):
    def inner():
        Wörker().méthode(seconds)  # L:inner
    inner()  # L:outer


def case_nested():
    outer(CHUNK)  # L:case_nested


# -- async: a coroutine run by asyncio -----------------------------------------
async def child_coro(seconds):
    burn(seconds)  # L:child_coro


async def main_coro(seconds):
    while not stop.is_set():
        await child_coro(seconds)  # L:main_coro


def case_async():
    asyncio.run(main_coro(CHUNK))  # L:case_async


# -- init: class __init__ ----------------------------------------------------
class Klass:
    def __init__(self, seconds):
        burn(seconds)  # L:init


def case_init():
    i = 0
    while not stop.is_set():
        Klass(CHUNK if i >= WARMUP else 0.0)  # L:case_init
        i += 1


# -- lock: blocked in lock.acquire with the GIL released -------------------------
def wait_lock():
    while True:             # no Python call between the waits: every wait has this stack
        lock.acquire(timeout=0.2)  # L:acquire


def case_lock():
    wait_lock()  # L:case_lock


# -- recurse: deeper than MAX_PY_DEPTH ----------------------------------------
def recurse(n):
    if n == 0:
        while not stop.is_set():
            burn(CHUNK)  # L:recurse_leaf
        return
    recurse(n - 1)  # L:recurse


def case_recurse():
    recurse(DEPTH)  # L:case_recurse


# -- late: a thread started once the profiler records ---------------------------
def case_late():
    while not stop.is_set():
        burn(CHUNK)  # L:case_late


# -- subinterp: a sub-interpreter's own frames (3.12+, where a thread's gilstate
#    binding follows the thread state it switches to) ----------------------------
def subinterpreters():
    for name in ("_interpreters", "_xxsubinterpreters"):     # 3.13, 3.12
        try:
            return __import__(name)
        except ImportError:
            pass
    return None


def case_subinterp():
    mod = subinterpreters()
    interp = mod.create()
    here = os.path.dirname(os.path.abspath(__file__))
    mod.run_string(interp, "import sys; sys.path.insert(0, %r); import subinterp_case; "
                           "subinterp_case.sub_case(%r, %d)" % (here, DEADLINE, GO_PIPE[0]))
    mod.destroy(interp)     # before the main interpreter finalizes
    stop.wait()


CASES = [case_nested, case_async, case_init, case_lock, case_recurse]
if sys.version_info >= (3, 12) and subinterpreters() is not None:
    CASES.append(case_subinterp)


def native_id():
    get = getattr(threading, "get_native_id", None)      # 3.8+
    if get is not None:
        return get()
    import ctypes
    return ctypes.CDLL(None, use_errno=True).syscall(186)  # gettid, x86_64


def forever(case, started):
    def run():
        started.put((case.__name__[5:], native_id()))
        while not stop.is_set():
            case()
    return run


def main():
    global DEADLINE
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    DEADLINE = time.monotonic() + seconds
    sys.setrecursionlimit(DEPTH + 200)
    lock.acquire()                      # held by the main thread: wait_lock never gets it
    go_late = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *a: go_late.set())
    started = queue.Queue()
    threads = [threading.Thread(target=forever(c, started), name=c.__name__[5:], daemon=True)
               for c in CASES]
    for t in threads:
        t.start()
    for _ in threads:
        print("tid %s %d" % started.get(), flush=True)
    print("ready", flush=True)
    late = None
    while time.monotonic() < DEADLINE:
        if go_late.wait(0.05) and late is None:
            GO.append(True)
            os.write(GO_PIPE[1], b"g")
            late = threading.Thread(target=forever(case_late, started), name="late", daemon=True)
            late.start()
            print("tid %s %d" % started.get(), flush=True)
    STOP.append(True)
    stop.set()
    for t in threads:
        if t.name == "subinterp":
            t.join(5)


if __name__ == "__main__":
    main()
