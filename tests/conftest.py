"""Shared fixtures: real BPF recordings of real processes.

With PYOFFCPU_REQUIRE_BPF=1 (CI) every skip is turned into a failure: the BPF
tests must run for real there, and so must everything they depend on.
"""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = os.path.join(ROOT, "tests", "workloads")
REQUIRE_BPF = os.environ.get("PYOFFCPU_REQUIRE_BPF") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_BPF and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under PYOFFCPU_REQUIRE_BPF=1: {reason}"


def bpf_unavailable_reason():
    if os.geteuid() != 0:
        return "needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc (python3-bpfcc) not importable"
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "no kernel BTF"
    return None


@pytest.fixture(scope="session")
def bpf():
    reason = bpf_unavailable_reason()
    if reason:
        pytest.skip(reason)


def pyenv_python(minor: str):
    """The newest pyenv CPython X.Y on this machine, or None."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(os.path.join(root, "versions", minor + ".*", "bin", "python" + minor)),
                   key=lambda p: [int(x) for x in p.split("/versions/")[1].split("/")[0].split(".")
                                  if x.isdigit()])
    return found[-1] if found else None


# The interpreters issue 2 names: pyenv's (shared libpython) and Debian's (static).
PYTHONS = {
    "pyenv-3.11": lambda: pyenv_python("3.11"),
    "debian-3.11": lambda: "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else None,
}


def python_or_skip(label):
    path = PYTHONS[label]()
    if not path:
        pytest.skip(f"{label} not installed")
    return path


def pyoffcpu_cmd(*args):
    return [sys.executable, "-m", "pyoffcpu", *args]


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(ROOT, "pytool") + os.pathsep + e.get("PYTHONPATH", "")
    return e


class Workload:
    """A workload process that prints `ready` once set up."""

    def __init__(self, python, script, *args):
        self.proc = subprocess.Popen([python, os.path.join(WORKLOADS, script), *map(str, args)],
                                     stdout=subprocess.PIPE, text=True)
        self.lines = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{script} exited before it was ready")
            line = line.strip()
            if line == "ready":
                break
            self.lines.append(line)

    @property
    def pid(self):
        return self.proc.pid

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def run_pyoffcpu(*args, timeout=120):
    return subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, text=True,
                          timeout=timeout)


def record_folded(tmp_path, *args, name="out.folded"):
    """Run pyoffcpu to a folded file; returns (CompletedProcess, Profile)."""
    from pyoffcpu.profile import from_folded
    out = tmp_path / name
    res = run_pyoffcpu("-o", str(out), *args)
    assert res.returncode == 0, res.stderr
    return res, from_folded(out.read_text())


def wait_for_recording(proc, timeout=60):
    """Read pyoffcpu's stderr until it says it is recording (BPF attached)."""
    import select
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stderr], [], [], 0.5)
        if r:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("pyoffcpu: recording"):
                return
    raise AssertionError("pyoffcpu did not start recording: " + "".join(seen))
