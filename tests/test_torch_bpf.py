"""PyTorch as people run it (issue 23): torch 2.14.1 from PyPI (the default
CUDA wheel, on the CPU: ~90 executable files, 3.6 GB of them) under pyenv
3.11, in a venv kept across runs (venvs.py).  The workload
(workloads/torch_train.py) is a training loop fed by a DataLoader with two
worker processes, and a logger thread.

One run of the workload, three recordings of it:
- cold (an empty cache of its own): the recording starts while the tables
  are made, says how much time reached a library whose table was not ready,
  and has Python frames from its start;
- with every table in (--tables-first, before the recording starts): the
  main thread's on-CPU time under train() keeps a native chain with an ATen frame (>= 3 native frames under the innermost
  Python frame, one of them at::/torch::/c10::) in >= 90% of it; OpenMP's
  waiting threads are `[omp-spin]` on the CPU and `omp` off it, and nothing
  is `[unknown] libgomp` for >= 1% of the on-CPU time; each DataLoader
  worker has its `__getitem__` under its own process root;
- without --subprocesses: one line says the workers are not recorded.
"""
import glob
import os
import re
import subprocess
import time

import pytest

from conftest import (Workload, env, pyoffcpu_cmd, record_folded, run_pyoffcpu, source_line, torch_python,
                      wait_for_recording)
from pyoffcpu.export.pprof import from_pprof
from pyoffcpu.profile.model import from_folded

ATEN = re.compile(r"^(at|torch|c10)::|[ (<,]at::|^void at::")


@pytest.fixture(scope="module")
def training():
    w = Workload(torch_python(), "torch_train.py", 300, 2)
    yield w
    w.stop()


def is_python(frame):
    return frame.kind.value == "python"


def aten_share(prof, main_tid):
    """(share, seconds) of the main thread's on-CPU time under train() whose
    stack has >= 3 native frames below its innermost Python frame, one of
    them an ATen/torch/c10 function."""
    ok = total = 0
    for key, ns in prof.weights.items():
        if key.off_cpu is not None or key.tid != main_tid:
            continue
        if not any(is_python(f) and f.name == "train" for f in key.frames):
            continue
        total += ns
        last_py = max(i for i, f in enumerate(key.frames) if is_python(f))
        below = [f for f in key.frames[last_py + 1:] if f.kind.value == "native"]
        if len(below) >= 3 and any(ATEN.search(f.name) for f in below):
            ok += ns
    return ok / max(total, 1), total / 1e9


TORCH_LIB = re.compile(r"/torch/lib/lib(torch|c10)[^/]*$")


def torch_native_share(prof, main_tid):
    """(share, seconds) of the main thread's on-CPU time under train() that
    is in torch's native code (a frame of libtorch*/libc10*) whose stack has
    the ATen chain: what an unwinder that stops at MKL's kernels would lose,
    without the DataLoader's Python hand-over of batches in the count."""
    ok = total = 0
    for key, ns in prof.weights.items():
        if key.off_cpu is not None or key.tid != main_tid:
            continue
        if not any(is_python(f) and f.name == "train" for f in key.frames):
            continue
        if not any(f.module and TORCH_LIB.search(f.module) for f in key.frames):
            continue
        total += ns
        last_py = max(i for i, f in enumerate(key.frames) if is_python(f))
        below = [f for f in key.frames[last_py + 1:] if f.kind.value == "native"]
        if len(below) >= 3 and any(ATEN.search(f.name) for f in below):
            ok += ns
    return ok / max(total, 1), total / 1e9


def on_cpu(prof, test):
    return sum(ns for k, ns in prof.weights.items() if k.off_cpu is None and test(k))


def helpers_done(cache, timeout=300):
    """Wait for the table helpers a recording left to finish their tables
    (they write CACHE/unwind/KEY.tbl.PID.tmp, then rename it): they would
    take the CPU from the tests after this one."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and glob.glob(os.path.join(cache, "unwind", "*.tmp")):
        time.sleep(0.2)


def test_torch_cold_start_records_while_the_tables_are_made(tmp_path, bpf, training):
    cache = tmp_path / "cache"
    out = tmp_path / "out.folded"
    proc = subprocess.Popen(pyoffcpu_cmd("-o", str(out), "-p", str(training.pid), "--subprocesses",
                                         "-d", "6"),
                            env=dict(env(), PYOFFCPU_CACHE_DIR=str(cache), PYOFFCPU_TABLES_FIRST="0"),
                            stderr=subprocess.PIPE, text=True)
    try:
        # an empty cache: bcc compiles the BPF C first (seconds, the machine's
        # speed), then the recording starts: what follows is timed
        wait_for_recording(proc, timeout=300)
        t0 = time.monotonic()
        stderr = proc.stderr.read()
        assert proc.wait(timeout=600) == 0, stderr
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    res = subprocess.CompletedProcess(proc.args, 0, "", stderr)
    prof = from_folded(out.read_text())
    helpers_done(str(cache))
    not_ready = re.search(r"native table not ready: ([\d.]+) s", res.stderr)
    print("\n" + "\n".join(ln for ln in res.stderr.splitlines() if "not ready" in ln or "recorded" in ln))
    # the tables of torch's libraries take seconds to make: some stacks reached them first
    assert not_ready and float(not_ready.group(1)) > 0, res.stderr
    assert any(f.name == "[native table not ready]" for k in prof.weights for f in k.frames[:1])
    # ... and the recording did not wait for them: train()'s frames are there
    assert on_cpu(prof, lambda k: any(is_python(f) and f.name == "train" for f in k.frames)) > 0.5e9
    assert "not a Python process" not in res.stderr
    # 6 s of recording, then the profile: its end did not wait for the ~90 tables
    # either (its start did not: stacks met tables not ready, above)
    assert took < 6 + 8, took


def test_torch_warm_native_chains_omp_and_workers(tmp_path, bpf, training):
    # --tables-first (conftest.env): every table is in before the recording
    # starts; pprof, which keeps each native frame's file (folded text has names only)
    out = tmp_path / "out.pb.gz"
    res = run_pyoffcpu("-o", str(out), "-p", str(training.pid), "--subprocesses", "-d", "8",
                       env_extra={"PYOFFCPU_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "native table not ready" not in res.stderr, res.stderr
    prof = from_pprof(out.read_bytes())
    share, seconds = aten_share(prof, training.pid)
    in_torch, torch_s = torch_native_share(prof, training.pid)
    total_on = on_cpu(prof, lambda k: True)
    spin = on_cpu(prof, lambda k: any(f.name == "[omp-spin]" for f in k.frames))
    unknown_gomp = on_cpu(prof, lambda k: any(f.name.startswith("[unknown] libgomp") for f in k.frames))
    omp_wait = sum(ns for k, ns in prof.weights.items() if k.off_cpu == "omp")
    getitem = source_line("torch_train.py", "def __getitem__")
    workers = {k.pid for k in prof.weights
               if k.pid != training.pid and any(is_python(f) and f.name == "Samples.__getitem__"
                                                for f in k.frames)}
    print(f"\ntorch: ATen chain {share:.3f} of {seconds:.2f} s on-CPU under train() ({in_torch:.3f} of "
          f"the {torch_s:.2f} s in torch's native code); [omp-spin] "
          f"{spin / 1e9:.2f} s, [unknown] libgomp {unknown_gomp / max(total_on, 1):.4f} of "
          f"{total_on / 1e9:.2f} s on-CPU; omp waits {omp_wait / 1e9:.2f} s; workers with __getitem__ "
          f"{sorted(workers)}")
    assert seconds > 1.0 and share >= 0.90, (share, seconds)
    assert torch_s > 1.0 and in_torch >= 0.97, (in_torch, torch_s)
    assert spin > 0, "no [omp-spin]"
    assert omp_wait > 0, "no off-CPU time with the reason omp"
    assert unknown_gomp <= 0.01 * total_on, unknown_gomp / total_on
    children = [int(p) for p in open(f"/proc/{training.pid}/task/{training.pid}/children").read().split()]
    assert len(workers) == 2 and workers <= set(children), (workers, children, getitem)


def test_torch_without_subprocesses_names_the_workers_it_leaves_out(tmp_path, bpf, training):
    res, prof = record_folded(tmp_path, "-p", str(training.pid), "-d", "1", timeout=600)
    line = re.search(r"process (\d+) has started (\d+) Python process(es)? .*--subprocesses", res.stderr)
    assert line and int(line.group(1)) == training.pid and int(line.group(2)) >= 2, res.stderr
    assert {k.pid for k in prof.weights} == {training.pid}
