"""Workload for the native unwinder tests (tests/test_unwind_bpf.py).

    python native_chain.py EXTENSION.so SECONDS [--late]

The main thread alternates, 100 ms each, between
  spin_case():      native_chain.spin()      -> nc_outer -> nc_middle -> nc_inner
  callback_case():  native_chain.call_chain() -> cb_outer -> cb_middle -> cb_inner
                    -> py_callback() spinning in Python
and a C thread (no Python state) runs th_outer -> th_middle -> th_inner, half
spinning, half in nanosleep.  Prints "cthread TID", then "ready".
With --late the extension is only loaded (dlopen) after SIGUSR1 (it prints
"loaded" then); until then the main thread spins in Python.
"""
import importlib.machinery
import importlib.util
import signal
import sys
import threading
import time


def load(path):
    loader = importlib.machinery.ExtensionFileLoader("native_chain", path)
    spec = importlib.util.spec_from_file_location("native_chain", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def py_callback():
    end = time.perf_counter() + 0.010
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def spin_case(nc):
    nc.spin(0.100)


def callback_case(nc):
    nc.call_chain(py_callback, 10)


def python_spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main():
    path, duration = sys.argv[1], float(sys.argv[2])
    late = "--late" in sys.argv
    go = threading.Event()
    if late:
        signal.signal(signal.SIGUSR1, lambda *a: go.set())
        print("ready", flush=True)
        while not go.is_set():
            python_spin(0.01)
    nc = load(path)
    tid = nc.start_thread()
    print(f"cthread {tid}", flush=True)
    print("loaded" if late else "ready", flush=True)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        spin_case(nc)
        callback_case(nc)


if __name__ == "__main__":
    main()
