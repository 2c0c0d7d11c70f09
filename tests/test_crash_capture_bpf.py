"""The crash watcher's BPF capture (pytool/pyoffcpu/collect/crashcapture.py,
bpf/crashes.bpf.c): real processes that crash at known places, caught at
the signal's delivery; what was captured must name those places exactly
after the process is gone.

The ground truth is tests/workloads/crashes.py over crash_fixture.c: the
null case faults in cf_inner (address 0), called by cf_middle <- cf_outer
<- crash_null, from crash_in_native at NULL_LINE; the abort case aborts in
the thread "aborter" (ab_inner -> abort()).
"""
import os
import resource
import signal
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from conftest import WORKLOADS, python_or_skip, source_line

SEGV_MAPERR = 1
SI_USER, SI_TKILL = 0, -6
OWNER_SHIM = 3                  # 3.12+: an entry shim frame (profile/merge.py), not a function


@pytest.fixture(scope="module")
def fixture_lib(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("crashlib") / "crash_fixture.so")
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", out,
                    os.path.join(WORKLOADS, "crash_fixture.c")], check=True)
    return out


@pytest.fixture(scope="module")
def capture(bpf):
    from pyoffcpu.collect.crashcapture import CrashCapture
    cap = CrashCapture()
    yield cap
    cap.close()


def no_core():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def symbols(path):
    """name -> (start, end) of the functions in path's .symtab."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name: (s["st_value"], s["st_value"] + s["st_size"])
                for s in elf.get_section_by_name(".symtab").iter_symbols()
                if s["st_info"]["type"] == "STT_FUNC" and s["st_size"]}


def load_bias(pid, path):
    """Where path's offset 0 is mapped in pid (its vaddrs start at 0)."""
    real = os.path.realpath(path)
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == real and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise AssertionError(f"{path} not mapped in {pid}")


def wait_event(cap, pid, timeout=10.0):
    """The captures of pid (None: of any process), once some have come (and
    a moment more, to see that there is exactly one)."""
    got = []
    for _ in range(int(timeout / 0.5)):
        got += [e for e in cap.poll(0.5) if pid is None or e.pid == pid]
        if got:
            got += [e for e in cap.poll(0.5) if pid is None or e.pid == pid]
            break
    return got


def stack_words(ev):
    st = ev.thread.stack
    return [int.from_bytes(st[i:i + 8], "little") for i in range(0, len(st) - 7, 8)]


def python_names(ev, pp, thread=None):
    """(qualname, file, line) of the Python frames of the event's thread (or
    of one of its others), innermost first, named from the captured memory
    alone (shim frames dropped)."""
    from pyoffcpu.collect.crashcapture import CapturedMemory
    from pyoffcpu.cpython.code import CodeReader
    frames, truncated = (thread or ev.thread).python
    assert not truncated
    reader = CodeReader(CapturedMemory(ev.memory), pp.minor, pp.offsets, pp.code_type)
    out = []
    for code, offset, flags in frames:
        if pp.minor >= (3, 12) and (flags & 0xff) >= OWNER_SHIM:
            continue
        info = reader.code(code)
        assert info is not None, f"code object {code:#x} not named from the capture"
        out.append((info.name, os.path.basename(info.filename), info.line_for(pp.minor, offset)))
    return out


def run_crash(cap, python, lib, case):
    """Start crashes.py, register it, let it crash; (event, pid, tids, pp, bias)."""
    from pyoffcpu.cpython import detect
    proc = subprocess.Popen([python, os.path.join(WORKLOADS, "crashes.py"), lib, case, "--wait"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=no_core)
    try:
        tids = {}
        for line in proc.stdout:
            if line.startswith("tid "):
                _, name, tid = line.split()
                tids[name] = int(tid)
            if line.strip() == "ready":
                break
        pp = detect.find_python(proc.pid)
        cap.register_python(proc.pid, pp)
        bias = load_bias(proc.pid, lib)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cap.unregister(proc.pid)
    events = wait_event(cap, proc.pid)
    assert len(events) == 1, events
    return events[0], proc, tids, pp, bias


PY_LABELS = ["pyenv-3.11", "pyenv-3.13", "debian-3.11"]
BLOCKED_STACK = ["blocked_wait", "main.<locals>.<lambda>", "Thread.run", "Thread._bootstrap_inner",
                 "Thread._bootstrap"]


def check_blocked(ev, pp, tid):
    """The thread blocked in blocked_wait, among the event's other threads."""
    (other,) = [o for o in ev.others if o.tid == tid]
    assert other.regs == {} and other.stack == b"" and other.kernel == []
    names = python_names(ev, pp, other)
    assert [n for n, _, _ in names] == BLOCKED_STACK
    assert names[0][1:] == ("crashes.py", source_line("crashes.py", "BLOCKED_LINE"))


@pytest.mark.parametrize("label", PY_LABELS)
def test_null_dereference(capture, fixture_lib, label):
    ev, proc, tids, pp, bias = run_crash(capture, python_or_skip(label), fixture_lib, "null")
    assert proc.returncode == -signal.SIGSEGV
    assert (ev.pid, ev.tid, ev.sig, ev.si_code, ev.addr) == (proc.pid, tids["main"], signal.SIGSEGV,
                                                             SEGV_MAPERR, 0)
    assert ev.handler == 0 and ev.complete and ev.uid == os.getuid()
    syms = symbols(fixture_lib)
    lo, hi = syms["cf_inner"]
    assert bias + lo <= ev.thread.regs["ip"] < bias + hi
    assert ev.thread.regs["cs"] & 3 == 3 and ev.thread.regs["fsbase"]
    # the return addresses into cf_middle and cf_outer lie above sp
    words = stack_words(ev)
    assert ev.thread.stack
    for fn in ("cf_middle", "cf_outer"):
        lo, hi = syms[fn]
        assert any(bias + lo < w < bias + hi for w in words), fn
    assert ev.thread.kernel         # the page fault's path into the signal
    names = python_names(ev, pp)
    assert [n for n, _, _ in names] == ["crash_in_native", "run_case", "main", "<module>"]
    assert all(f == "crashes.py" for _, f, _ in names)
    assert names[0][2] == source_line("crashes.py", "NULL_LINE")
    assert names[1][2] == source_line("crashes.py", "RUN_NULL_LINE")
    assert names[2][2] == source_line("crashes.py", "MAIN_LINE")
    # the other threads' Python stacks: the blocked one alone
    assert [o.tid for o in ev.others] == [tids["blocked"]]
    check_blocked(ev, pp, tids["blocked"])


@pytest.mark.parametrize("label", PY_LABELS)
def test_abort_in_thread(capture, fixture_lib, label):
    ev, proc, tids, pp, bias = run_crash(capture, python_or_skip(label), fixture_lib, "abort")
    assert proc.returncode == -signal.SIGABRT
    assert (ev.pid, ev.sig, ev.si_code) == (proc.pid, signal.SIGABRT, SI_TKILL)
    assert ev.tid not in (proc.pid, tids["main"], tids["blocked"])     # the aborter thread
    assert ev.thread.regs["orig_ax"] == 234                            # tgkill, from raise()
    syms = symbols(fixture_lib)
    words = stack_words(ev)
    for fn in ("ab_middle", "ab_outer"):
        lo, hi = syms[fn]
        assert any(bias + lo < w < bias + hi for w in words), fn
    names = python_names(ev, pp)
    assert [n for n, _, _ in names] == ["abort_thread", "Thread.run", "Thread._bootstrap_inner",
                                        "Thread._bootstrap"]
    assert names[0][1:] == ("crashes.py", source_line("crashes.py", "ABORT_LINE"))
    assert sorted(o.tid for o in ev.others) == sorted((tids["main"], tids["blocked"]))
    check_blocked(ev, pp, tids["blocked"])
    # the main thread waits in join_aborter (threading's frames above it
    # differ between versions)
    (main,) = [o for o in ev.others if o.tid == tids["main"]]
    names = python_names(ev, pp, main)
    assert [n for n, _, _ in names][-4:] == ["join_aborter", "run_case", "main", "<module>"]
    assert [line for _, _, line in names][-4:-1] == [source_line("crashes.py", m) for m in
                                                     ("JOIN_LINE", "RUN_JOIN_LINE", "MAIN_LINE")]


def test_not_python(capture, tmp_path):
    """A C program that reads through NULL: an event, no Python walk."""
    src = tmp_path / "null.c"
    src.write_text("int main(void) { return *(volatile int *)0; }\n")
    exe = str(tmp_path / "null")
    subprocess.run(["gcc", "-O0", "-o", exe, str(src)], check=True)
    proc = subprocess.run([exe], preexec_fn=no_core)
    assert proc.returncode == -signal.SIGSEGV
    # the pid is not known before it runs: its comm and the fault name it
    events = [e for e in wait_event(capture, None) if e.comm == "null"]
    assert len(events) == 1
    ev = events[0]
    assert (ev.sig, ev.si_code, ev.addr) == (signal.SIGSEGV, SEGV_MAPERR, 0)
    assert ev.thread.python is None and ev.memory == []
    assert ev.thread.stack and ev.thread.regs["sp"]


def test_signal_sent_by_kill(capture):
    """kill -SEGV: SI_USER, and the sender in the fault address's place."""
    proc = subprocess.Popen(["sh", "-c", "kill -SEGV $$"], preexec_fn=no_core)
    proc.wait()
    events = wait_event(capture, proc.pid)
    assert len(events) == 1
    ev = events[0]
    assert (ev.sig, ev.si_code, ev.tid) == (signal.SIGSEGV, SI_USER, proc.pid)
    assert ev.addr & 0xffffffff == proc.pid        # si_pid of the sender: itself
    assert ev.thread.python is None


def test_filter_by_pid(bpf):
    """With pids, other processes' crashes are left out."""
    from pyoffcpu.collect.crashcapture import CrashCapture
    cap = CrashCapture(pids=[1])
    try:
        proc = subprocess.Popen(["sh", "-c", "kill -SEGV $$"], preexec_fn=no_core)
        proc.wait()
        assert wait_event(cap, proc.pid, timeout=1.0) == []
    finally:
        cap.close()
