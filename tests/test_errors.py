"""Everything a user can get wrong ends in one line on stderr and a non-zero
exit, never a traceback; signals and a target's exit still write the profile."""
import os
import signal
import subprocess
import time

import pytest

from conftest import (Workload, env, pyoffcpu_cmd, python_or_skip, run_pyoffcpu,
                      wait_for_recording)


def assert_one_line_error(res, code=1, contains=""):
    assert res.returncode == code, (res.returncode, res.stderr)
    err = [l for l in res.stderr.splitlines() if l.strip()]
    assert "Traceback" not in res.stderr
    errors = [l for l in err if l.startswith("pyoffcpu: error:") or l.startswith("Error:")]
    assert len(errors) == 1, res.stderr
    assert contains in errors[0], errors[0]


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_no_such_pid(tmp_path):
    res = run_pyoffcpu("-p", str(dead_pid()), "-o", str(tmp_path / "x.svg"))
    assert_one_line_error(res, 1, "no such process")


def test_not_root(tmp_path):
    if os.geteuid() != 0:
        res = run_pyoffcpu("-p", str(os.getpid()), "-o", "/tmp/pyoffcpu-notroot.svg")
    else:
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              *pyoffcpu_cmd("-p", str(os.getpid()), "-o", "/tmp/pyoffcpu-notroot.svg")],
                             env=env(), capture_output=True, text=True, timeout=60)
    assert_one_line_error(res, 1, "needs root")


def test_unwritable_output(bpf):
    res = run_pyoffcpu("-p", str(os.getpid()), "-d", "1", "-o", "/proc/pyoffcpu.svg")
    assert_one_line_error(res, 1, "cannot write")


def test_missing_output_directory(tmp_path):
    res = run_pyoffcpu("-p", str(os.getpid()), "-o", str(tmp_path / "no" / "such" / "dir.svg"))
    assert_one_line_error(res, 1, "cannot write")


def test_unknown_extension_is_a_usage_error(tmp_path):
    res = run_pyoffcpu("-p", str(os.getpid()), "-o", str(tmp_path / "x.png"))
    assert_one_line_error(res, 2)


def test_pid_and_command_together_is_a_usage_error():
    res = run_pyoffcpu("-p", "1", "--", "true")
    assert_one_line_error(res, 2, "either -p PID or a command")


def test_no_btf(tmp_path, bpf):
    res = subprocess.run(pyoffcpu_cmd("-p", str(os.getpid()), "-d", "1", "-o", str(tmp_path / "x.svg")),
                         env={**env(), "PYOFFCPU_BTF": "/nonexistent/vmlinux"},
                         capture_output=True, text=True, timeout=60)
    assert_one_line_error(res, 1, "BTF")


def test_no_tracefs(tmp_path, bpf):
    res = subprocess.run(pyoffcpu_cmd("-p", str(os.getpid()), "-d", "1", "-o", str(tmp_path / "x.svg")),
                         env={**env(), "PYOFFCPU_TRACEFS": str(tmp_path / "no-tracefs")},
                         capture_output=True, text=True, timeout=60)
    assert_one_line_error(res, 1, "tracefs")


def test_command_not_found(tmp_path, bpf):
    res = run_pyoffcpu("-o", str(tmp_path / "x.svg"), "--", "/nonexistent/program")
    assert_one_line_error(res, 1, "cannot run /nonexistent/program")


def test_non_python_target_is_profiled_natively(tmp_path, bpf):
    spin = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    out = tmp_path / "sh.folded"
    try:
        res = run_pyoffcpu("-p", str(spin.pid), "-d", "1.5", "-o", str(out))
    finally:
        spin.kill()
        spin.wait()
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert "is not a Python process: profiling native stacks only" in res.stderr
    lines = out.read_text().splitlines()
    assert lines and all(l.startswith(f"process {spin.pid} sh;") for l in lines)
    # sh's own code shows up by symbol or module (Debian's dash is stripped)
    assert any("dash" in l or "sh" in l.split(";")[-1] for l in lines), lines[:5]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_ends_the_recording_and_writes_the_profile(tmp_path, bpf, sig):
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "split.py", 30)
    out = tmp_path / "sig.folded"
    try:
        proc = subprocess.Popen(pyoffcpu_cmd("-o", str(out), "-p", str(w.pid)), env=env(),
                                stderr=subprocess.PIPE, text=True)
        wait_for_recording(proc)
        time.sleep(1.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        w.stop()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    text = out.read_text()
    assert "cpu_work" in text and "[off-cpu]" in text
