"""--async and dump --async on real asyncio programs (workloads/async_tasks.py),
on 3.11, 3.12, 3.13 (pyenv), Debian's static 3.11, and the chroot's 3.14 and
3.15: each task's share of its time (running, awaiting) against the
workload's own clock, what each waits on, and a deadlocked pair named."""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import (CHROOT_LABELS, Workload, chroot_cmd, chroot_workloads, env, pyoffcpu_cmd,
                      python_or_skip, record_folded, wait_for_recording)

LABELS = ["pyenv-3.11", "pyenv-3.12", "pyenv-3.13", "debian-3.11", "debian-3.14", "debian-3.15"]
# what each task of the workload awaits (asyncio_tasks.KINDS names it)
AWAITS = {"ticker": "await: sleep", "consumer": "await: queue", "client": "await: socket read"}


def start(label, *args):
    python = python_or_skip(label)
    if label in CHROOT_LABELS:
        script = os.path.join(chroot_workloads(), "async_tasks.py")
        return Workload(None, "async_tasks.py", argv=chroot_cmd(label, script, *args))
    return Workload(python, "async_tasks.py", *args)


def splits(lines, kind="split"):
    """The workload's own account: name -> (running s, awaiting s, total s),
    over its whole run (split) or between its two SIGUSR1 marks (window)."""
    out = {}
    for ln in lines:
        m = re.match(kind + r" (\S+) running=(\S+) awaiting=(\S+) total=(\S+)", ln)
        if m:
            out[m.group(1)] = tuple(float(m.group(i)) for i in (2, 3, 4))
    return out


def task_times(prof, pid):
    """task root -> {state: ns} (`running`, `await: KIND`, `ready`); and the
    loop thread's own wall time."""
    from pyoffcpu.profile.model import TASK_PREFIXES, is_task_wait
    tasks, loop_wall = {}, 0
    for key, ns in prof.weights.items():
        if key.tid == pid and not is_task_wait(key.off_cpu):
            loop_wall += ns
        if not key.frames or not key.frames[0].name.startswith(TASK_PREFIXES):
            continue
        state = key.off_cpu if is_task_wait(key.off_cpu) else "running"
        by = tasks.setdefault(key.frames[0].name, {})
        by[state] = by.get(state, 0) + ns
    return tasks, loop_wall


@pytest.mark.parametrize("label", LABELS)
def test_task_shares(bpf, tmp_path, label):
    """Every task's running and awaiting shares within 3 pp of its own
    clock's over the recording's 4 s (the workload marks them when told the
    recording started and 4 s later), every task's time within 1% of the
    recording (they all live through it), each await of the kind it is, and
    the loop thread's profile unchanged in total."""
    from pyoffcpu.profile.model import from_folded
    w = start(label, "split", "60")
    out = tmp_path / "out.folded"
    try:
        rec = subprocess.Popen(pyoffcpu_cmd("-o", str(out), "-p", str(w.pid), "--async", "-d", "4"),
                               env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_recording(rec)
            w.proc.send_signal(signal.SIGUSR1)
            time.sleep(4.0)
            w.proc.send_signal(signal.SIGUSR1)
            rec.wait(timeout=120)
            err = rec.stderr.read()
        finally:
            rec.kill()
        assert rec.returncode == 0, err
        w.proc.send_signal(signal.SIGTERM)
        w.proc.wait(timeout=60)
        own = splits(w.proc.stdout.read().splitlines(), "window")
    finally:
        w.stop()
    prof = from_folded(out.read_text())
    assert set(own) == {"cpu", "ticker", "consumer", "client"}, own
    tasks, loop_wall = task_times(prof, w.pid)
    assert 3.5e9 < loop_wall < 4.5e9, loop_wall
    for name, (run, awaiting, total) in own.items():
        by = tasks.get("task " + name)
        assert by, (name, sorted(tasks))
        ns = sum(by.values())
        assert abs(ns - loop_wall) <= 0.01 * loop_wall, (name, by, loop_wall)
        share = by.get("running", 0) / ns
        print(f"{label} {name}: running {share:.4f} in the profile, {run / total:.4f} by its clock")
        assert abs(share - run / total) <= 0.03, (name, by, own[name])
        waited = sum(v for k, v in by.items() if k != "running") / ns
        assert abs(waited - awaiting / total) <= 0.03, (name, by, own[name])
        if name in AWAITS:
            assert by.get(AWAITS[name], 0) >= 0.8 * sum(
                v for k, v in by.items() if k.startswith("await: ")), (name, by)
    # the running task's stacks keep their frames under the task's root
    cpu = [k for k in prof.weights if k.frames and k.frames[0].name == "task cpu"
           and k.off_cpu is None]
    assert any(f.name == "compute_chunk" for k in cpu for f in k.frames), cpu[:3]
    assert all(k.frames[1].name == "cpu_task" for k in cpu), [k.frames[:3] for k in cpu[:3]]
    assert "asyncio tasks" in err


@pytest.mark.parametrize("label", LABELS)
def test_dump_async_names_the_cycle(bpf, label):
    """Two tasks awaiting each other: dump --async names the cycle, and says
    where each is suspended (the workload's line)."""
    w = start(label, "deadlock", "60")
    try:
        res = subprocess.run(pyoffcpu_cmd("dump", "-p", str(w.pid), "--async", "--json"),
                             env=env(), capture_output=True, text=True, timeout=60)
        text = subprocess.run(pyoffcpu_cmd("dump", "-p", str(w.pid), "--async"),
                              env=env(), capture_output=True, text=True, timeout=60)
    finally:
        w.stop()
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    names = {t["task"]: t["name"] for t in d["tasks"]}
    assert [sorted(names[a] for a in c) for c in d["cycles"]] == [["alpha", "beta"]], d
    by_name = {t["name"]: t for t in d["tasks"]}
    assert by_name["alpha"]["awaits"] == "task beta"
    assert by_name["beta"]["awaits"] == "task alpha"
    assert by_name["alpha"]["frames"][0]["function"] == "waits_on"
    assert by_name["alpha"]["frames"][0]["line"] == _line("each waits here")
    assert "CYCLE: alpha -> beta -> alpha" in text.stdout or \
        "CYCLE: beta -> alpha -> beta" in text.stdout, text.stdout


def _line(marker):
    from conftest import source_line
    return source_line("async_tasks.py", marker)


def test_async_refused_where_it_cannot_work(bpf):
    res = subprocess.run(pyoffcpu_cmd("-a", "--async", "-d", "1"), env=env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--async is for -p" in res.stderr
    res = subprocess.run(pyoffcpu_cmd("dump", "-p", str(os.getpid()), "--async"), env=env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "asyncio" in res.stderr and "Traceback" not in res.stderr


ASGI = ["uvicorn==0.32.1", "fastapi==0.115.6"]


def test_uvicorn_fastapi_await_on_dependency(bpf, tmp_path):
    """A FastAPI app under uvicorn (from PyPI) with 4 clients: each request's
    handler does 2 ms of CPU work and awaits a dependency that answers in
    30 ms.  The request tasks (folded by their coroutine: each lives 35 ms)
    spend most of the time they await anything on that socket read, and
    the profile says so."""
    import threading
    import urllib.request
    from conftest import cached_venv
    python = cached_venv("asgi", python_or_skip("pyenv-3.12"), ASGI)
    w = Workload(python, "asgi_app.py", "60")
    port = int(next(ln.split()[1] for ln in w.lines if ln.startswith("port ")))
    stop = threading.Event()
    served = [0]

    def client():
        while not stop.is_set():
            urllib.request.urlopen(f"http://127.0.0.1:{port}/work", timeout=10).read()
            served[0] += 1
    clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for c in clients:
        c.start()
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "--async", "-d", "4", timeout=120)
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=15)
        w.stop()
    assert served[0] > 100, served
    tasks, _ = task_times(prof, w.pid)
    by = tasks.get("tasks in RequestResponseCycle.run_asgi")
    assert by, sorted(tasks)
    top = max(by, key=by.get)
    assert top == "await: socket read", by
    # of the time they awaited something, most went to that read (their
    # time ready and running is the machine's: under the CPU steal of a
    # CI run, ready was 2.7 s of 13.5 and the read 57% of all)
    awaited = sum(ns for state, ns in by.items() if state.startswith("await: "))
    assert by[top] > 0.6 * awaited, by
    # the handler's frames are in it, under the request's coroutine
    reads = [k for k in prof.weights if k.frames and k.frames[0].name == "tasks in RequestResponseCycle.run_asgi"
             and k.off_cpu == "await: socket read"]
    assert any(f.name == "work" for k in reads for f in k.frames), reads[:2]


def test_find_cycles():
    from pyoffcpu.cpython.asyncio_tasks import find_cycles
    assert find_cycles({1: [2], 2: [1], 3: [1]}) == [[1, 2]]
    assert find_cycles({1: [2], 2: [3], 3: []}) == []
    assert find_cycles({5: [5]}) == [[5]]
    # around a gather: 1 awaits 2 and 3, both await 4, which awaits 1
    assert find_cycles({1: [2, 3], 2: [4], 3: [4], 4: [1]}) == [[1, 2, 4]]
    assert find_cycles({1: [2], 2: [1], 3: [4], 4: [3]}) == [[1, 2], [3, 4]]
