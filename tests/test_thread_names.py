"""Python's thread names (threading's Thread.name) wherever a thread is
named, and `dump --locals`, on every supported interpreter
(workloads/named_threads.py: twelve named threads blocked in hold() with
known arguments and locals, one renamed during the recording)."""
import json
import os
import signal
import subprocess

import pytest

from conftest import (CHROOT_LABELS, MATRIX_LABELS, Workload, chroot_cmd, chroot_workloads, env,
                      pyoffcpu_cmd, python_or_skip, source_line, wait_for_recording)

LABELS = MATRIX_LABELS + ["debian-3.14", "debian-3.15"]
NAMES = ["worker-%d" % i for i in range(10)] + ["\u00fcn\u00efcode-\u540d\u524d"]


def start(label, seconds=60):
    python = python_or_skip(label)
    if label in CHROOT_LABELS:
        script = os.path.join(chroot_workloads(), "named_threads.py")
        w = Workload(None, "named_threads.py", argv=chroot_cmd(label, script, seconds))
    else:
        w = Workload(python, "named_threads.py", seconds)
    tids = {ln.split()[1]: int(ln.split()[2]) for ln in w.lines if ln.startswith("tid ")}
    return w, tids


def dump(pid, *args):
    res = subprocess.run(pyoffcpu_cmd("dump", "-p", str(pid), *args), env=env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("label", LABELS)
def test_threads_are_named_as_python_names_them(tmp_path, bpf, label):
    """The folded roots, the summary and dump name each thread by its Python
    name; the one renamed while recorded has one root, under its last name."""
    w, tids = start(label)
    out = tmp_path / "out.folded"
    try:
        proc = subprocess.Popen(pyoffcpu_cmd("-p", str(w.pid), "-d", "2", "-o", str(out)), env=env(),
                                stderr=subprocess.PIPE, text=True)
        wait_for_recording(proc)
        os.kill(w.pid, signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        d = json.loads(dump(w.pid, "--json"))
    finally:
        w.stop()
    roots = {ln.split(";")[1] for ln in out.read_text().splitlines()}
    for name in NAMES + ["MainThread"]:
        assert f"thread {tids[name]} {name}" in roots, (name, sorted(roots))
    renamed = tids["before-rename"]
    assert {r for r in roots if r.startswith(f"thread {renamed} ")} == {f"thread {renamed} after-rename"}
    assert "after-rename" in err and "worker-3" in err             # the summary's table
    by_tid = {t["tid"]: t for t in d["threads"]}
    for name in NAMES + ["MainThread", "after-rename"]:
        tid = tids.get(name, renamed)
        assert by_tid[tid]["name"] == name, by_tid[tid]
    # the OS's name beside it: the process's before 3.14, the Python name cut to 15 bytes after
    assert by_tid[tids["worker-0"]]["comm"] in (d["name"], "worker-0"), by_tid[tids["worker-0"]]


def test_speedscope_and_pprof_name_the_threads(tmp_path, bpf):
    w, tids = start("pyenv-3.12")
    try:
        res = subprocess.run(pyoffcpu_cmd("-p", str(w.pid), "-d", "1", "-o", str(tmp_path / "p.speedscope.json")),
                             env=env(), capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    finally:
        w.stop()
    profiles = [p["name"] for p in json.loads((tmp_path / "p.speedscope.json").read_text())["profiles"]]
    for name in NAMES + ["MainThread", "before-rename"]:
        assert any(p.startswith(f"{name} (tid {tids[name]})") for p in profiles), (name, profiles)


@pytest.mark.parametrize("label", LABELS)
def test_dump_locals_shows_each_frames_arguments_and_locals(label):
    w, tids = start(label)
    try:
        d = json.loads(dump(w.pid, "--locals", "--json"))
        text = dump(w.pid, "--locals")
    finally:
        w.stop()
    t = {t["tid"]: t for t in d["threads"]}[tids["worker-4"]]
    hold = next(f for f in t["locals"] if f["frame"].startswith("hold ("))
    got = {v["name"]: (v["argument"], v["repr"]) for v in hold["locals"]}
    assert got == {"count": (True, "42"), "label": (True, "'hello'"), "blob": (True, "b'xxxxxxxxxx'"),
                   "rest": (True, "()"), "opts": (True, "{}"), "total": (False, "84"),
                   "items": (False, "[1, 2, 3]"), "mapping": (False, "{'k': None}")}, got
    values = {v["name"]: v["value"] for v in hold["locals"]}
    assert values["count"] == {"type": "int", "value": 42}
    assert values["label"] == {"type": "str", "value": "hello", "length": 5}
    assert values["items"]["length"] == 3 and [i["value"] for i in values["items"]["items"]] == [1, 2, 3]
    assert hold["source"] == "go.wait(END - time.monotonic())     # HOLD"
    assert hold["frame"].endswith(f"named_threads.py:{source_line('named_threads.py', '# HOLD')})")
    # the text: the frame, its source line, then its arguments and locals
    block = text.split(f"thread {tids['worker-4']} worker-4:", 1)[1].split("\nthread ", 1)[0]
    lines = [ln.strip() for ln in block.splitlines()]
    i = next(i for i, ln in enumerate(lines) if ln.startswith("hold ("))
    assert lines[i + 1:i + 10] == ["> go.wait(END - time.monotonic())     # HOLD", "arg count = 42",
                                   "arg label = 'hello'", "arg blob = b'xxxxxxxxxx'", "arg rest = ()",
                                   "arg opts = {}", "total = 84", "items = [1, 2, 3]",
                                   "mapping = {'k': None}"], lines[i:i + 10]
