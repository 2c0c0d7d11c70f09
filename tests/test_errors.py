"""Everything a user can get wrong ends in one line on stderr and a non-zero
exit, never a traceback; signals and a target's exit still write the profile."""
import contextlib
import errno
import os
import re
import signal
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET

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
    assert "pyoffcpu doctor" in res.stderr      # an error about the machine names the command that checks it


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
    assert_one_line_error(res, 2, "give one of -p PID, -a, or a command")


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
    assert "cpu_work" in text and "[off-cpu: sleep]" in text


# -- a write that fails after the recording keeps the profile ---------------------
FALLBACK = re.compile(r"\(the profile was saved to (.+)\)$")


@contextlib.contextmanager
def full_filesystem(directory, size="2m"):
    """A real tmpfs of `size` mounted at `directory`, filled up to ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.makedirs(directory, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for chunk in (1 << 16, 4096, 1):
                while True:
                    try:
                        os.write(fd, bytes(chunk))
                    except OSError as e:
                        assert e.errno == errno.ENOSPC, e
                        break
        finally:
            os.close(fd)
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def fallback_of(res):
    """The fallback file the one error line names (after the summary)."""
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("pyoffcpu: error:")]
    assert len(errors) == 1, res.stderr
    assert errors[0] == lines[-1], res.stderr       # the summary comes first
    assert any(l.startswith("pyoffcpu: recorded") for l in lines), res.stderr
    assert not any(l.startswith("pyoffcpu: wrote") for l in lines), res.stderr
    m = FALLBACK.search(errors[0])
    assert m, errors[0]
    return errors[0], m.group(1)


def assert_svg_file(path):
    data = open(path, "rb").read()
    assert data.startswith(b"<?xml") or data.startswith(b"<svg"), data[:80]
    ET.fromstring(data)                 # complete, well-formed
    return data.decode()


def test_full_disk_saves_the_profile_to_the_temp_directory(tmp_path, bpf):
    python = python_or_skip("pyenv-3.11")
    full = tmp_path / "full"
    kept = None
    with full_filesystem(full):
        w = Workload(python, "split.py", 30)
        try:
            res = run_pyoffcpu("-p", str(w.pid), "-d", "1", "-o", str(full / "out.svg"))
        finally:
            w.stop()
        try:
            line, kept = fallback_of(res)
            assert f"cannot write {full / 'out.svg'}: No space left on device" in line, line
            assert os.path.dirname(kept) == tempfile.gettempdir(), kept
            assert os.path.basename(kept).startswith("pyoffcpu-fallback-out.svg.")
            assert kept.endswith(".svg"), kept
            assert os.path.getsize(kept) > 0
            assert "cpu_work" in assert_svg_file(kept)
            assert not (full / "out.svg").exists()
            assert sorted(os.listdir(full)) == ["filler"]   # no stray temp file
        finally:
            if kept and os.path.exists(kept):
                os.unlink(kept)


def test_output_directory_removed_during_the_recording(tmp_path, bpf):
    python = python_or_skip("pyenv-3.11")
    out_dir, temp = tmp_path / "out", tmp_path / "temp"
    out_dir.mkdir()
    temp.mkdir()
    w = Workload(python, "split.py", 30)
    try:
        proc = subprocess.Popen(pyoffcpu_cmd("-p", str(w.pid), "-d", "2", "-o", str(out_dir / "x.svg")),
                                env={**env(), "TMPDIR": str(temp)}, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_recording(proc)
            os.rmdir(out_dir)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        w.stop()
    res = subprocess.CompletedProcess(proc.args, proc.returncode, "", err)
    line, kept = fallback_of(res)
    assert f"cannot write {out_dir / 'x.svg'}: No such file or directory" in line, line
    assert os.path.dirname(kept) == str(temp), kept
    assert os.path.basename(kept).startswith("pyoffcpu-fallback-x.svg.") and kept.endswith(".svg")
    assert "cpu_work" in assert_svg_file(kept)


def _small_profile():
    from pyoffcpu.profile.model import from_folded
    return from_folded("process 42 python3;thread 42 MainThread;f (a.py:1) 10\n")


def test_fallback_keeps_the_format_of_an_explicit_format(tmp_path, monkeypatch):
    """-o out.txt --format svg: the fallback copy is named .svg, as it is one."""
    from pyoffcpu.export import write_profile_or_fallback
    from pyoffcpu.collect.platform import ProfilerError
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    with pytest.raises(ProfilerError) as exc:
        write_profile_or_fallback(_small_profile(), str(tmp_path / "gone" / "out.txt"), "svg")
    kept = FALLBACK.search(exc.value.line()).group(1)
    assert os.path.basename(kept).startswith("pyoffcpu-fallback-out.txt.") and kept.endswith(".svg")
    assert_svg_file(kept)
    assert oct(os.stat(kept).st_mode & 0o777) == "0o644"


def test_fallback_that_fails_too_says_both(tmp_path, monkeypatch):
    """Output and temp directory on the same full disk: one line saying both
    writes failed, and no stray files left."""
    from pyoffcpu.export import write_profile_or_fallback
    from pyoffcpu.collect.platform import ProfilerError
    full = tmp_path / "full"
    with full_filesystem(full):
        monkeypatch.setattr(tempfile, "tempdir", str(full))
        with pytest.raises(ProfilerError) as exc:
            write_profile_or_fallback(_small_profile(), str(full / "out.folded"))
        line = exc.value.line()
        assert line.startswith(f"pyoffcpu: error: cannot write {full / 'out.folded'}: "
                               "No space left on device; the fallback copy in "), line
        assert line.count("No space left on device") == 2, line
        assert "the profile is lost" in line and "\n" not in line
        assert sorted(os.listdir(full)) == ["filler"]
