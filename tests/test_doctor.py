"""`pyoffcpu doctor`: every check a recording meets, one line each; each
failure the tests can arrange gives its line and a non-zero exit."""
import os
import re
import subprocess


from conftest import env, pyoffcpu_cmd

LINE = re.compile(r"^(ok|warn|FAIL)\s+([^:]+): (.+)$")
NEEDED = ("privileges", "kernel", "kernel BTF", "tracefs", "tracepoints", "kernel lockdown", "BPF", "perf events",
          "bcc", "kernel headers", "BPF programs", "cache directory", "kernel.bpf_stats_enabled")


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


def _no_bcc(tmp_path):
    """A `bcc` that cannot be imported, first on the path (as a venv without
    Debian's site-packages has none)."""
    fake = tmp_path / "nobcc" / "bcc"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('planted: no bcc here')\n")
    return {"PYTHONPATH": f"{fake.parent}{os.pathsep}{env()['PYTHONPATH']}"}


def _stale_package(tmp_path):
    """The package's compiled programs made stale: the BPF sources pointed
    at a copy of bpf/ with a comment added (PYOFFCPU_BPF_DIR), as a tree
    whose bpf/ changed after `make bpf-objects` is; none shipped is for it."""
    import shutil
    from conftest import ROOT
    d = tmp_path / "bpf"
    shutil.copytree(os.path.join(ROOT, "bpf"), d)
    with open(d / "pyoffcpu.h", "a") as f:
        f.write("\n/* changed */\n")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    return {"PYOFFCPU_BPF_DIR": str(d), "PYOFFCPU_CACHE_DIR": str(cache)}


HIDE_HEADERS = f'mount -t tmpfs none /lib/modules/{os.uname().release} && exec "$@"'


def test_doctor_without_bcc_or_headers_says_the_packages_programs_load_and_a_recording_agrees(bpf, tmp_path):
    """Issue 45: bcc not importable, the kernel headers hidden (an empty
    tmpfs over them in a mount namespace of its own), an empty cache: the
    package's programs load, so both are not needed, and a recording in
    the same setup works."""
    extra = dict(_no_bcc(tmp_path), PYOFFCPU_CACHE_DIR=str(tmp_path))
    hide = ("unshare", "-m", "--propagation", "private", "sh", "-c", HIDE_HEADERS, "sh")
    res, rows = doctor(*hide, extra_env=extra)
    assert res.returncode == 0 and not failed(rows), res.stdout + res.stderr
    assert rows["BPF programs"][0][0] == "ok" and rows["BPF programs"][0][1].startswith("the package's")
    assert rows["bcc"][0][0] == "ok" and "not needed" in rows["bcc"][0][1], res.stdout
    assert rows["kernel headers"][0][0] == "ok" and "not needed" in rows["kernel headers"][0][1], res.stdout
    rec = subprocess.run([*hide, *pyoffcpu_cmd("-p", str(os.getpid()), "-d", "0.5", "-o",
                                               str(tmp_path / "o.folded"))],
                         env=dict(env(), **extra), capture_output=True, text=True, timeout=120)
    assert rec.returncode == 0, rec.stderr


def test_doctor_without_the_packages_programs_or_bcc_fails_and_a_recording_agrees(bpf, tmp_path):
    """Stale shipped programs and no bcc: nothing loads, doctor says so, and
    a recording in the same setup fails as it says."""
    extra = dict(_no_bcc(tmp_path), **_stale_package(tmp_path))
    res, rows = doctor(extra_env=extra)
    assert res.returncode == 1, res.stdout
    assert rows["bcc"][0][0] == "warn" and rows["BPF programs"][0][0] == "FAIL", res.stdout
    assert "a recording would not work" in res.stderr
    rec = subprocess.run(pyoffcpu_cmd("-p", str(os.getpid()), "-d", "0.5", "-o", str(tmp_path / "o.folded")),
                         env=dict(env(), **extra), capture_output=True, text=True, timeout=120)
    assert rec.returncode != 0 and "cannot load the BPF programs" in rec.stderr, rec.stderr


def test_doctor_without_the_packages_programs_or_headers_fails(bpf, tmp_path):
    """Stale shipped programs, bcc there but no kernel headers: nothing to
    load, nothing to compile with."""
    res, rows = doctor("unshare", "-m", "--propagation", "private", "sh", "-c", HIDE_HEADERS, "sh",
                       extra_env=_stale_package(tmp_path))
    assert res.returncode == 1, res.stdout + res.stderr
    assert rows["kernel headers"][0][0] == "warn" and rows["BPF programs"][0][0] == "FAIL", res.stdout


def test_doctor_without_the_packages_programs_warns_that_bcc_compiles_them(bpf, tmp_path):
    res, rows = doctor(extra_env=_stale_package(tmp_path))
    assert res.returncode == 0, res.stdout
    assert rows["BPF programs"][0][0] == "warn", res.stdout
    assert "bcc compiles them at a recording's first start" in rows["BPF programs"][0][1], res.stdout


def test_doctor_with_everything_says_the_packages_programs_load(bpf):
    res, rows = doctor()
    assert rows["BPF programs"][0][0] == "ok", res.stdout
    assert re.match(r"the package's \(compiled when it was built\) load on this kernel: \d+ passed the "
                    r"verifier in [\d.]+ s; task_struct read by ", rows["BPF programs"][0][1]), res.stdout
    # how they read the kernel's structs: plain loads where BTF names the kfunc
    from pyoffcpu.collect import platform as plat
    reads = ("plain loads (bpf_rdonly_cast)" if plat.probe().kfunc_rdonly_cast_id
             else "bpf_probe_read_kernel (no bpf_rdonly_cast kfunc in this kernel's BTF)")
    assert rows["BPF programs"][0][1].endswith(reads), res.stdout
