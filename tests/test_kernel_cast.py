"""task_struct read by plain loads (bpf/loadconst.h task_u32): where the
kernel's BTF has the bpf_rdonly_cast kfunc, the loader turns the programs'
marked calls into calls of it; where the verifier still refuses it, the
program is loaded again reading by bpf_probe_read_kernel, and records the
same.  What it saves (~50-70 ns per read, on a path every switch on the
machine takes): docs/overhead.md, bench case 4."""
import base64
import contextlib
import os
import subprocess
import sys
import time

import pytest

from pyoffcpu.collect import progcache

BPFOBJ = os.path.join(os.path.dirname(progcache.__file__), "..", "bpfobj")


def recording_entry():
    for name in sorted(os.listdir(BPFOBJ)):
        if name.endswith(".bpf"):
            with open(os.path.join(BPFOBJ, name), "rb") as f:
                e = progcache.parse(f.read(), name[:-4])
            if any(p["name"].endswith("sched_switch") for p in e["programs"]):
                return e
    pytest.fail("no shipped recording programs")


def test_marked_calls_are_recorded_patched_and_checked():
    """Every call of the marker id is recorded as its kfunc; patching makes
    it a kfunc call of the id given; a record at another instruction, or a
    kfunc without an id, is refused."""
    e = recording_entry()
    progs = {p["name"]: p for p in e["programs"]}
    switch = next(p for n, p in progs.items() if n.endswith("sched_switch"))
    assert switch["kfuncs"] and {k for _, k in switch["kfuncs"]} == {"bpf_rdonly_cast"}
    marker = progcache.bpfdefs.value("KFUNC_RDONLY_CAST")
    for p in e["programs"]:
        code = bytearray(base64.b64decode(p["insns"]))
        calls = {j for j in range(len(code) // 8) if code[j * 8] == 0x85 and not code[j * 8 + 1] >> 4
                 and int.from_bytes(code[j * 8 + 4:j * 8 + 8], "little", signed=True) == marker}
        assert calls == {j for j, _ in p.get("kfuncs", ())}, p["name"]
    code = bytearray(base64.b64decode(switch["insns"]))
    progcache.patch_kfuncs(code, switch["kfuncs"], {progcache.KFUNC_PREFIX + "bpf_rdonly_cast": 64919})
    for j, _ in switch["kfuncs"]:
        assert code[j * 8 + 1] >> 4 == 2 and int.from_bytes(code[j * 8 + 4:j * 8 + 8], "little") == 64919
        assert progcache.kfunc_at(code, j) is None
    with pytest.raises(progcache.CacheError, match="no BTF id"):
        progcache.patch_kfuncs(bytearray(base64.b64decode(switch["insns"])), switch["kfuncs"], {})
    j = switch["kfuncs"][0][0]
    bad = dict(switch, kfuncs=[[j + 1, "bpf_rdonly_cast"]])
    broken = dict(e, programs=[bad if p is switch else p for p in e["programs"]])
    with pytest.raises(progcache.CacheError, match="kfunc"):
        progcache.parse(progcache.serialize(broken), e["key"])


@contextlib.contextmanager
def spinner_and_sleeper():
    """A process with a thread spinning and a thread sleeping 10 ms at a time."""
    code = ("import threading, time\n"
            "def nap():\n    while True: time.sleep(0.01)\n"
            "threading.Thread(target=nap, daemon=True).start()\n"
            "print(threading.get_native_id(), flush=True)\nwhile True: pass\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        spin_tid = int(p.stdout.readline())
        yield p.pid, spin_tid
    finally:
        p.kill()
        p.wait()


def record(platform, pid, seconds=1.0):
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    s = Session(Options(pids=[pid], duration=seconds, mode="wall"), platform)
    return s, s.run()


def check_times(rec, pid, spin_tid):
    """The spinner was on a CPU for most of the recording, the napper off it
    for most of it, asleep in clock_nanosleep or waiting for the GIL, and
    each thread's wall time is the recording's."""
    from pyoffcpu.profile.merge import build_profile
    prof, _ = build_profile(rec, symbolizer=None)
    nap_tid = next(t for t in rec.threads if t not in (pid, spin_tid) and t > 0)
    spin_on = prof.total_ns(tid=spin_tid, on_cpu=True)
    nap_on = prof.total_ns(tid=nap_tid, on_cpu=True)
    assert spin_on > 0.6 * rec.duration_ns and nap_on < 0.2 * rec.duration_ns, (spin_on, nap_on)
    for tid in (spin_tid, nap_tid):
        assert abs(prof.total_ns(tid=tid) - rec.duration_ns) < 0.02 * rec.duration_ns, tid
    # the system call it blocks in, read from its pt_regs at each switch-out
    # (current_syscall), names its waits (nothing else here can: no native
    # symbols): clock_nanosleep, and futex for the GIL the spinner holds
    why = prof.off_cpu_by_reason()[nap_tid]
    assert why.get("sleep", 0) > 0.5 * rec.duration_ns, why
    assert why.get("sleep", 0) + why.get("lock", 0) > 0.98 * sum(why.values()), why


def test_this_kernel_reads_task_struct_by_loads(bpf):
    """Where BTF names the kfunc, every program loads with it (none goes
    back to the helper), and a recording has its threads' times."""
    from pyoffcpu.collect import platform as plat
    p = plat.probe()
    if not p.kfunc_rdonly_cast_id:
        pytest.skip("this kernel's BTF has no bpf_rdonly_cast")
    with spinner_and_sleeper() as (pid, spin_tid):
        s, rec = record(p, pid)
    assert s.bpf.consts["KERNEL_CAST"] == 1 and s.bpf.cast_refused == []
    check_times(rec, pid, spin_tid)


def test_a_refused_kfunc_falls_back_to_the_helper_and_records_the_same(bpf):
    """A kfunc id the verifier refuses (here task_struct's own id, no
    function): each program that calls it is loaded again with the helper's
    reads, and the recording is as good."""
    import dataclasses
    from pyoffcpu.collect import platform as plat
    p = plat.probe()
    if not p.btf_task_struct_id:
        pytest.skip("this kernel's BTF has no task_struct id")
    bad = dataclasses.replace(p, kfunc_rdonly_cast_id=p.btf_task_struct_id)
    with spinner_and_sleeper() as (pid, spin_tid):
        t0 = time.monotonic()
        s, rec = record(bad, pid)
    assert time.monotonic() - t0 < 60
    assert any(n.endswith("sched_switch") for n in s.bpf.cast_refused), s.bpf.cast_refused
    check_times(rec, pid, spin_tid)
