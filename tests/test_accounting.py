"""Where the time goes, exactly: real BPF, real processes, ground truth built
into the workloads.

* tests/workloads/two_callers.py (issue 8): one blocking helper, called from
  two lines of one caller, 30% / 70% of the caller's blocked time by
  construction (3 and 7 equal blocks per cycle, interleaved). Each line's
  share of the off-CPU time must be within 1 pp of that, on every CPython of
  the matrix (conftest.CPYTHON_MATRIX). The switch memo used to reuse the
  last capture whenever the helper blocked with the same user PC, stack
  pointer and innermost Python frame, and charged one line with everything.
* tests/workloads/mixed_threads.py: ten threads that compute, sleep, wait
  on a lock and on a pipe, fight over two CPUs (runqueue) and one GIL. Every
  thread is alive for the whole recording, so each one's on-CPU + off-CPU
  time is the recording's length (DESIGN.md: "every thread's on + off = its
  lifetime"), read from the speedscope file's "pyoffcpu" block and from the
  weights of its profiles.
* tests/workloads/lone_spinner.py: a thread that never switches voluntarily
  is on the CPU for the whole recording and off it only for what the
  scheduler really took (read back from /proc/PID/task/TID/schedstat).
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import (MATRIX_LABELS, WORKLOADS, TwoCallers, Workload, env, pyoffcpu_cmd,
                      python_or_skip, record_folded, wait_for_recording)

DURATION = 4
FREQUENCY = 99                  # pyoffcpu's default -F
ACCOUNT_TOL = 0.005             # on + off vs the recording's length


# -- issue 8: one helper, two lines ---------------------------------------------
@pytest.mark.parametrize("label", MATRIX_LABELS)
def test_two_callers_workload_splits_30_70_by_its_own_clock(label):
    """The ground truth holds without a profiler: the workload's own clock
    around each call splits the blocked time 30/70."""
    python = python_or_skip(label)
    res = subprocess.run([python, os.path.join(WORKLOADS, "two_callers.py"), "1"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    m = re.search(r"split A=([\d.]+) B=([\d.]+) blocks=(\d+)", res.stdout)
    assert m, res.stdout
    a, b, blocks = float(m.group(1)), float(m.group(2)), int(m.group(3))
    assert blocks >= 500, res.stdout
    # a sanity check of the workload alone: 30/70 on a quiet machine, but a
    # loaded one moves it by several points (a 1 ms sleep overshoots unevenly;
    # measured 24.5/75.5 at load average 10), so only a gross error fails here.
    # The exact check is below: the profile against the workload's own clock
    # of the same window.
    assert abs(a - 30) <= 10 and abs(b - 70) <= 10, res.stdout


@pytest.mark.parametrize("label", MATRIX_LABELS + ["debian-3.15"])
def test_helper_called_from_two_lines_is_charged_to_each_line(label, tmp_path, bpf):
    """At -F 999 every 1 ms block is longer than the sampling period: each
    one's stack is taken (at its switch-in, on the thread's way back to
    user space, through the same native-walk memo as a switch-out's) at
    its exact length, so the split is exact."""
    split = TwoCallers.record(label, tmp_path, DURATION, "-F", "999")
    split.check_whole(DURATION)
    # the design (30/70) within 1 pp on a quiet machine; the workload's own
    # clock of the window within 1 pp always; a line charged with the other's
    # time (the bug this guards) is off by tens of points
    assert abs(split.share_a - split.truth_a) <= 1, split.explain()
    assert abs(split.share_a - 30) <= 3, split.explain()


# -- the accounting invariant: on + off = the recording ---------------------------
_TID = re.compile(r"\(tid (\d+)\)")


class JsonRun:
    def __init__(self, label, w, tids, doc, stderr):
        self.label, self.w, self.tids, self.doc, self.stderr = label, w, tids, doc, stderr


def record_json(tmp_path, python, script, *extra):
    """Record `script` for DURATION s to speedscope JSON; returns (Workload,
    {thread name: tid}, document, stderr)."""
    w = Workload(python, script, 60)
    out = tmp_path / "out.json"
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        res = subprocess.run(pyoffcpu_cmd("-p", str(w.pid), "-d", str(DURATION), "-o", str(out),
                                          *extra),
                             env=env(), capture_output=True, text=True, timeout=120)
    finally:
        w.stop()
    assert res.returncode == 0, res.stderr
    return w, tids, json.loads(out.read_text()), res.stderr


@pytest.fixture(scope="module", params=["pyenv-3.11", "debian-3.11"])
def mixed(request, tmp_path_factory, bpf):
    python = python_or_skip(request.param)
    w, tids, doc, stderr = record_json(tmp_path_factory.mktemp("mixed"), python,
                                       "mixed_threads.py")
    assert len(tids) == 10, tids
    return JsonRun(request.param, w, tids, doc, stderr)


def profile_totals(doc):
    """tid -> [on-CPU ns, off-CPU ns] from the speedscope profiles' weights
    (one profile per thread; an off-CPU sample's leaf is the [off-cpu...]
    marker)."""
    frames = doc["shared"]["frames"]
    out = {}
    for p in doc["profiles"]:
        m = _TID.search(p["name"])
        assert m, p["name"]
        tot = out.setdefault(int(m.group(1)), [0, 0])
        for sample, weight in zip(p["samples"], p["weights"]):
            off = bool(sample) and frames[sample[-1]]["name"].startswith("[off-cpu")
            tot[off] += weight
    return out


def thread_records(run):
    """tid -> the doc["pyoffcpu"]["threads"] entry of the workload's threads."""
    recs = {}
    for t in run.doc["pyoffcpu"]["threads"]:
        assert t["pid"] == run.w.pid, t
        assert t["tid"] not in recs, ("thread listed twice", t)
        recs[t["tid"]] = t
    return recs


def _table(totals, tids):
    names = {tid: name for name, tid in tids.items()}
    return "\n".join(f"  {names.get(tid, tid):12} on {on / 1e9:6.3f} s + off {off / 1e9:6.3f} s"
                     f" = {(on + off) / 1e9:6.3f} s" for tid, (on, off) in sorted(totals.items()))


def test_mixed_profiles_cover_about_the_requested_duration(mixed):
    """Before the exact checks: each thread's weights add up to about -d (3%)."""
    totals = profile_totals(mixed.doc)
    table = _table(totals, mixed.tids)
    print(f"\n{mixed.label} (profiles' weights):\n{table}")
    assert set(totals) == set(mixed.tids.values()), (table, mixed.tids)
    bad = [tid for tid, (on, off) in totals.items()
           if abs((on + off) / 1e9 - DURATION) > 0.03 * DURATION]
    assert not bad, f"not about {DURATION} s:\n{table}"


def test_mixed_threads_on_plus_off_is_the_recording(mixed):
    meta = mixed.doc["pyoffcpu"]
    duration = meta["duration_ns"]
    assert isinstance(duration, int) and abs(duration / 1e9 - DURATION) <= 0.05 * DURATION, duration
    recs = thread_records(mixed)
    assert set(recs) == set(mixed.tids.values()), (sorted(recs), mixed.tids)
    bad = []
    for name, tid in sorted(mixed.tids.items()):
        t = recs[tid]
        for key in ("on_cpu_ns", "off_cpu_ns", "samples", "first_ns", "last_ns"):
            assert isinstance(t[key], int) and t[key] >= 0, (name, key, t)
        total = t["on_cpu_ns"] + t["off_cpu_ns"]
        alive = t["last_ns"] - t["first_ns"]
        print(f"\n{mixed.label} {name}: on {t['on_cpu_ns'] / 1e9:.3f} s + off "
              f"{t['off_cpu_ns'] / 1e9:.3f} s = {total / duration:.4f} of {duration / 1e9:.3f} s, "
              f"alive {t['first_ns']}..{t['last_ns']}, {t['samples']} samples")
        # alive for the whole recording
        if t["first_ns"] > ACCOUNT_TOL * duration or t["last_ns"] < (1 - ACCOUNT_TOL) * duration:
            bad.append((name, "lifetime", t["first_ns"], t["last_ns"]))
        if t["last_ns"] > duration * (1 + ACCOUNT_TOL):
            bad.append((name, "last_ns past the end", t["last_ns"]))
        if abs(total - duration) > ACCOUNT_TOL * duration:
            bad.append((name, "on+off vs duration", total / duration))
        if abs(total - alive) > ACCOUNT_TOL * duration:
            bad.append((name, "on+off vs lifetime", total, alive))
        if t["on_cpu_ns"] > 0.2e9 and t["samples"] == 0:
            bad.append((name, "on-CPU time but no samples", t))
        # the reasons split the off-CPU time, all of it
        if sum(t["off_cpu_by_reason_ns"].values()) != t["off_cpu_ns"]:
            bad.append((name, "off-CPU by reason", t["off_cpu_by_reason_ns"], t["off_cpu_ns"]))
    assert not bad, bad


def test_mixed_profile_weights_match_the_thread_records(mixed):
    """The same invariant from the profiles' weights (what a folded file or a
    flame graph shows): each thread's weights add up to the recording, and
    to the on/off split its record gives."""
    duration = mixed.doc["pyoffcpu"]["duration_ns"]
    recs = thread_records(mixed)
    totals = profile_totals(mixed.doc)
    bad = []
    for name, tid in sorted(mixed.tids.items()):
        on, off = totals.get(tid, (0, 0))
        if abs(on + off - duration) > ACCOUNT_TOL * duration:
            bad.append((name, "weights vs duration", (on + off) / duration))
        t = recs[tid]
        # the same numbers: only rounding (folded-style microseconds) may differ
        if abs(on - t["on_cpu_ns"]) > 0.001 * duration or abs(off - t["off_cpu_ns"]) > 0.001 * duration:
            bad.append((name, "weights vs record", (on, off), (t["on_cpu_ns"], t["off_cpu_ns"])))
    assert not bad, bad


def test_mixed_workload_had_runqueue_and_blocked_time(mixed):
    """The workload does what it is built for: CPU hogs preempted (runqueue),
    blocked threads asleep, the hashers mostly on a CPU or waiting for one."""
    frames = mixed.doc["shared"]["frames"]
    reasons = {}
    for p in mixed.doc["profiles"]:
        tid = int(_TID.search(p["name"]).group(1))
        for sample, weight in zip(p["samples"], p["weights"]):
            leaf = frames[sample[-1]]["name"] if sample else ""
            if leaf.startswith("[off-cpu"):
                r = reasons.setdefault(tid, {})
                r[leaf] = r.get(leaf, 0) + weight
    hashers = [mixed.tids["hash-%d" % i] for i in range(3)]
    runq = sum(reasons.get(t, {}).get("[off-cpu: runqueue]", 0) for t in hashers)
    assert runq > 0.1e9, reasons
    for name in ("main", "lock-waiter", "pipe-reader"):
        off = sum(reasons.get(mixed.tids[name], {}).values())
        assert off > 0.5 * DURATION * 1e9, (name, reasons.get(mixed.tids[name]))


# -- a thread that never switches -------------------------------------------------
def _sched(pid, tid):
    """(runqueue wait ns, voluntary switches, involuntary switches) of a thread."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        wait = int(f.read().split()[1])
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        st = f.read()
    vol = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", st, re.M).group(1))
    invol = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", st, re.M).group(1))
    return wait, vol, invol


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_thread_that_never_switches_is_on_cpu_the_whole_recording(label, tmp_path, bpf):
    """A pure-Python spinner nobody takes the GIL from never leaves the CPU
    of its own accord: it is charged on-CPU for the whole recording and
    off-CPU only for the preemptions the kernel counted (schedstat), none on
    a quiet machine: pyoffcpu is kept off the spinner's CPU."""
    python = python_or_skip(label)
    w = Workload(python, "lone_spinner.py")
    out = tmp_path / "out.json"
    try:
        tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
        spin = tids["spinner"]
        cpu = [ln.split()[1] for ln in w.lines if ln.startswith("cpu ")][0]
        others = set(os.sched_getaffinity(0)) - ({int(cpu)} if cpu != "-" else set())

        def off_the_spinners_cpu():
            if others:
                os.sched_setaffinity(0, others)

        # The scheduler's account spans the whole recording and more (from
        # before pyoffcpu starts to after it ends): what it took is at least
        # what it took inside the window, so `duration - preempted` below
        # stays a lower bound however loaded the machine is.
        # Its voluntary switches are counted inside the recording only: while
        # pyoffcpu starts, its reads of /proc/PID/maps may hold the mmap lock
        # an allocation of the spinner's waits for.
        wait0, _, inv0 = _sched(w.pid, spin)
        proc = subprocess.Popen(pyoffcpu_cmd("-p", str(w.pid), "-d", str(DURATION), "-o", str(out)),
                                env=env(), stderr=subprocess.PIPE, text=True,
                                preexec_fn=off_the_spinners_cpu)
        try:
            wait_for_recording(proc)
            t0 = time.monotonic()
            _, vol0, _ = _sched(w.pid, spin)
            time.sleep(max(0.0, t0 + DURATION - time.monotonic() - 0.2))
            _, vol1, _ = _sched(w.pid, spin)
            stderr = proc.stderr.read()
            assert proc.wait(timeout=60) == 0, stderr
            wait1, _, inv1 = _sched(w.pid, spin)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        w.stop()
    assert vol1 == vol0, ("the spinner blocked: the workload is broken", vol0, vol1)
    preempted = wait1 - wait0       # what the scheduler took, the recording and around it
    doc = json.loads(out.read_text())

    # from the profile's weights, against -d (the exact length is below)
    on, off = profile_totals(doc).get(spin, (0, 0))
    print(f"\n{label} spinner: on {on / 1e9:.3f} s + off {off / 1e9:.3f} s in a {DURATION} s "
          f"recording; the kernel preempted it {inv1 - inv0} times, {preempted / 1e6:.1f} ms")
    assert abs((on + off) / 1e9 - DURATION) <= 0.03 * DURATION, (
        f"spinner: on {on / 1e9:.3f} s + off {off / 1e9:.3f} s in a {DURATION} s recording")

    duration = doc["pyoffcpu"]["duration_ns"]
    slack = ACCOUNT_TOL * duration
    assert duration - preempted - slack <= on <= duration + slack, (on, duration, preempted)
    assert off <= preempted + slack, (off, preempted, duration)

    recs = {t["tid"]: t for t in doc["pyoffcpu"]["threads"]}
    rec = recs[spin]
    assert rec["first_ns"] <= slack and rec["last_ns"] >= duration - slack, rec
    assert duration - preempted - slack <= rec["on_cpu_ns"] <= duration + slack, (rec, preempted)
    assert rec["off_cpu_ns"] <= preempted + slack, (rec, preempted)
    # on a CPU all the time: it takes (about) every tick of the one it runs on
    expect = rec["on_cpu_ns"] / 1e9 * FREQUENCY
    assert abs(rec["samples"] - expect) <= 0.1 * expect, (rec, expect)
    # the parked threads: off-CPU the whole time
    for name in ("main", "parked-0", "parked-1"):
        t = recs[tids[name]]
        assert t["on_cpu_ns"] <= slack, (name, t)
        assert abs(t["on_cpu_ns"] + t["off_cpu_ns"] - duration) <= slack, (name, t)
