"""Bench cases 9 and 10: a server that starts a thread per request, and its load.

    python threadserver.py server
        http.server.ThreadingHTTPServer on 127.0.0.1, an ephemeral port: every
        request is a new connection (HTTP/1.0, no keep-alive) and a new thread.
        Prints `ready PORT`, then reads commands, one a line, from stdin:
            stats   prints `stats JSON` (served: requests answered so far,
                    t: seconds since the server started, switches: its
                    threads' context switches so far, the ended ones' too)
            exit    (or end of stdin) stops serving and leaves

    python threadserver.py client PORT [--rate R] [--seconds S] [--threads T]
        T threads (default 8) keep about R requests/s (default 2000) going to
        127.0.0.1:PORT, one new connection per request, until S seconds
        (default 120) have passed, R * S requests have been made, or SIGINT.
        --rate 0: no schedule, every thread sends its next request as soon as
        its last one is answered (as fast as the server goes; bench case 10).
        Only ever connects to 127.0.0.1. Prints `done JSON` at the end
        (ok, errors, seconds, rate, behind: times a thread fell a second
        behind its schedule and skipped ahead).

Plain CPython 3.7+, nothing imported beyond the standard library.
"""
import argparse
import itertools
import json
import resource
import signal
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOST = "127.0.0.1"          # loopback only, server and client alike
BODY = b"ok\n" * 16
REQUEST = b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\nUser-Agent: pyoffcpu-bench\r\n\r\n"


# -- server --------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"       # the connection closes after each response
    served = itertools.count(1)         # next() is atomic under the GIL
    last = [0]

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
        Handler.last[0] = next(Handler.served)

    def log_message(self, format, *args):     # noqa: A002 - the base class's name
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True           # nothing keeps a list of the request threads
    request_queue_size = 256        # the default 5 overflows at thousands of connections a second


def serve():
    threading.current_thread().name = "main"
    httpd = Server((HOST, 0), Handler)
    t0 = time.monotonic()
    print(f"ready {httpd.server_address[1]}", flush=True)

    def control():
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "stats":
                ru = resource.getrusage(resource.RUSAGE_SELF)    # every thread's, the ended ones' too
                print("stats " + json.dumps({"served": Handler.last[0], "t": round(time.monotonic() - t0, 3),
                                             "switches": ru.ru_nvcsw + ru.ru_nivcsw}),
                      flush=True)
            elif cmd == "exit":
                break
        httpd.shutdown()
    threading.Thread(target=control, name="control", daemon=True).start()
    httpd.serve_forever(poll_interval=0.5)
    httpd.server_close()


# -- client -----------------------------------------------------------------------------
def one_request(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(10)
        s.connect((HOST, port))
        s.sendall(REQUEST)
        first = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            if not first:
                first = b
        # The server closed first; a reset instead of a FIN from this side
        # leaves no TIME_WAIT on either side: a long run at thousands of
        # connections a second would otherwise fill the ephemeral port range.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return first.startswith(b"HTTP/1.0 200")
    finally:
        s.close()


def load(port: int, rate: float, seconds: float, threads: int) -> dict:
    if not 0 < port < 65536:
        raise SystemExit(f"client: bad port {port}")
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"ok": 0, "errors": 0, "behind": 0}
    errors = {}
    budget = itertools.count()
    paced = rate > 0                    # rate 0: as fast as the answers come
    limit = int(rate * seconds) if paced else None
    per_thread = rate / threads
    t0 = time.monotonic()
    end = t0 + seconds

    def worker(j: int):
        nxt = t0 + j / rate if paced else 0.0     # the threads' schedules interleave
        ok = err = behind = 0
        while not stop.is_set():
            now = time.monotonic()
            if now >= end or (paced and next(budget) >= limit):
                break
            if paced:
                if nxt > now:
                    if stop.wait(nxt - now):
                        break
                elif now - nxt > 1.0:   # a second behind: skip ahead, no burst
                    nxt = now
                    behind += 1
                nxt += 1.0 / per_thread
            try:
                if one_request(port):
                    ok += 1
                else:
                    err += 1
            except OSError as e:
                err += 1
                with lock:
                    k = type(e).__name__
                    errors[k] = errors.get(k, 0) + 1
                if isinstance(e, ConnectionRefusedError):
                    stop.wait(0.1)      # the server has gone: do not spin
        with lock:
            counts["ok"] += ok
            counts["errors"] += err
            counts["behind"] += behind

    ts = [threading.Thread(target=worker, args=(j,), name=f"client-{j}", daemon=True) for j in range(threads)]
    for t in ts:
        t.start()
    try:
        while any(t.is_alive() for t in ts):
            for t in ts:
                t.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        for t in ts:
            t.join(15)
    dt = time.monotonic() - t0
    return {**counts, "error_kinds": errors, "seconds": round(dt, 3),
            "rate": round(counts["ok"] / dt, 1) if dt > 0 else 0.0}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    sub.add_parser("server")
    c = sub.add_parser("client")
    c.add_argument("port", type=int)
    c.add_argument("--rate", type=float, default=2000.0)
    c.add_argument("--seconds", type=float, default=120.0)
    c.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    if a.role == "server":
        serve()
    else:
        signal.signal(signal.SIGTERM, _interrupt)
        if a.rate < 0 or a.seconds <= 0 or a.threads < 1:
            raise SystemExit("client: --seconds and --threads must be positive, --rate positive or 0")
        print("done " + json.dumps(load(a.port, a.rate, a.seconds, a.threads)), flush=True)


if __name__ == "__main__":
    main()
