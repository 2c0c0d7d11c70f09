"""Deep stacks for tools/bpf_cost.py: PY_DEPTH Python frames calling
native_chain.deep(), NATIVE_DEPTH C frames, then spinning or sleeping.

    python deep_stacks.py EXTENSION.so spin|sleep|idle SECONDS [PY_DEPTH] [NATIVE_DEPTH]

sleep: 1 ms nanosleeps (a switch-out and a switch-in each); idle: one long
sleep in Python (a target that never runs).  Prints "ready" first."""
import importlib.machinery
import importlib.util
import sys
import time


def load(path):
    loader = importlib.machinery.ExtensionFileLoader("native_chain", path)
    spec = importlib.util.spec_from_file_location("native_chain", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def recurse(n, fn):
    if n <= 1:
        return fn()
    return recurse(n - 1, fn) + 0


def main():
    path, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    py_depth = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    native_depth = int(sys.argv[5]) if len(sys.argv) > 5 else 30
    nc = load(path)
    print("ready", flush=True)
    if mode == "idle":
        time.sleep(seconds)
        return
    sleep_us = 1000 if mode == "sleep" else 0
    # recurse() frames, the lambda, main and <module>: py_depth Python frames in all
    recurse(py_depth - 3, lambda: nc.deep(native_depth, seconds, sleep_us))


if __name__ == "__main__":
    main()
