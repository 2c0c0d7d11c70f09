"""pyoffcpu dump: every thread's stack of a live process without stopping
it (workloads/deadlock.py: a lock-order inversion, a pthread mutex held by
one thread and wanted by another, a thread spinning in C with the GIL, a
sleeper), on every supported interpreter."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import (CHROOT_LABELS, MATRIX_LABELS, Workload, chroot_cmd, chroot_workloads, env,
                      pyoffcpu_cmd, python_or_skip, source_line)

LABELS = MATRIX_LABELS + ["debian-3.14", "debian-3.15"]


def start(label, *args):
    python = python_or_skip(label)
    if label in CHROOT_LABELS:
        script = os.path.join(chroot_workloads(), "deadlock.py")
        w = Workload(None, "deadlock.py", argv=chroot_cmd(label, script, *args))
    else:
        w = Workload(python, "deadlock.py", *args)
    tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
    time.sleep(0.5)                             # the spinner takes the GIL at 0.3 s
    return w, tids


def dump(pid, *args):
    res = subprocess.run(pyoffcpu_cmd("dump", "-p", str(pid), "--json", *args), env=env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def state(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(ln.split()[1] for ln in f if ln.startswith("State:"))


def innermost_python(t):
    return next((f for f in t["frames"] if "(" in f and f.endswith(")")), None)


@pytest.mark.parametrize("label", LABELS)
def test_a_deadlock_is_dumped_and_left_as_it_was(label):
    w, tids = start(label)
    try:
        d = dump(w.pid)
        again = dump(w.pid)
        # the process is not stopped, not killed, and still deadlocked
        assert state(w.pid) != "T" and w.proc.poll() is None
    finally:
        w.stop()
    threads = {t["tid"]: t for t in d["threads"]}
    for name, mark in (("first", "# FIRST_BLOCKS"), ("second", "# SECOND_BLOCKS")):
        t = threads[tids[name]]
        line = source_line("deadlock.py", mark)
        assert innermost_python(t).startswith(f"{name} (") and \
            innermost_python(t).endswith(f"deadlock.py:{line})"), t["frames"]
        assert t["state"] in "SD" and t["syscall"] == "futex", t
        assert t["lock"]["owner"] is None and not t["lock"].get("gil"), t["lock"]
        assert t["idle_s"] is not None and t["idle_s"] >= 0.3, t
        assert any(k.startswith("futex") for k in t["kernel"]), t["kernel"]
    for name in ("first", "second"):
        a = {t["tid"]: t for t in again["threads"]}[tids[name]]
        assert a["frames"] == threads[tids[name]]["frames"] and a["state"] in "SD"
    # the GIL: the thread spinning in C holds it, the sleeper does not
    assert d["gil_holder"] == tids["spinner"], d["gil"]
    assert threads[tids["spinner"]]["holds_gil"] is True
    assert threads[tids["sleeper"]]["holds_gil"] is False
    assert innermost_python(threads[tids["spinner"]]).endswith(
        f"deadlock.py:{source_line('deadlock.py', '# SPIN_IN_C')})")
    # a pthread mutex names its owner
    waiter = threads[tids["waiter"]]
    assert waiter["lock"]["owner"] == tids["holder"], waiter["lock"]


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_native_frames_interleave_with_the_python_ones(label):
    w, tids = start(label)
    try:
        d = dump(w.pid, "--native")
    finally:
        w.stop()
    t = {t["tid"]: t for t in d["threads"]}[tids["first"]]
    frames = t["frames"]
    py = frames.index(innermost_python(t))
    assert py > 0 and any("acquire" in f for f in frames[:py]), frames      # the C lock under it
    assert any("sem_wait" in f or "futex" in f for f in frames[:py]), frames
    assert frames[-1] in ("clone3", "clone", "start_thread"), frames


def test_the_text_output_and_bad_input(tmp_path):
    w, tids = start("pyenv-3.12")
    try:
        res = subprocess.run(pyoffcpu_cmd("dump", "-p", str(w.pid)), env=env(), capture_output=True,
                             text=True, timeout=60)
    finally:
        w.stop()
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"the GIL: held by thread {tids['spinner']}" in out
    assert f"thread {tids['spinner']} " in out and "HOLDS THE GIL" in out
    assert f"waiting on a lock held by thread {tids['holder']}" in out
    res = subprocess.run(pyoffcpu_cmd("dump", "-p", "999999999"), env=env(), capture_output=True,
                         text=True)
    assert res.returncode == 1 and res.stderr.startswith("pyoffcpu: error: no such process"), res.stderr
    assert "Traceback" not in res.stderr


def test_subprocesses_are_dumped_too():
    python = python_or_skip("pyenv-3.11")
    code = ("import subprocess, sys, time\n"
            f"c = subprocess.Popen([sys.executable, {os.path.join(os.path.dirname(__file__), 'workloads', 'deadlock.py')!r}, 'nospin'], stdout=subprocess.PIPE)\n"
            "while c.stdout.readline().strip() != b'ready': pass\n"
            "print('ready', flush=True)\ntime.sleep(120)\n")
    w = Workload(python, None, argv=[python, "-c", code])
    try:
        res = subprocess.run(pyoffcpu_cmd("dump", "-p", str(w.pid), "--json", "--subprocesses"), env=env(),
                             capture_output=True, text=True, timeout=60)
    finally:
        with open(f"/proc/{w.pid}/task/{w.pid}/children") as f:
            child_pids = [int(c) for c in f.read().split()]
        w.stop()
        for c in child_pids:            # the deadlocked child outlives its parent otherwise
            os.kill(c, signal.SIGKILL)
    assert res.returncode == 0, res.stderr
    dumps = json.loads(res.stdout)
    assert len(dumps) == 2 and dumps[0]["pid"] == w.pid
    child = dumps[1]
    assert any(innermost_python(t) and innermost_python(t).startswith("first (") for t in child["threads"])
