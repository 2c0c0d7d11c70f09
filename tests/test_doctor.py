"""`pyoffcpu doctor`: every check a recording meets, one line each; each
failure the tests can arrange gives its line and a non-zero exit."""
import os
import re
import subprocess

import pytest

from conftest import env, pyoffcpu_cmd

LINE = re.compile(r"^(ok|warn|FAIL)\s+([^:]+): (.+)$")
NEEDED = ("privileges", "kernel BTF", "tracefs", "tracepoints", "kernel lockdown", "BPF", "perf events",
          "bcc", "kernel headers", "cache directory", "kernel.bpf_stats_enabled")


def doctor(*prefix, extra_env=None, args=()):
    res = subprocess.run([*prefix, *pyoffcpu_cmd("doctor", *args)], env=dict(env(), **(extra_env or {})),
                         capture_output=True, text=True, timeout=120)
    rows = {}
    for ln in res.stdout.splitlines():
        m = LINE.match(ln)
        if m:
            rows.setdefault(m.group(2), []).append((m.group(1), m.group(3)))
    assert "Traceback" not in res.stderr, res.stderr
    return res, rows


def failed(rows):
    return {k for k, v in rows.items() if any(s == "FAIL" for s, _ in v)}


def test_doctor_on_this_machine_says_a_recording_works(bpf):
    res, rows = doctor()
    assert res.returncode == 0, res.stdout + res.stderr
    assert set(NEEDED) <= set(rows), res.stdout
    assert not failed(rows), res.stdout
    assert "a recording would work" in res.stdout


def test_doctor_as_nobody_fails_on_privileges(bpf):
    res, rows = doctor("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    assert res.returncode == 1, res.stdout
    assert {"privileges", "BPF", "perf events"} <= failed(rows), res.stdout
    assert "run pyoffcpu with sudo" in dict(rows["privileges"])["FAIL"]
    assert "checks failed" in res.stderr


def test_doctor_without_tracefs_and_without_the_right_to_mount_it(bpf):
    """A container's case: root with CAP_BPF and CAP_PERFMON but not
    CAP_SYS_ADMIN, tracefs not mounted (in a mount namespace of its own)."""
    cmd = " ".join(pyoffcpu_cmd("doctor"))
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          "umount /sys/kernel/tracing 2>/dev/null; umount /sys/kernel/debug/tracing 2>/dev/null; "
                          f"exec setpriv --bounding-set -sys_admin --inh-caps -sys_admin {cmd}"],
                         env=env(), capture_output=True, text=True, timeout=120)
    rows = {m.group(2): m.group(1) for m in map(LINE.match, res.stdout.splitlines()) if m}
    assert res.returncode == 1, res.stdout + res.stderr
    assert rows["tracefs"] == "FAIL" and rows["privileges"] == "ok", res.stdout
    assert "mount -t tracefs tracefs /sys/kernel/tracing" in res.stdout
    # and the mount is still there outside that namespace
    assert os.path.exists("/sys/kernel/tracing/events")


def test_doctor_refuses_a_cache_directory_of_another_owner(tmp_path, bpf):
    d = tmp_path / "cache"
    (d / "bpf").mkdir(parents=True)
    os.chown(d / "bpf", 65534, 65534)
    res, rows = doctor(extra_env={"PYOFFCPU_CACHE_DIR": str(d)})
    assert res.returncode == 1, res.stdout
    assert failed(rows) == {"cache directory"}, res.stdout
    assert "owned by uid 65534" in dict(rows["cache directory"])["FAIL"]


def test_doctor_quiet_prints_only_what_is_not_ok(bpf):
    res, rows = doctor(args=("--quiet",))
    assert res.returncode == 0
    assert all(s != "ok" for v in rows.values() for s, _ in v), res.stdout
