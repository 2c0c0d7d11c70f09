"""-a: every process on the machine, each under its own root, with Python
frames wherever Python runs; processes that start or exec during the
recording are found; a reused PID is never walked with its old registration."""
import os
import re
import subprocess
import time

import pytest

from conftest import (CHROOT_LABELS, WORKLOADS, chroot_cmd, chroot_ns_cmd, chroot_workloads, env,
                      pyoffcpu_cmd,
                      python_or_skip, source_line, wait_for_recording)
from pyoffcpu.profile.model import FrameKind, from_folded

# CPU seconds each spinner spins before it exits: more than any recording
# here lasts (they are killed at the end); with 5 s, a start of -a that
# built cold tables for every process's libraries (a cache version bump)
# let the early spinners run out in the middle of the recording
SPIN_S = 120.0
RECORD_S = 4.0
EXEC_LINES = {
    "spin": {source_line("execs.py", "# SPIN"), source_line("execs.py", "while time.thread_time() < end")},
    "after_exec": {source_line("execs.py", "    spin(seconds)") + 4},
}


def spinner(label, *, via_shell=False, sleep=0.0):
    """A process that spins in execs.py's after_exec() for SPIN_S of CPU
    (after `sleep` seconds asleep)."""
    path = python_or_skip(label)
    environ = dict(os.environ, EXECS_SLEEP=str(sleep))
    if label in CHROOT_LABELS:
        return subprocess.Popen(chroot_cmd(label, os.path.join(chroot_workloads(), "execs.py"),
                                           "after", SPIN_S))
    argv = [path, os.path.join(WORKLOADS, "execs.py"), "after", str(SPIN_S)]
    if via_shell:
        # a shell wrapper that execs Python (what start-up scripts do): the
        # process is a shell first, Python after its exec
        return subprocess.Popen(["/bin/sh", "-c", 'sleep 0.3; exec "$@"', "sh", *argv], env=environ)
    return subprocess.Popen(argv, env=environ)


def python_share(prof, pid):
    """(on-CPU ns of pid, of it with Python frames, wrong lines seen)."""
    total = with_py = 0
    wrong = []
    for k, ns in prof.weights.items():
        if k.pid != pid or k.off_cpu is not None:
            continue
        total += ns
        frames = [f for f in k.frames if f.kind is FrameKind.PYTHON]
        if frames:
            with_py += ns
        for f in frames:
            if f.file and f.file.endswith("execs.py") and f.name in EXEC_LINES \
                    and f.line not in EXEC_LINES[f.name]:
                wrong.append(f)
            if f.name.startswith("[unknown code"):
                wrong.append(f)
    return total, with_py, wrong


def test_every_python_process_is_found_with_exact_frames(tmp_path, bpf):
    labels = ["pyenv-3.9", "pyenv-3.12", "debian-3.11", "debian-3.14", "debian-3.15"]
    procs = {label: spinner(label) for label in labels}
    c_proc = subprocess.Popen(["sha256sum", "/dev/zero"])     # killed below
    out = tmp_path / "all.folded"
    late = {}
    try:
        time.sleep(0.3)
        rec = subprocess.Popen(pyoffcpu_cmd("-a", "-d", str(RECORD_S), "-o", str(out)), env=env(),
                               stderr=subprocess.PIPE, text=True)
        wait_for_recording(rec)
        # started during the recording: one directly, one through a shell that
        # execs it.  Each is walked natively until it is found: that is its
        # start-up (~25 ms of CPU) and no more, since it sleeps 0.3 s before
        # it spins (found while spinning, 7 CPU hogs on 2 cores made the
        # finding's delay 5-7% of its samples)
        time.sleep(0.5)
        late["started"] = spinner("pyenv-3.12", sleep=0.3)
        late["wrapped"] = spinner("debian-3.11", via_shell=True, sleep=0.3)
        stderr = rec.communicate(timeout=120)[1]
        assert rec.returncode == 0, stderr
    finally:
        for p in list(procs.values()) + list(late.values()) + [c_proc]:
            p.kill()
            p.wait()
    prof = from_folded(out.read_text())
    pids = {label: p.pid for label, p in procs.items()}
    pids.update({f"late {k}": p.pid for k, p in late.items()})
    print()
    for label, pid in pids.items():
        total, with_py, wrong = python_share(prof, pid)
        print(f"{label}: pid {pid}, {total / 1e9:.2f} s on-CPU, Python frames in "
              f"{100 * with_py / max(total, 1):.1f}%")
        assert total > 0.5e9, (label, pid, stderr)
        assert not wrong, (label, wrong[:3])
        # a late one is walked natively until found: its first few tens of ms
        assert with_py >= 0.95 * total, (label, with_py / total, _debug_nonpython(prof, pid), stderr[-600:])
    # every process under its own root, a pure C one natively
    assert set(pids.values()) | {c_proc.pid} <= set(prof.processes), sorted(prof.processes)
    c_total, c_py, _ = python_share(prof, c_proc.pid)
    assert c_total > 0.5e9 and c_py == 0, (c_total, c_py)
    assert any(f.kind is FrameKind.NATIVE for k in prof.weights if k.pid == c_proc.pid for f in k.frames)
    assert rec.pid not in prof.processes          # never itself
    assert re.search(r"-a: \d+ processes, \d+ Python interpreters", stderr), stderr


def test_wall_mode_needs_a_filter_and_filters_select(tmp_path, bpf):
    res = subprocess.run(pyoffcpu_cmd("-a", "--mode", "wall", "-d", "1"), env=env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "needs a filter" in res.stderr, res.stderr
    res = subprocess.run(pyoffcpu_cmd("-p", "1", "--match", "x"), env=env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "for -a" in res.stderr, res.stderr
    # --match in wall mode: the matching process is there with its off-CPU time, no other is
    res, prof, mine, other = record_beside_a_c_process(
        tmp_path, "--match", r"execs\.py after", "--mode", "wall")
    assert set(prof.processes) == {mine}, (prof.processes, res.stderr)
    total, with_py, wrong = python_share(prof, mine)
    assert total > 0.5e9 and not wrong and with_py >= 0.95 * total, (total, with_py, wrong)


def test_python_only_takes_no_other_process(tmp_path, bpf):
    res, prof, mine, other = record_beside_a_c_process(tmp_path, "--python-only")
    assert mine in prof.processes and other not in prof.processes, (prof.processes, res.stderr)
    assert "left out (--python-only)" in res.stderr, res.stderr


def record_beside_a_c_process(tmp_path, *args):
    """`pyoffcpu -a ARGS -d 2` while a 3.12 spinner and a pure C process
    (sha256sum) run: (result, profile, spinner's PID, C process's PID)."""
    mine = spinner("pyenv-3.12")
    other = subprocess.Popen(["sha256sum", "/dev/zero"])     # killed below
    out = tmp_path / "beside.folded"
    try:
        time.sleep(0.3)
        res = subprocess.run(pyoffcpu_cmd("-a", *args, "-d", "2", "-o", str(out)),
                             env=env(), capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
    return res, from_folded(out.read_text()), mine.pid, other.pid


def _debug_nonpython(prof, pid):
    out = {}
    for k, ns in prof.weights.items():
        if k.pid == pid and k.off_cpu is None and not any(f.kind is FrameKind.PYTHON for f in k.frames):
            out[";".join(f.name for f in k.frames[-6:])] = ns
    return sorted(out.items(), key=lambda x: -x[1])[:8]


REUSED = """
import time
def reused_program_frame():
    end = time.thread_time() + {secs}
    while time.thread_time() < end:
        pass
reused_program_frame()
"""


def spawn_with_pid(argv, pid, tries=20):
    """Start argv as process `pid` (free again): the kernel gives the next
    PID after ns_last_pid.  Another fork on the machine can take it first:
    then try again.  None when it never worked."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(argv)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_a_reused_pid_is_never_walked_with_the_old_registration(tmp_path, bpf):
    # Two -p targets: A spins 1.5 s and exits, B sleeps and keeps the
    # recording going.  Right after A is gone a new process takes A's PID:
    # the same interpreter (so the old registration would walk it and find
    # frames), another program.  BPF drops the registration at that fork;
    # nothing of the new program may appear, and no frame read with A's
    # facts after A was gone ([unknown code ...]).
    py = python_or_skip("pyenv-3.12")
    a = subprocess.Popen([py, os.path.join(WORKLOADS, "execs.py"), "after", "1.5"])
    b = subprocess.Popen([py, "-c", "import time; time.sleep(30)"])
    out = tmp_path / "reuse.folded"
    reused = None
    try:
        time.sleep(0.3)
        rec = subprocess.Popen(pyoffcpu_cmd("-p", str(a.pid), "-p", str(b.pid), "-d", "5",
                                            "-o", str(out)), env=env(), stderr=subprocess.PIPE, text=True)
        wait_for_recording(rec)
        a.wait(timeout=30)
        reused = spawn_with_pid([py, "-c", REUSED.format(secs=2.0)], a.pid)
        if reused is None:
            pytest.fail(f"could not start a process as PID {a.pid} (ns_last_pid)")
        stderr = rec.communicate(timeout=120)[1]
        assert rec.returncode == 0, stderr
    finally:
        for p in (a, b, reused):
            if p is not None:
                p.kill()
                p.wait()
    prof = from_folded(out.read_text())
    names = {f.name for k in prof.weights if k.pid == a.pid for f in k.frames
             if f.kind is FrameKind.PYTHON}
    assert "after_exec" in names, (names, stderr)      # A itself was profiled
    assert "reused_program_frame" not in names, names
    assert not any(n.startswith("[unknown code") for n in names), names


def test_a_container_is_found_with_its_frames_and_its_own_ids(tmp_path, bpf):
    # Debian testing's 3.14 as PID 1 of its own PID namespace, in its own
    # root (a container as the host sees one): -a finds it by its host PID,
    # reads its files through its root, and names its ids in both namespaces
    python_or_skip("debian-3.14")
    script = os.path.join(chroot_workloads(), "execs.py")
    box = subprocess.Popen(chroot_ns_cmd("debian-3.14", script, "after", SPIN_S))
    out = tmp_path / "box.folded"
    try:
        deadline = time.monotonic() + 30
        inner = None
        while inner is None and time.monotonic() < deadline:
            try:
                with open(f"/proc/{box.pid}/task/{box.pid}/children") as f:
                    kids = f.read().split()
                inner = int(kids[0]) if kids else None
            except OSError:
                pass
            time.sleep(0.05)
        assert inner, "the container's interpreter did not start"
        time.sleep(0.3)
        res = subprocess.run(pyoffcpu_cmd("-a", "-d", "2", "-o", str(out)), env=env(),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    finally:
        box.kill()
        box.wait()
    prof = from_folded(out.read_text())
    total, with_py, wrong = python_share(prof, inner)
    assert total > 0.3e9 and not wrong and with_py >= 0.95 * total, (total, with_py, wrong)
    assert prof.ns_ids.get(inner) == 1, prof.ns_ids.get(inner)


def test_unwind_rows_are_shared_by_the_processes_of_one_interpreter(bpf):
    # the tables of a file are written once, however many processes map it:
    # 100 processes of one interpreter and libc take the rows of one (<= 1.5x
    # allowed by the issue; a script of each own adds no executable mapping)
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    py = python_or_skip("pyenv-3.12")

    def rows_for(n):
        procs = [subprocess.Popen([py, "-c", "import time; print(1, flush=True); time.sleep(60)"],
                                  stdout=subprocess.PIPE) for _ in range(n)]
        try:
            for p in procs:             # every one started (100 take a while on two cores)
                p.stdout.readline()
            s = Session(Options(pids=[p.pid for p in procs], mode="cpu", duration=0.3), plat.probe())
            s.run()
            assert s.unwinder is not None
            return s.unwinder.rows_loaded
        finally:
            for p in procs:
                p.kill()
                p.wait()
    one, many = rows_for(1), rows_for(100)
    print(f"\nunwind rows: 1 process {one}, 100 processes {many}")
    assert one > 1000 and many <= 1.5 * one, (one, many)
