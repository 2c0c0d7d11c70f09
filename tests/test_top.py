"""pyoffcpu top through a real terminal (tmux): it renders, refreshes,
switches views, sorts, survives a resize, quits on q, and ends cleanly
when its target exits; --once prints one refresh."""
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

from conftest import Workload, env, pyoffcpu_cmd, python_or_skip


def tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True)


def screen(name):
    return tmux("capture-pane", "-p", "-t", name).stdout


def wait_for(name, pattern, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = screen(name)
        if re.search(pattern, text, re.M):
            return text
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} on the screen:\n" + screen(name))


@pytest.fixture
def terminal():
    if shutil.which("tmux") is None:
        if os.environ.get("PYOFFCPU_REQUIRE_BPF") == "1":
            pytest.fail("tmux is missing: `make test` installs it")
        pytest.skip("no tmux")
    name = f"pyoffcpu-top-{os.getpid()}"
    yield name
    tmux("kill-session", "-t", name)


def start_top(name, *args, width=140, height=45):
    e = env()
    cmd = " ".join(shlex.quote(a) for a in pyoffcpu_cmd("top", *args))
    shell = f"env PYTHONPATH={shlex.quote(e['PYTHONPATH'])} TERM=xterm {cmd}; echo EXIT=$?; sleep 60"
    res = tmux("new-session", "-d", "-s", name, "-x", str(width), "-y", str(height), shell)
    assert res.returncode == 0, res.stderr


def test_top_renders_refreshes_sorts_switches_and_quits(terminal, bpf):
    python = python_or_skip("pyenv-3.12")
    w = Workload(python, "split.py", 120)
    try:
        start_top(terminal, "-p", str(w.pid))
        first = wait_for(terminal, r"\[1\] \u2014 wall time")
        assert f"pyoffcpu top: pid {w.pid} python" in first
        later = wait_for(terminal, r"\[3\] \u2014 wall time")          # it refreshes
        assert "cpu_work (" in later and "on-CPU" in later and "sleep" in later, later
        assert re.search(rf"^\s+{w.pid} .* (S|R) ", later, re.M), later   # the thread table
        tmux("send-keys", "-t", terminal, "f")
        off = wait_for(terminal, r"\u2014 off-CPU time")
        rows = [ln for ln in off.splitlines() if re.match(r"^\s*\d+\.\d%", ln)]
        assert rows and all(" on-CPU " not in r for r in rows), off
        tmux("send-keys", "-t", terminal, "s")
        by_name = wait_for(terminal, r"off-CPU time, last [\d.]+ s, by name")
        rows = [ln.split(None, 4)[-1] for ln in by_name.splitlines() if re.match(r"^\s*\d+\.\d%", ln)]
        assert rows == sorted(rows), rows
        tmux("send-keys", "-t", terminal, "o")
        on = wait_for(terminal, r"\u2014 on-CPU time")
        rows = [ln for ln in on.splitlines() if re.match(r"^\s*\d+\.\d%", ln)]
        assert rows and all(" on-CPU " in r for r in rows), on
        # a smaller terminal: it draws within it
        tmux("resize-window", "-t", terminal, "-x", "80", "-y", "20")
        time.sleep(2.5)
        small = screen(terminal)
        assert "pyoffcpu top" in small and max(len(ln) for ln in small.splitlines()) <= 80, small
        print("\n" + later)                                 # the capture, for the note
        tmux("send-keys", "-t", terminal, "q")
        wait_for(terminal, r"^EXIT=0$", timeout=30)
    finally:
        w.stop()


def test_top_quits_cleanly_on_ctrl_c(terminal, bpf):
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "split.py", 120)
    try:
        start_top(terminal, "-p", str(w.pid))
        wait_for(terminal, r"\[2\] \u2014 wall time")
        tmux("send-keys", "-t", terminal, "C-c")
        text = wait_for(terminal, r"^EXIT=0$", timeout=30)
        assert "Traceback" not in text, text
    finally:
        w.stop()


def test_top_ends_cleanly_when_its_target_exits(terminal, bpf):
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "split.py", 4)
    try:
        start_top(terminal, "-p", str(w.pid))
        text = wait_for(terminal, r"^EXIT=0$", timeout=60)
        assert "pyoffcpu top: target exited" in text and "cpu_work" in text, text
    finally:
        w.stop()


def test_top_once_prints_one_refresh(bpf):
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "split.py", 60)
    try:
        res = subprocess.run(pyoffcpu_cmd("top", "-p", str(w.pid), "--once"), env=env(),
                             capture_output=True, text=True, timeout=120)
    finally:
        w.stop()
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"pyoffcpu top: pid {w.pid}") and "cpu_work (" in res.stdout, res.stdout
    res = subprocess.run(pyoffcpu_cmd("top"), env=env(), capture_output=True, text=True)
    assert res.returncode == 2 and "give -p PID or -a" in res.stderr
