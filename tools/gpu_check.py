#!/usr/bin/env python3
"""The real check of pyoffcpu's GPU waits, on a machine with an NVIDIA GPU
(the tests use a stand-in: tests/workloads/fake_cuda.c).

    sudo .venv/bin/python tools/gpu_check.py [--seconds 4]

Runs, under `pyoffcpu --mode wall`, a Python process that drives the GPU
through ctypes on libcuda.so.1 (no CUDA toolkit needed: the kernel is PTX,
compiled by the driver):

  spin    a context with the default scheduling: a kernel that spins on the
          GPU for 50 ms, then cuCtxSynchronize, which spins on the CPU
          -> its on-CPU time should end in [gpu-spin]
  block   a context made with CU_CTX_SCHED_BLOCKING_SYNC: the same kernel,
          then cuCtxSynchronize, which sleeps in the driver until the GPU's
          interrupt -> its off-CPU time should be [off-cpu: gpu]

and prints each share. Exit status 0 when both are at least 80%, 1 when
not, 2 when there is no usable GPU or driver here.
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time

PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 cycles)
{
    .reg .u64 %t0, %t1, %n, %d;
    .reg .pred %p;
    ld.param.u64 %n, [cycles];
    mov.u64 %t0, %clock64;
LOOP:
    mov.u64 %t1, %clock64;
    sub.u64 %d, %t1, %t0;
    setp.lt.u64 %p, %d, %n;
    @%p bra LOOP;
    ret;
}
"""
CU_CTX_SCHED_BLOCKING_SYNC = 0x4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def gpu_loop(cuda, flags, seconds, name, started):
    """One thread, one context: launch a 50 ms kernel and synchronize, until
    `seconds` have passed."""
    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuCtxCreate_v2(ctypes.byref(ctx), flags, dev), "cuCtxCreate")
    check(cuda.cuModuleLoadData(ctypes.byref(mod), PTX), "cuModuleLoadData")
    check(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    rate = ctypes.c_int()
    check(cuda.cuDeviceGetAttribute(ctypes.byref(rate), 13, dev), "clock rate")  # kHz
    cycles = ctypes.c_uint64(rate.value * 50)           # 50 ms of the GPU's clock
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(cycles), ctypes.c_void_p))
    started.append((name, threading.get_native_id()))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        check(cuda.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None), "cuLaunchKernel")
        check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")


def workload(seconds):
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    started = []
    threads = [threading.Thread(target=gpu_loop, args=(cuda, f, seconds + 5, n, started), name=n)
               for n, f in (("spin", 0), ("block", CU_CTX_SCHED_BLOCKING_SYNC))]
    for t in threads:
        t.start()
    while len(started) < 2:
        time.sleep(0.01)
    for name, tid in started:
        print("tid", name, tid, flush=True)
    print("ready", flush=True)
    for t in threads:
        t.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.workload:
        workload(a.seconds)
        return 0
    try:
        ctypes.CDLL("libcuda.so.1").cuInit(0)
    except OSError as e:
        print(f"gpu_check: no NVIDIA driver here ({e})", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(ROOT, "pytool"))
    from pyoffcpu.profile.model import from_folded
    w = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--workload",
                          "--seconds", str(a.seconds)], stdout=subprocess.PIPE, text=True)
    tids = {}
    for line in w.stdout:
        if line.startswith("tid "):
            tids[line.split()[1]] = int(line.split()[2])
        if line.strip() == "ready":
            break
    if len(tids) != 2:
        print("gpu_check: the GPU workload did not start", file=sys.stderr)
        w.kill()
        return 2
    out = os.path.join(tempfile.mkdtemp(), "gpu.folded")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "pytool"))
    subprocess.run([sys.executable, "-m", "pyoffcpu", "-p", str(w.pid), "-d", str(a.seconds),
                    "-o", out], env=env, check=True)
    w.kill()
    w.wait()
    prof = from_folded(open(out).read())
    spin_on = prof.total_ns(tid=tids["spin"], on_cpu=True)
    spinning = sum(ns for k, ns in prof.weights.items() if k.tid == tids["spin"]
                   and k.off_cpu is None and k.frames and k.frames[-1].name == "[gpu-spin]")
    block_off = prof.total_ns(tid=tids["block"], on_cpu=False)
    gpu = sum(ns for k, ns in prof.weights.items() if k.tid == tids["block"] and k.off_cpu == "gpu")
    s1, s2 = spinning / max(spin_on, 1), gpu / max(block_off, 1)
    print(f"spin:  {spin_on / 1e9:.2f} s on-CPU, {100 * s1:.1f}% of it [gpu-spin]")
    print(f"block: {block_off / 1e9:.2f} s off-CPU, {100 * s2:.1f}% of it [off-cpu: gpu]")
    print(f"folded: {out}")
    return 0 if s1 >= 0.8 and s2 >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
