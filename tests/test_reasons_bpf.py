"""Off-CPU reasons with real BPF: threads that each wait in one known way
(workloads/waits.py, gil_contention.py, two processes pinned to one CPU)
show that reason for (almost) all of their off-CPU time, on pyenv 3.9,
3.11, 3.13 and Debian's 3.11."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import Workload, python_or_skip, record_folded
from pyoffcpu.profile.model import from_folded

LABELS = ["pyenv-3.9", "pyenv-3.11", "pyenv-3.13", "debian-3.11"]
SHARE = 0.95


def by_reason(prof, tid):
    out = {}
    for k, ns in prof.weights.items():
        if k.tid == tid and k.off_cpu is not None:
            out[k.off_cpu] = out.get(k.off_cpu, 0) + ns
    return out


def dominant(prof, tid, reason, share=SHARE):
    got = by_reason(prof, tid)
    total = sum(got.values())
    assert total > 0.5e9, (tid, got)
    assert got.get(reason, 0) >= share * total, (reason, {r: round(v / 1e9, 3) for r, v in got.items()})


@pytest.mark.parametrize("label", LABELS)
def test_each_kind_of_wait_has_its_reason(tmp_path, bpf, label):
    python = python_or_skip(label)
    w = Workload(python, "waits.py", 60)
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "2")
    finally:
        w.stop()
    for name, reason in (("sleeper", "sleep"), ("reader", "io"), ("selector", "poll"),
                         ("locked", "lock"), ("writer", "sleep"), ("holder", "sleep")):
        dominant(prof, tids[name], reason)
    # every off-CPU stack ends in its reason's marker
    assert all(k.off_cpu in ("sleep", "io", "poll", "lock", "runqueue", "other", "gil")
               for k in prof.weights if k.off_cpu is not None), {k.off_cpu for k in prof.weights}


@pytest.mark.parametrize("label", LABELS)
def test_two_cpu_bound_threads_wait_for_the_gil(tmp_path, bpf, label):
    python = python_or_skip(label)
    w = Workload(python, "gil_contention.py", 60)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "2")
    finally:
        w.stop()
    spinners = {k.tid for k in prof.weights if k.tid != w.pid}
    assert len(spinners) == 2, spinners
    for tid in spinners:
        got = by_reason(prof, tid)
        # of the waits that are not for a CPU (runqueue: how busy the machine
        # is, up to half of it on this loaded 2-core one) the GIL is all
        blocked = {r: ns for r, ns in got.items() if r != "runqueue"}
        assert blocked.get("gil", 0) >= SHARE * sum(blocked.values()), got
        on = prof.total_ns(tid=tid, on_cpu=True)
        # each runs and waits for the GIL a good part of the 2 s
        assert got["gil"] >= 0.3e9 and on >= 0.3e9, (on, got)
        # and its time adds up: on-CPU + every reason = the recording's
        # length, which the main thread (in join all along) spans
        wall = prof.total_ns(tid=w.pid)
        assert abs(on + sum(got.values()) - wall) <= 0.01 * wall, (on, got, wall)


def test_processes_pinned_to_one_cpu_wait_in_the_runqueue(tmp_path, bpf):
    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", spin]) for _ in range(2)]
    try:
        res, prof = record_folded(tmp_path, *sum((["-p", str(p.pid)] for p in procs), []),
                                  "-d", "2")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p in procs:
        dominant(prof, p.pid, "runqueue")


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory):
    """workloads/fake_cuda.c as libcuda.so.1 (the stand-in for NVIDIA's driver)."""
    from conftest import WORKLOADS
    out = tmp_path_factory.mktemp("cuda") / "libcuda.so.1"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(out),
                    os.path.join(WORKLOADS, "fake_cuda.c")], check=True)
    return str(out)


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_the_gpu_stand_in_shows_gpu_waits_and_gpu_spin(tmp_path, bpf, label, fake_cuda):
    """A blocking sync (poll on the device under libcuda) is `gpu` off-CPU
    time; a spinning sync (cuCtxSynchronize on the CPU) ends in [gpu-spin]."""
    python = python_or_skip(label)
    w = Workload(python, "gpu_standin.py", fake_cuda, 60)
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "2")
    finally:
        w.stop()
    dominant(prof, tids["blocker"], "gpu")
    spin = tids["spinner"]
    on = prof.total_ns(tid=spin, on_cpu=True)
    spinning = sum(ns for k, ns in prof.weights.items() if k.tid == spin and k.off_cpu is None
                   and k.frames and k.frames[-1].name == "[gpu-spin]")
    assert on > 0.5e9 and spinning >= 0.9 * on, (spinning, on)
    # and the frames under it are the stand-in's, below the Python caller
    names = [f.name for k in prof.weights if k.tid == spin and k.off_cpu is None
             and k.frames[-1].name == "[gpu-spin]" for f in k.frames]
    assert "cuCtxSynchronize" in names and "spinner" in names, set(names)


def test_reasons_keeps_only_those_waits(tmp_path, bpf):
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "waits.py", 60)
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        # --off-cpu exact: the sleeper's few short waits for the GIL (futex)
        # are `gil` by their frames; sampled, those not sampled would be `lock`
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "1", "--mode", "off",
                                  "--reasons", "lock,io", "--off-cpu", "exact")
    finally:
        w.stop()
    assert {k.off_cpu for k in prof.weights} == {"lock", "io"}, {k.off_cpu for k in prof.weights}
    assert prof.total_ns(tid=tids["locked"]) > 0.8e9 and prof.total_ns(tid=tids["reader"]) > 0.8e9
    assert prof.total_ns(tid=tids["sleeper"]) == 0


def test_min_and_max_block_leave_out_whole_waits_and_say_how_much(tmp_path, bpf):
    """waits.py: the sleeper waits 50 ms at a time, the holder 40 ms (in the
    lock) and 10 ms (outside it).  --max-block-us 20000 leaves out the
    sleeper's waits; --min-block-us 30000 the holder's 10 ms ones only."""
    import re
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "waits.py", 60)
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        short, p_short = record_folded(tmp_path, "-p", str(w.pid), "-d", "1", "--mode", "off",
                                       "--max-block-us", "20000", name="short.folded")
        long_, p_long = record_folded(tmp_path, "-p", str(w.pid), "-d", "1", "--mode", "off",
                                      "--min-block-us", "30000", name="long.folded")
    finally:
        w.stop()
    # only the parts of a 50 ms wait cut by the start or the end are <= 20 ms
    assert p_short.total_ns(tid=tids["sleeper"]) <= 0.045e9, p_short.total_ns(tid=tids["sleeper"])
    m = re.search(r"(\d+) waits \(([\d.]+) s\) outside --min-block-us/--max-block-us left out",
                  short.stderr)
    assert m and int(m.group(1)) >= 15 and float(m.group(2)) >= 0.9, short.stderr
    assert p_long.total_ns(tid=tids["sleeper"]) >= 0.9e9
    holder = p_long.total_ns(tid=tids["holder"])
    assert 0.65e9 <= holder <= 0.9e9, holder      # its 40 ms of every 50


@pytest.mark.parametrize("label", LABELS)
def test_wakers_name_who_ended_each_wait(tmp_path, bpf, label):
    """--wakers on waits.py: the pipe reader is woken by the writer at its
    write, the lock contender by the owner at its release, the sleeper and
    the select loop by timers."""
    from conftest import source_line
    from conftest import env, pyoffcpu_cmd, wait_for_recording
    python = python_or_skip(label)
    w = Workload(python, "waits.py", 60)
    out = tmp_path / "out.folded"
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        p = subprocess.Popen(pyoffcpu_cmd("-p", str(w.pid), "--wakers", "-o", str(out)), env=env(),
                             stderr=subprocess.PIPE, text=True)
        wait_for_recording(p)
        # the contender's own clock of its lock waits, over the same 2 s
        os.kill(w.pid, signal.SIGUSR2)
        w.proc.stdout.readline()
        time.sleep(2)
        os.kill(w.pid, signal.SIGUSR2)
        p.send_signal(signal.SIGINT)
        marked = w.proc.stdout.readline().split()
        contended, window = int(marked[1]), int(marked[2])
        longest = {k: int(v) for k, v in (kv.split("=") for kv in marked[4:])}
        stderr = p.communicate(timeout=60)[1]
        assert p.returncode == 0, stderr
        res = subprocess.CompletedProcess(p.args, 0, "", stderr)
        prof = from_folded(out.read_text())
    finally:
        w.stop()
    lines = {int(m.group(1)): m for m in re.finditer(
        r"thread (\d+) \S+: ([\d.]+) s in (.+?), woken (\d+)% by (.+)$", res.stderr, re.M)}
    write = source_line("waits.py", "os.write(data_w")
    release = source_line("waits.py", "# RELEASE")

    def check(name, share, by):
        m = lines.get(tids[name])
        assert m and int(m.group(4)) >= share and re.fullmatch(by, m.group(5)), (
            name, m and m.group(0), res.stderr)
    check("reader", 95, rf"thread {tids['writer']} \S+ in writer \(\S*waits\.py:{write}\)")
    check("contender", 95, rf"thread {tids['owner']} \S+ in owner \(\S*waits\.py:{release}\)")
    check("sleeper", 95, "a timer")
    check("selector", 95, "a timer")
    drops = re.findall(r"^pyoffcpu: drops: .*$", res.stderr, re.M)
    lost = re.search(r"wait stack not taken \d+ \(([\d.]+) ms\)", res.stderr)
    not_taken = float(lost.group(1)) * 1e6 if lost else 0.0
    # the folded chains (offwaketime's): the wait, `--`, the waker's stack
    # leaf first, each frame `_[w]`; the same answers, stack for stack
    def chained(name, reason, test):
        waits = [(k, ns) for k, ns in prof.weights.items()
                 if k.tid == tids[name] and k.off_cpu == reason]
        total = sum(ns for _, ns in waits)
        good = sum(ns for k, ns in waits if k.waker and test(k.waker))
        # a wait open at the start (begun before BPF saw it) and one open at
        # the end have no waker: about one 50 ms period each, more on a
        # loaded machine (121 ms of the reader's in one CI run): at most two
        # of the thread's longest waits by its own clock, and 10 ms; and
        # the waits whose stacks pyoffcpu says it could not take (their
        # time kept without a stack or waker: "wait stack not taken").  CI
        # runs have gone 11-76 ms past that (a sleeper with 113 and 186 ms
        # of its 2 s), which I have not explained: the chains are held to
        # 90% of the thread's waits, the summary's lines above to 95%.
        bound = max(0.10 * total, 2 * longest[name] + 0.01e9) + not_taken
        assert total > 0.5e9 and total - good <= bound, (
            name, reason, total, bound, [(k.waker, ns) for k, ns in waits][:5], drops)

    def woken_at(tid, line):
        def test(chain):
            py = [f for f in chain if f.kind.value == "python"]
            return (bool(py) and py[0].line == line and py[0].file.endswith("waits.py")
                    and chain[-1].name.startswith(f"thread {tid} "))
        return test
    chained("contender", "lock", woken_at(tids["owner"], release))
    chained("reader", "io", woken_at(tids["writer"], write))
    chained("sleeper", "sleep", lambda c: [f.name for f in c] == ["[woken by timer]"])
    text = out.read_text()
    assert re.search(r";\[off-cpu: lock\];--;[^;]*_\[w\];.*;owner \(\S*waits\.py:%d\)_\[w\];.*"
                     r"thread %d \S+_\[w\] \d+$" % (release, tids["owner"]), text, re.M), text[:2000]
    # the contender's lock wait is the one it timed itself (the owner holds
    # the lock 40 ms of every 50, the contender comes back 20 ms after
    # taking it: about 30 of every 50 ms), as a share of its wall time,
    # within 2%: the recording is the workload's 2 s and some ms more at
    # either end (its start and its end mark are not the signals), which
    # the times themselves would count (up to +26 ms of lock in CI)
    lock_ns = by_reason(prof, tids["contender"]).get("lock", 0)
    wall = sum(ns for k, ns in prof.weights.items() if k.tid == tids["contender"])
    share, truth = lock_ns / max(wall, 1), contended / window
    print(f"\n{label} contender: lock {lock_ns / 1e9:.3f} s of {wall / 1e9:.3f} s ({100 * share:.2f}%), "
          f"its own clock {contended / 1e9:.3f} s of {window / 1e9:.3f} s ({100 * truth:.2f}%)")
    assert contended > 1e9 and abs(share - truth) <= 0.02 * truth, (lock_ns, wall, contended, window)
