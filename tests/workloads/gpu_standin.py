"""Two threads in the libcuda stand-in (fake_cuda.c, path in argv[1]):
`spinner` in cuCtxSynchronize (spins 50 ms a call) and `blocker` in
cuEventSynchronize on a FIFO that the main thread fills every 50 ms.
Prints `tid NAME NATIVE_ID`, then `ready`; runs argv[2] seconds."""
import ctypes
import os
import sys
import tempfile
import threading
import time

lib = ctypes.CDLL(sys.argv[1])
END = time.monotonic() + float(sys.argv[2])
fifo = os.path.join(tempfile.mkdtemp(), "nvidia0")
os.mkfifo(fifo)
rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
wfd = os.open(fifo, os.O_WRONLY)
os.set_blocking(rfd, True)
started = []


def spinner():
    started.append(("spinner", threading.get_native_id()))
    while time.monotonic() < END:
        lib.cuCtxSynchronize(50)        # SPIN


def blocker():
    started.append(("blocker", threading.get_native_id()))
    while time.monotonic() < END:
        lib.cuEventSynchronize(rfd)     # BLOCK


for fn in (spinner, blocker):
    threading.Thread(target=fn, name=fn.__name__, daemon=True).start()
while len(started) < 2:
    time.sleep(0.01)
for name, tid in started:
    print("tid", name, tid, flush=True)
print("ready", flush=True)
while time.monotonic() < END:
    time.sleep(0.05)
    os.write(wfd, b"x")
