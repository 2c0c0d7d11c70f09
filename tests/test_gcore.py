"""`dump --core` on a core that gdb's gcore wrote of a live process (it
leaves out the read-only file mappings a kernel core keeps as empty
segments: code, .rodata, read from the files NT_FILE names): the same
threads, names and Python stacks as `dump -p` on that process, and
--locals from the core's memory.  Debian's python3.11 (static, non-PIE),
a pyenv build (PIE, shared libpython) and the chroot's 3.14 and 3.15."""
import json
import os
import shutil
import subprocess

import pytest

from conftest import (CHROOT, CHROOT_LABELS, Workload, chroot_cmd, chroot_workloads, env, pyoffcpu_cmd,
                      python_or_skip)

LABELS = ["debian-3.11", "pyenv-3.12", "debian-3.14", "debian-3.15"]


def python_frames(t):
    return [f for f in t["frames"] if " (" in f and f.endswith(")")]


@pytest.mark.parametrize("label", LABELS)
def test_a_gcore_dumps_as_the_live_process(tmp_path, bpf, label):
    if shutil.which("gcore") is None:
        pytest.fail("gcore (Debian's gdb) is not installed: make test installs it")
    python = python_or_skip(label)
    few_arenas = {"MALLOC_ARENA_MAX": "1"}      # no 64 MiB arena per thread in the core
    if label in CHROOT_LABELS:
        script = os.path.join(chroot_workloads(), "named_threads.py")
        w = Workload(None, "named_threads.py", argv=chroot_cmd(label, script, 120), env=few_arenas)
        root = ["--root", CHROOT]
    else:
        w = Workload(python, "named_threads.py", 120, env=few_arenas)
        root = []
    try:
        live = subprocess.run(pyoffcpu_cmd("dump", "-p", str(w.pid), "--json", "--native"), env=env(),
                              capture_output=True, text=True, timeout=60)
        assert live.returncode == 0, live.stderr
        g = subprocess.run(["gcore", "-o", str(tmp_path / "core"), str(w.pid)], capture_output=True,
                           text=True, timeout=180)
        assert g.returncode == 0, g.stdout + g.stderr
    finally:
        w.stop()
    core = tmp_path / f"core.{w.pid}"
    res = subprocess.run(pyoffcpu_cmd("dump", "--core", str(core), "--json", "--locals", *root), env=env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    dead, alive = json.loads(res.stdout), json.loads(live.stdout)
    assert dead["python"] == alive["python"] and dead["fatal"] is None, dead["notes"]
    assert any("gcore" in n for n in dead["notes"]), dead["notes"]
    # the chroot's glibc (2.42+) keeps a thread's stack guard inside its
    # stack's mapping, and gdb 13's gcore then writes that stack as zeros:
    # the dump says so, and keeps the Python frames before the first one on
    # the C stack (3.12+); the main thread's stack is whole
    blank = any("hold only zeros" in n for n in dead["notes"])
    assert blank == (label in CHROOT_LABELS), dead["notes"]
    by_tid = {t["tid"]: t for t in dead["threads"]}
    assert set(by_tid) == {t["tid"] for t in alive["threads"]}
    for t in alive["threads"]:
        d = by_tid[t["tid"]]
        assert d["name"] == t["name"], (d["name"], t["name"])
        want = python_frames(t)
        if blank and t["name"] != "MainThread":
            want = want[:len(python_frames(d))]
            assert len(want) >= 3 and want[2].startswith("hold ("), python_frames(d)
        else:
            assert "[unknown]" not in d["frames"][:3], d["frames"]     # native frames named
        assert python_frames(d) == want, (t["name"], "\n".join(d["frames"]), "\n".join(t["frames"]))
    worker = next(t for t in dead["threads"] if t["name"] == "worker-1")
    hold = next(f for f in worker["locals"] if f["frame"].startswith("hold ("))
    assert {v["name"]: v["repr"] for v in hold["locals"]}["label"] == "'hello'"
