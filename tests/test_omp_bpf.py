"""OpenMP waits, named (issue 23): an OpenMP thread that waits for work or
at a barrier is waiting, on the CPU (`[omp-spin]`) and off it (the reason
`omp`), in every runtime a Python process meets:

- GNU libgomp: Debian's libgomp1 (gcc -fopenmp), stripped, so its
  functions are named by their FDE's start (`libgomp.so.1.0.0@0x...`);
- LLVM libomp: Debian's libomp5-14 (stripped too);
- Intel libiomp5: the `intel-openmp` wheel from PyPI (with symbols).

workloads/omp_wait.c has a known split: thread 0 does all of each parallel
region's work (omp_work), thread 1 none, so thread 1 waits at the region's
barrier nearly all the time: spinning with OMP_WAIT_POLICY=active
(KMP_BLOCKTIME=infinite), asleep in futex with passive (KMP_BLOCKTIME=0).
The same binary is linked against each runtime (libomp and libiomp5 take
GCC's GOMP_* calls)."""
import collections
import glob
import os
import subprocess
import time

import pytest

from conftest import REQUIRE_BPF, WORKLOADS, cached_venv, python_or_skip, record_folded

INTEL_OPENMP = "intel-openmp==2026.2.0"
LLVM_LIBOMP = "/usr/lib/x86_64-linux-gnu/libomp.so.5"      # Debian's libomp5-14 (make test installs it)


def _missing(what):
    if REQUIRE_BPF:
        pytest.fail(f"{what} is missing (make test installs it)")
    pytest.skip(f"{what} is missing")


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    """omp_wait linked against each runtime: {runtime: path}."""
    d = tmp_path_factory.mktemp("omp")
    obj = str(d / "omp_wait.o")
    subprocess.run(["gcc", "-O2", "-g", "-fopenmp", "-c", os.path.join(WORKLOADS, "omp_wait.c"), "-o", obj],
                   check=True)
    out = {"gomp": str(d / "omp_gomp")}
    subprocess.run(["gcc", "-fopenmp", obj, "-o", out["gomp"]], check=True)
    if not os.path.exists(LLVM_LIBOMP):
        _missing(LLVM_LIBOMP)
    out["libomp"] = str(d / "omp_libomp")
    subprocess.run(["gcc", obj, "-o", out["libomp"], LLVM_LIBOMP], check=True)
    venv_python = cached_venv("intel-openmp", python_or_skip("pyenv-3.11"), [INTEL_OPENMP])
    found = glob.glob(os.path.join(os.path.dirname(os.path.dirname(venv_python)), "lib", "libiomp5.so"))
    if not found:
        _missing("libiomp5.so in the intel-openmp wheel")
    out["iomp5"] = str(d / "omp_iomp5")
    subprocess.run(["gcc", obj, "-o", out["iomp5"], found[0], "-Wl,-rpath," + os.path.dirname(found[0])],
                   check=True)
    return out


def split(prof, pid):
    """Per thread of pid, in order of tid: a Counter of on-CPU ns (`on`), in
    [omp-spin] (`spin`), in omp_work (`work`), in an unnamed frame
    (`unknown`), and off-CPU ns by reason (`off:REASON`)."""
    per = collections.defaultdict(collections.Counter)
    for k, ns in prof.weights.items():
        if k.pid != pid:
            continue
        c = per[k.tid]
        names = [f.name for f in k.frames]
        if k.off_cpu is None:
            c["on"] += ns
            c["spin"] += ns * ("[omp-spin]" in names)
            c["work"] += ns * ("omp_work" in names)
            c["unknown"] += ns * any(n.startswith("[unknown]") for n in names)
        else:
            c["off:" + k.off_cpu] += ns
    return [per[t] for t in sorted(per)]


@pytest.mark.parametrize("policy", ["active", "passive"])
@pytest.mark.parametrize("runtime", ["gomp", "libomp", "iomp5"])
def test_openmp_waits_are_waiting(tmp_path, bpf, binaries, runtime, policy):
    env = dict(os.environ, OMP_WAIT_POLICY=policy,
               KMP_BLOCKTIME="infinite" if policy == "active" else "0")
    w = subprocess.Popen([binaries[runtime], "60"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert w.stdout.readline().strip() == "ready"
        time.sleep(0.5)                 # its team is made
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "3", "-F", "499")
    finally:
        w.kill()
        w.wait()
    threads = split(prof, w.pid)
    assert len(threads) == 2, threads
    worker, waiter = threads
    print(f"\n{runtime} {policy}: worker {dict(worker)}\n  waiter {dict(waiter)}")
    # thread 0 works: its on-CPU time is omp_work, never a spin
    assert worker["work"] >= 0.90 * worker["on"] and worker["on"] > 0.5e9
    blocked = sum(ns for k, ns in waiter.items() if k.startswith("off:") and k != "off:runqueue")
    if policy == "active":
        # thread 1 spins at the barrier: its on-CPU time is waiting
        assert waiter["on"] > 0.2e9 and waiter["spin"] >= 0.95 * waiter["on"], waiter
    else:
        # thread 1 sleeps at the barrier: its blocked time is `omp`, not `lock`
        assert blocked > 2.0e9 and waiter["off:omp"] >= 0.95 * blocked, waiter
    for t in threads:
        assert t["unknown"] <= 0.01 * max(t["on"], 1), t
