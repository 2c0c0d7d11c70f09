"""A thread-per-request HTTP server and its load, in one process.

    python thread_server.py SECONDS [DELAY]

An http.server.ThreadingHTTPServer on 127.0.0.1 (a new thread per request,
HTTP/1.0) and 4 client threads sending it requests as fast as it answers;
beside them, a thread started every 10 ms that sleeps 2 ms, spins 1 ms and
ends (a second entry function: a second group of ended threads).  Prints
`ready`, waits DELAY seconds (default 0; a thread that ends at once is
started halfway, at most a second in), then runs for SECONDS.  The clients
and the ticker start before the wait; the threads that end are all born
after it.
"""
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY = b"ok\n" * 16


def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        spin(0.0003)
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format, *args):      # noqa: A002
        pass


def short_job():
    time.sleep(0.002)
    spin(0.001)


def main():
    seconds = float(sys.argv[1])
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 128
    port = server.server_address[1]
    go = threading.Event()
    stop = threading.Event()

    def client():
        go.wait()
        request = b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"
        while not stop.is_set():
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request)
                while s.recv(4096):
                    pass

    def ticker():
        go.wait()
        while not stop.is_set():
            threading.Thread(target=short_job, daemon=True).start()
            time.sleep(0.01)

    threading.Thread(target=server.serve_forever, daemon=True).start()
    helpers = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    helpers.append(threading.Thread(target=ticker, daemon=True))
    for t in helpers:
        t.start()
    print("ready", flush=True)
    # one thread that ends at once, a second in (after a recording started
    # at `ready` has begun): the sign pyoffcpu waits for to load its fold of
    # ended threads in the kernel, ready before the load comes
    time.sleep(min(1.0, delay / 2))
    threading.Thread(target=lambda: None).start()
    time.sleep(delay - min(1.0, delay / 2))
    go.set()
    time.sleep(seconds)
    stop.set()
    time.sleep(0.2)


main()
