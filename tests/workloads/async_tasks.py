"""asyncio tasks whose time split is built in and measured by their own clock.

One loop, started by asyncio.run(main()), with these tasks (each named):
- cpu:     compute_chunk() for ~CHUNK s of CPU, then `await asyncio.sleep(0)`
           (yields to the loop: it is ready, not waiting);
- ticker:  `await asyncio.sleep(TICK)` in a loop (a sleep);
- consumer: `await queue.get()` on an asyncio.Queue fed from a thread
           every FEED s through call_soon_threadsafe (a queue);
- client:  writes a line to a local TCP server (a thread) that answers
           after REPLY s, `await reader.readline()` (a socket read);
- deadlock mode (argv[1] == "deadlock"): two tasks, each awaiting the other
  (through futures holding the other task), plus a waiter on both.

Each task keeps its time per state (running, awaiting) with
time.monotonic() at each change, and prints at the end (or on SIGTERM / at
--seconds) one line:
  split NAME running=S awaiting=S total=S
where `awaiting` is from the await's start to the task's resumption (it
includes the time ready but queued behind other tasks).  SIGUSR1 marks a
moment (each task's times so far, the state it is in counted up to the
mark); after two marks a second line per task gives the time between them:
  window NAME running=S awaiting=S total=S
so that a recording of part of the run is compared with its own part (a
task's share over the whole run is not its share in every few seconds of
it: the loop's other work is not spread evenly).  "ready" says when the
process is set up.
"""
import asyncio
import os
import signal
import socket
import sys
import threading
import time

CHUNK = 0.006
TICK = 0.05
FEED = 0.03
REPLY = 0.04


def compute_chunk(seconds):
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    return x


class Split:
    """A task's time per state, added up at each change of state."""

    def __init__(self, name):
        self.name = name
        self.times = {"running": 0.0, "awaiting": 0.0}
        self.state = "running"
        self.since = self.start = time.monotonic()

    def enter(self, state):
        now = time.monotonic()
        self.times[self.state] += now - self.since
        self.state, self.since = state, now

    def snapshot(self, now):
        """(running, awaiting, total) up to now, the current state included."""
        t = dict(self.times)
        t[self.state] += now - self.since
        return t["running"], t["awaiting"], now - self.start

    def line(self):
        return split_line("split", self.name, self.snapshot(time.monotonic()))


def split_line(kind, name, times):
    return "%s %s running=%.6f awaiting=%.6f total=%.6f" % ((kind, name) + tuple(times))


SPLITS = []
MARKS = []      # [(monotonic time, {name: snapshot})] at each SIGUSR1


def mark():
    now = time.monotonic()
    MARKS.append((now, {s.name: s.snapshot(now) for s in SPLITS}))


def track(name):
    s = Split(name)
    SPLITS.append(s)
    return s


async def cpu_task(stop):
    s = track("cpu")
    while not stop.is_set():
        s.enter("running")
        compute_chunk(CHUNK)
        s.enter("awaiting")
        await asyncio.sleep(0)
    s.enter("running")


async def ticker(stop):
    s = track("ticker")
    while not stop.is_set():
        s.enter("awaiting")
        await asyncio.sleep(TICK)
        s.enter("running")


async def consumer(queue, stop):
    s = track("consumer")
    while not stop.is_set():
        s.enter("awaiting")
        await queue.get()
        s.enter("running")


def feeder(loop, queue, stop_thread):
    while not stop_thread.is_set():
        time.sleep(FEED)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, 1)
        except RuntimeError:
            return


def slow_server(sock, stop_thread):
    sock.settimeout(0.2)
    while not stop_thread.is_set():
        try:
            conn, _ = sock.accept()
        except OSError:
            continue
        with conn:
            f = conn.makefile("rwb")
            while not stop_thread.is_set():
                line = f.readline()
                if not line:
                    break
                time.sleep(REPLY)
                f.write(line)
                f.flush()


async def client(port, stop):
    s = track("client")
    s.enter("awaiting")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    s.enter("running")
    while not stop.is_set():
        writer.write(b"ping\n")
        s.enter("awaiting")
        await reader.readline()
        s.enter("running")
    writer.close()


async def main_split(seconds):
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_thread = threading.Event()
    queue = asyncio.Queue()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    threads = [threading.Thread(target=feeder, args=(loop, queue, stop_thread), daemon=True),
               threading.Thread(target=slow_server, args=(srv, stop_thread), daemon=True)]
    for t in threads:
        t.start()
    tasks = [asyncio.create_task(cpu_task(stop), name="cpu"),
             asyncio.create_task(ticker(stop), name="ticker"),
             asyncio.create_task(consumer(queue, stop), name="consumer"),
             asyncio.create_task(client(port, stop), name="client")]
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, mark)
    print("ready", flush=True)
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        stop.set()
    stop_thread.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in SPLITS:
        print(s.line(), flush=True)
    if len(MARKS) >= 2:
        first, second = MARKS[0][1], MARKS[1][1]
        for s in SPLITS:
            print(split_line("window", s.name, (b - a for a, b in zip(first[s.name], second[s.name]))),
                  flush=True)


async def waits_on(other_fut):
    other = await other_fut             # the other task, once both exist
    await other                         # each waits here for the other


async def main_deadlock(seconds):
    fa = asyncio.get_running_loop().create_future()
    fb = asyncio.get_running_loop().create_future()
    a = asyncio.create_task(waits_on(fa), name="alpha")
    b = asyncio.create_task(waits_on(fb), name="beta")
    fa.set_result(b)
    fb.set_result(a)
    await asyncio.sleep(0.05)
    print("ready", flush=True)
    await asyncio.sleep(seconds)
    os._exit(0)                         # the pair cannot even be cancelled cleanly


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "split"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 3600.0
    if mode == "deadlock":
        asyncio.run(main_deadlock(seconds))
    else:
        asyncio.run(main_split(seconds))
