"""Crash storms (issue 43): many processes crashing at once while
`pyoffcpu crashes` runs.  Known truth: how many crashed, as whom, and the
line each died at.  The watcher must write a report for each, or count the
ones it could not capture with their reason, and stay alive."""
import os
import re
import resource
import signal
import subprocess
import time

import pytest

from conftest import WORKLOADS, env, pyoffcpu_cmd, python_or_skip, source_line
from test_crashes import Watcher

NOBODY, DAEMON = 65534, 1
STORM = os.path.join(WORKLOADS, "storm.py")


def _as(uid):
    def preexec():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setgid(uid)
        os.setuid(uid)
    return preexec


def start_victims(n, uid):
    """n storm.py processes as uid, each waiting for its line."""
    py = python_or_skip("debian-3.11")
    procs = [subprocess.Popen([py, STORM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd="/", preexec_fn=_as(uid))
             for _ in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def watched(w, procs, after):
    """Waits until the watcher registered every process, then one more scan."""
    want = {p.pid for p in procs}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen = {int(m.group(1)) for ln in list(w.err)[after:]
                for m in [re.search(r"watching process (\d+) \(", ln)] if m}
        if want <= seen:
            break
        time.sleep(0.1)
    assert want <= seen, f"{len(want - seen)} of {len(want)} never watched"
    scans = sum("scanned /proc" in ln for ln in w.err)
    while sum("scanned /proc" in ln for ln in w.err) < scans + 1:
        time.sleep(0.05)


def crash_all(procs):
    for p in procs:             # all at once: each only waits for its line
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=60) == -signal.SIGSEGV


def outcome(w, out_at, pids, timeout=60):
    """pid -> its journal line, and the not-reported counts said, once every
    pid has one or the other (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = list(w.out)[out_at:]
        reported = {int(m.group(1)): ln for ln in lines
                    for m in [re.match(r"crash: process (\d+) ", ln)] if m and int(m.group(1)) in pids}
        counted = sum(int(m.group(1)) for ln in lines
                      for m in [re.match(r"crash: (\d+) crash(?:es)? of user \d+ not reported", ln)] if m)
        if len(reported) + counted >= len(pids) or time.monotonic() > deadline:
            return reported, counted, lines
        assert w.proc.poll() is None, "the watcher died:\n" + "\n".join(w.err[-20:])
        time.sleep(0.1)


def stop_within(w, seconds):
    t = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    rc = w.proc.wait(timeout=30)
    return rc, time.monotonic() - t


@pytest.fixture
def storm_watcher(tmp_path, bpf):
    w = Watcher(str(tmp_path / "reports"))
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


def test_a_storm_of_100_gets_100_reports_twice_and_the_watcher_lives(storm_watcher):
    w = storm_watcher
    line = source_line("storm.py", "STORM_LINE")
    for storm in range(2):
        out_at, err_at = len(w.out), len(w.err)
        procs = start_victims(100, NOBODY)
        watched(w, procs, err_at)
        crash_all(procs)
        reported, counted, lines = outcome(w, out_at, {p.pid for p in procs})
        assert counted == 0 and len(reported) == 100, (storm, counted, len(reported), lines[-5:])
        # each report names the line the process died at (a light one too:
        # only the user stack's copy is left out of those)
        for pid, ln in reported.items():
            path = ln.rsplit(" -> ", 1)[1]
            with open(path) as f:
                text = f.read()
            assert "storm_victim (" in text and f"storm.py:{line})" in text, (storm, pid, text[:2000])
    rc, took = stop_within(w, 2)
    assert rc == 0 and took < 2.0, (rc, took)


def test_one_users_storm_does_not_crowd_out_anothers_crash(storm_watcher):
    w = storm_watcher
    out_at, err_at = len(w.out), len(w.err)
    storm = start_victims(200, NOBODY)
    other = start_victims(1, DAEMON)
    watched(w, storm + other, err_at)
    other[0].stdin.write("go\n")
    other[0].stdin.flush()
    crash_all(storm)
    assert other[0].wait(timeout=60) == -signal.SIGSEGV
    reported, counted, lines = outcome(w, out_at, {p.pid for p in storm + other})
    assert other[0].pid in reported, lines[-10:]
    # every crash of the storm: a report, or counted with its reason
    assert len(reported) - 1 + counted == 200, (len(reported), counted, lines[-5:])
    reasons = [ln for ln in lines if "not reported:" in ln]
    assert all(re.search(r"of user 65534 not reported: (over the budget|no room)", ln) for ln in reasons), reasons
    listed = subprocess.run(pyoffcpu_cmd("crashes", "--dir", w.dir, "--list"), env=env(), capture_output=True,
                            text=True)
    assert counted == sum(int(m.group(1)) for m in re.finditer(r"not reported: (\d+) crash", listed.stdout)), \
        listed.stdout[-2000:]


# -- one report that cannot be built never ends the watch (no BPF needed) -------------------------------

def _event(pid=4242, python=None):
    from pyoffcpu.collect.crashcapture import CapturedThread, CrashEvent
    regs = {"ip": 0x401000, "sp": 0x7ffd0000, "bp": 0, "cs": 0x33}
    t = CapturedThread(tid=pid, regs=regs, stack=b"", kernel=[], python=python)
    return CrashEvent(pid=pid, tid=pid, uid=NOBODY, comm="victim", sig=signal.SIGSEGV, si_code=1, addr=8,
                      handler=0, time_ns=1, thread=t, others=[], memory=[])


def _watcher(tmp_path, said):
    from pyoffcpu.commands import crashes as K
    return K.Watcher(K.CrashOptions(dir=str(tmp_path)), None, said.append, lambda *a, **k: None)


def test_a_report_that_fails_still_comes_out_with_the_failure_named(tmp_path, monkeypatch):
    from pyoffcpu.commands import crashes as K
    said = []
    w = _watcher(tmp_path, said)

    def broken(self, ev, notes=None):
        raise KeyError("co_qualname")           # as a bad layout would
    monkeypatch.setattr(K.Watcher, "report", broken)
    entry = w.handle(_event())
    assert entry["files"] and w.crashes == 1, said
    with open(os.path.join(str(tmp_path), entry["files"]["txt"]["path"])) as f:
        text = f.read()
    assert "could not be built in full (KeyError: 'co_qualname' in test_crash_storm.py:" in text, text
    assert "SIGSEGV" in text and "0x401000" in text, text
    assert said and said[0].startswith("crash: process 4242 (victim)"), said


def test_python_frames_with_no_interpreter_to_name_them_are_left_out_with_a_note(tmp_path):
    """The watcher's storm crash: BPF walked a process's Python frames, and
    user space no longer knew its interpreter (PID checks, a late scan)."""
    said = []
    w = _watcher(tmp_path, said)
    entry = w.handle(_event(python=([(0x7f0000001000, 12, 0)], False)))
    with open(os.path.join(str(tmp_path), entry["files"]["txt"]["path"])) as f:
        text = f.read()
    assert "could not be built" not in text, text
    assert "its Python frames were walked, but the interpreter they belong to is not known" in text, text


def test_no_unwind_tables_is_a_note_not_a_failure(tmp_path, monkeypatch):
    from pyoffcpu.native.unwind import loader

    def no_tables(*a, **k):
        raise OSError("no tables here")
    monkeypatch.setattr(loader, "NativeUnwinder", no_tables)
    said = []
    entry = _watcher(tmp_path, said).handle(_event())
    with open(os.path.join(str(tmp_path), entry["files"]["txt"]["path"])) as f:
        text = f.read()
    assert "no native frames (no tables here)" in text and "could not be built" not in text, text
