"""Subinterpreters, with real BPF (workloads/subinterps.py, on every version
that has them: 3.12 and 3.13 from pyenv, Debian's 3.14 and 3.15 and the
free-threaded 3.13t in the chroot).

A thread that runs code in a subinterpreter has a thread state in each
interpreter: its stack is its frames in the main interpreter, the native
frames of the call between them, then its frames in the subinterpreter,
marked `[interpreter N]` (bpf/pywalk.c).  The GIL is counted per GIL: a
subinterpreter with its own has its own line in the summary, and no figure
is over 100% of the recording.

Ground truth, built into the workload: the spinner and sleeper threads
are inside run_in() and their subinterpreter's function for their whole
life; the main thread is inside main_spin(); the sleeper's subinterpreter
started a thread of its own, which is inside sub_thread() and has no
state in the main interpreter; the pool's 4 workers run pool_spin() for
ever.  Each share is checked to 95% (the rest: the moments a sample or a
switch lands where a stack is not read, e.g. a stack being changed)."""
import json
import os
import re

import pytest

from conftest import (CHROOT_LABELS, CHROOT_WORKLOADS, WORKLOADS, Workload, chroot_cmd,
                      chroot_workloads, python_or_skip, run_pyoffcpu)

LABELS = ["pyenv-3.12", "pyenv-3.13", "debian-3.14", "debian-3.15", "ft-3.13t"]
SECONDS = 3
SHARE = 0.95


def start(label, case):
    python = python_or_skip(label)
    if label in CHROOT_LABELS:
        script = os.path.join(chroot_workloads(), "subinterps.py")
        return Workload(None, "subinterps.py", argv=chroot_cmd(label, script, case),
                        env={"PYTHONPATH": CHROOT_WORKLOADS})
    return Workload(python, "subinterps.py", case, env={"PYTHONPATH": WORKLOADS})


def record(tmp_path, w, *args):
    """(speedscope document, {tid: [(frame names root first, ns)]}, stderr)."""
    out = tmp_path / "p.json"
    try:
        res = run_pyoffcpu("-p", str(w.pid), "-d", str(SECONDS), "-o", str(out), *args)
    finally:
        w.stop()
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    names = [f["name"] for f in doc["shared"]["frames"]]
    by_tid = {}
    for p in doc["profiles"]:
        m = re.search(r"\(tid (\d+)\)", p["name"])
        if m:
            by_tid[int(m.group(1))] = [([names[i] for i in s], ns)
                                       for s, ns in zip(p["samples"], p["weights"])]
    return doc, by_tid, res.stderr


def share(stacks, *sequence):
    """The share of a thread's time whose stack holds `sequence` in this
    order, root first (not necessarily adjacent)."""
    def has(frames):
        i = 0
        for f in frames:
            if i < len(sequence) and (f == sequence[i] or
                                      (sequence[i].endswith("*") and f.startswith(sequence[i][:-1]))):
                i += 1
        return i == len(sequence)
    total = sum(ns for _, ns in stacks)
    return sum(ns for frames, ns in stacks if has(frames)) / total if total else 0.0


def tids_of(w):
    return {ln.split()[1]: w.host_ids()(int(ln.split()[2])) for ln in w.lines if ln.startswith("tid ")}


def check_gil_lines(doc, stderr):
    """No GIL figure over 100% of the recording: the summary's lines, and
    per process and GIL the threads' held times."""
    dur = doc["pyoffcpu"]["duration_ns"]
    for pct in re.findall(r"GIL held .* recorded \((\d+)%\)", stderr):
        assert int(pct) <= 100, stderr
    held = {}
    for t in doc["pyoffcpu"]["threads"]:
        for gil, ns in t.get("gil_ns", {}).get("held_by_interpreter_gil_ns", {}).items():
            held[gil] = held.get(gil, 0) + ns
    for gil, ns in held.items():
        assert ns <= 1.01 * dur, (gil, ns, dur)
    return held


@pytest.mark.parametrize("label", LABELS)
def test_threads_across_interpreters(tmp_path, bpf, label):
    w = start(label, "threads")
    tids = tids_of(w)
    doc, by_tid, stderr = record(tmp_path, w)
    got = {
        "main": share(by_tid[tids["main"]], "main_spin"),
        "spinner outer+inner": share(by_tid[tids["spinner"]], "run_in", "[interpreter *",
                                     "sub_spin"),
        "sleeper outer+inner": share(by_tid[tids["sleeper"]], "run_in", "[interpreter *",
                                     "sub_sleep"),
        "sub_thread": share(by_tid[tids["sub_thread"]], "[interpreter *", "sub_thread"),
    }
    held = check_gil_lines(doc, stderr)
    print(f"\n{label}: shares {got}; GIL held by interpreter {held}")
    assert all(v >= SHARE for v in got.values()), (got, stderr)
    # the two subinterpreters are two interpreters, neither the main one
    marks = {f for s, _ in by_tid[tids["spinner"]] + by_tid[tids["sleeper"]]
             for f in s if f.startswith("[interpreter ")}
    assert len(marks) == 2 and "[interpreter 0]" not in marks, marks
    if label != "ft-3.13t":
        # both made with their own GIL (the default): three GILs, each held
        # by its spinner nearly all the time (the sleeper's hardly ever)
        assert "(own GIL)" in stderr, stderr
        dur = doc["pyoffcpu"]["duration_ns"]
        assert held.get("0", 0) >= 0.5 * dur, held
        assert sorted(held.values())[-2] >= 0.5 * dur, held      # the spinner's own GIL
    assert "subinterpreters not marked" not in stderr, stderr


@pytest.mark.parametrize("label", ["debian-3.14", "debian-3.15"])
def test_interpreter_pool_workers(tmp_path, bpf, label):
    w = start(label, "pool")
    tids = tids_of(w)
    doc, by_tid, stderr = record(tmp_path, w)
    workers = {t: s for t, s in by_tid.items() if t != tids["main"] and share(s, "pool_spin") > 0}
    assert len(workers) == 4, (sorted(by_tid), stderr)
    total = sum(ns for s in workers.values() for _, ns in s)
    under = sum(share(s, "[interpreter *", "pool_spin") * sum(ns for _, ns in s)
                for s in workers.values())
    print(f"\n{label}: {under / total:.3f} of the workers' time under [interpreter N];pool_spin")
    assert under / total >= SHARE, stderr
    check_gil_lines(doc, stderr)


@pytest.mark.parametrize("label", ["pyenv-3.13", "debian-3.14"])
def test_dump_shows_both_parts(bpf, label):
    w = start(label, "threads")
    tids = tids_of(w)
    try:
        res = run_pyoffcpu("dump", "-p", str(w.pid), "--json")
        text = run_pyoffcpu("dump", "-p", str(w.pid))
    finally:
        w.stop()
    assert res.returncode == 0 and text.returncode == 0, res.stderr + text.stderr
    threads = {t["tid"]: t for t in json.loads(res.stdout)["threads"]}
    spinner = threads[tids["spinner"]]
    frames = [re.sub(r" \(.*", "", f) for f in spinner["frames"]]     # innermost first
    inner, mark, outer = frames.index("sub_spin"), frames.index(next(
        f for f in frames if f.startswith("[interpreter "))), frames.index("run_in")
    assert inner < mark < outer, frames
    assert len(spinner["interpreters"]) == 2 and spinner["interpreters"][-1] == 0, spinner
    assert threads[tids["main"]]["interpreters"] == []
    sub_thread = threads[tids["sub_thread"]]
    assert sub_thread["interpreters"][0] > 0, sub_thread
    # the text names each thread's interpreters and its GIL
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith(f"thread {tids['spinner']} "))
    assert re.search(r"in interpreters \d+ < 0", line), line
    assert "own GIL" in text.stdout.splitlines()[0], text.stdout.splitlines()[0]


def test_crash_in_a_subinterpreter(tmp_path, bpf):
    """The crash watcher's report of a thread that aborts inside a
    subinterpreter: its frames there, the mark, its frames in the main
    interpreter; and the main thread, from the main interpreter's list."""
    import subprocess
    import time
    from conftest import env, pyoffcpu_cmd
    python = python_or_skip("pyenv-3.13")
    watcher = subprocess.Popen(pyoffcpu_cmd("crashes", "--dir", str(tmp_path), "--count", "1",
                                            "--match", "subinterps", "-d", "60"),
                               env=env(), stderr=subprocess.PIPE, text=True)
    try:
        line = watcher.stderr.readline()
        assert "watching" in line, line
        proc = subprocess.Popen([python, os.path.join(WORKLOADS, "subinterps.py"), "crash"],
                                stdout=subprocess.DEVNULL,
                                preexec_fn=lambda: __import__("resource").setrlimit(
                                    __import__("resource").RLIMIT_CORE, (0, 0)))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        reports = []
        while not reports and time.monotonic() < deadline:
            time.sleep(0.5)
            reports = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                       if f.endswith(".crash.txt")]
    finally:
        watcher.terminate()
        watcher.wait(timeout=30)
    assert reports, "no crash report"
    text = open(reports[0]).read()
    frames = [ln.strip() for ln in text.splitlines() if ln.startswith("    ")]
    names = [re.sub(r" \(.*", "", f) for f in frames]
    assert names.index("sub_crash") < names.index(next(f for f in names if f.startswith("[interpreter "))) \
        < names.index("run_in"), text
    assert "crash_case" in names, text         # the main thread, from the main interpreter's list
    assert re.search(r"in interpreters \d+ < 0", text), text
