"""pyoffcpu snapshot (cron), its index and retention, the lock, --gpu and
NVML, --print-cron, and pyoffcpu report, read in headless Chromium."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import WORKLOADS, Workload, chromium_or_skip, env, pyoffcpu_cmd, python_or_skip
from pyoffcpu.commands import snapshot as S
from pyoffcpu.export.pprof import from_pprof


def write(path, data=b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def entry(t, rel, size, d=None):
    """An index entry as snapshot writes it: the file's size and, when d has
    the file, its inode (retention deletes only the file it wrote)."""
    f = {"path": rel, "bytes": size}
    if d is not None and os.path.isfile(os.path.join(d, rel)):
        f["inode"] = os.stat(os.path.join(d, rel)).st_ino
    return {"time": t, "host": "h", "pid": 1, "name": "p", "files": {"svg": f}}


# -- retention, without BPF ------------------------------------------------------------
def test_retention_deletes_only_what_the_index_lists(tmp_path):
    d = str(tmp_path)
    now = time.time()
    old, new, big = "h/2026-11-01/000000-1-p.svg", "h/2026-11-30/000000-1-p.svg", "h/2026-11-29/0-1-p.svg"
    for rel, size in ((old, 10), (new, 10), (big, 3 << 20)):
        write(os.path.join(d, rel), b"x" * size)
    write(os.path.join(d, "h/2026-11-01/mine.txt"))             # not ours: stays
    write(str(tmp_path.parent / "outside.svg"))
    index = {"entries": [entry(now - 30 * 86400, old, 10, d), entry(now - 2 * 86400, big, 3 << 20, d),
                         entry(now - 3600, new, 10, d), entry(now - 40 * 86400, "../outside.svg", 1, d)],
             "runs": []}
    deleted = S.apply_retention(d, index, keep_days=7, max_total_mb=1, now=now)
    # the old one by age, the big one by size (oldest first), never the file outside DIR
    assert sorted(os.path.relpath(p, d) for p in deleted) == sorted([old, big])
    assert os.path.exists(os.path.join(d, "h/2026-11-01/mine.txt"))
    assert os.path.exists(str(tmp_path.parent / "outside.svg"))
    assert not os.path.exists(os.path.join(d, "h/2026-11-29"))  # emptied: removed
    assert [e["files"]["svg"]["path"] for e in index["entries"]] == [new]


def test_a_second_run_is_refused_while_the_lock_is_held(tmp_path):
    d = str(tmp_path)
    with S.DirLock(d):
        res = subprocess.run(pyoffcpu_cmd("snapshot", "--dir", d, "-d", "1"), env=env(),
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == S.EXIT_LOCKED, res
    assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "another snapshot is running" in res.stderr and str(os.getpid()) in res.stderr
    assert sorted(os.listdir(d)) == [".lock"]                  # it did nothing


def test_print_cron_units_pass_systemd_analyze(tmp_path):
    res = subprocess.run(pyoffcpu_cmd("snapshot", "--print-cron", "--gpu", "--dir", str(tmp_path),
                                      "--every", "10"), env=env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    cron = [ln for ln in text.splitlines() if ln.startswith("*/")]
    assert len(cron) == 1 and cron[0].startswith("*/10 * * * * /") and "snapshot" in cron[0]
    units = re.findall(r"# systemd: /etc/systemd/system/(\S+)\n(.*?)(?=\n# |\Z)", text, re.S)
    assert [u for u, _ in units] == ["pyoffcpu-snapshot.service", "pyoffcpu-snapshot.timer"]
    for name, body in units:
        (tmp_path / name).write_text(body)
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("no systemd-analyze")
    res = subprocess.run([exe, "verify", "--man=no", str(tmp_path / "pyoffcpu-snapshot.timer"),
                          str(tmp_path / "pyoffcpu-snapshot.service")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pyoffcpu-snapshot" not in res.stderr, res.stderr    # no warning about our units


# -- GPU facts ----------------------------------------------------------------------------
@pytest.fixture
def gpu_standin():
    """A process holding open a FIFO at /dev/nvidia-pyoffcpu-test-PID: the path
    --gpu looks for (/dev/nvidia*), not a name the NVIDIA driver uses."""
    path = f"/dev/nvidia-pyoffcpu-test-{os.getpid()}"
    if not os.access("/dev", os.W_OK):
        pytest.skip("needs root (a FIFO in /dev)")
    os.mkfifo(path)
    code = ("import os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nprint('ready', flush=True)\n"
            "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield p.pid, path
    finally:
        p.kill()
        p.wait()
        os.unlink(path)


def test_gpu_facts_of_a_process_holding_a_device_open(gpu_standin):
    pid, path = gpu_standin
    assert S.gpu_facts(pid) == {"devices": [path]}
    assert S.gpu_facts(os.getpid()) == {}


def test_nvml_absent_and_present_without_a_gpu(tmp_path):
    """Without nvidia-ml-py: no facts, a note; with it but no driver (this
    machine): the same, no traceback."""
    code = "from pyoffcpu.commands import snapshot as S; print(S.nvml_facts())"
    res = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    assert res.returncode == 0 and "nvidia-ml-py is not installed" in res.stdout, res
    target = tmp_path / "nvml"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--target", str(target), "nvidia-ml-py"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip("nvidia-ml-py cannot be installed here: " + pip.stderr[-200:])
    e = env()
    e["PYTHONPATH"] = str(target) + os.pathsep + e.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res
    assert res.stdout.startswith("({}, 'NVML: NVMLError"), res.stdout


# -- the cron simulation, with BPF -------------------------------------------------------
TAG = f"cron-tag-{os.getpid()}"


def snap(d, *args, wait=True):
    cmd = pyoffcpu_cmd("snapshot", "--dir", d, "--match", "cron-tag-[0-9]+", "-d", "3",
                       "--format", "svg,pprof,folded", *args)
    if not wait:
        return subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180)


def wait_attached(pid, timeout=120):
    """Until process `pid` holds a perf event (its sampling is attached: the
    recording starts right after).  A snapshot says nothing on stderr, and
    how long it takes to get there depends on the machine's load and on
    whether its BPF programs were in the cache."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return
        for fd in fds:
            try:
                if "perf_event" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    return
            except OSError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never attached")


def age_index(d, days):
    """A week goes by: every entry so far is `days` older."""
    p = os.path.join(d, "index.json")
    index = json.loads(open(p).read())
    for e in index["entries"]:
        e["time"] -= days * 86400
    open(p, "w").write(json.dumps(index))


def dump_dom(html_path, fragment=""):
    exe = chromium_or_skip()
    res = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          "file://" + str(html_path) + fragment], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_three_cron_runs_with_retention_a_lock_and_a_report(tmp_path, bpf):
    from test_pprof import go_or_skip, go_pprof, raw_samples
    d = str(tmp_path / "snaps")
    pythons = [python_or_skip(l) for l in ("pyenv-3.9", "pyenv-3.12", "debian-3.11")]
    script = os.path.join(WORKLOADS, "split.py")
    long_ = [Workload(None, "split.py", argv=[p, script, "300", TAG]) for p in pythons[:2]]
    procs = {w.pid: w for w in long_}
    write(os.path.join(d, "notes", "mine.txt"))                 # the user's own file: never touched
    try:
        runs = []
        for i in range(3):
            # the third target ends 1.2 s into each 3 s recording, while it is recorded
            short = Workload(None, "split.py", argv=[pythons[2], script, "300", TAG])
            procs[short.pid] = short
            run = snap(d, wait=False)
            wait_attached(run.pid)
            t0 = time.monotonic()
            if i == 2:
                other = snap(d)                                 # overlaps: refused
                assert other.returncode == S.EXIT_LOCKED and "another snapshot" in other.stderr, other
                assert other.stdout == "" and len(other.stderr.splitlines()) == 1, other
            time.sleep(max(0.0, t0 + 1.2 - time.monotonic()))
            short.proc.terminate()
            short.proc.wait(timeout=30)
            out, err = run.communicate(timeout=180)
            assert run.returncode == 0, err
            assert out == "" and err == "", (out, err)         # quiet: cron mails nothing
            runs.append(run)
            if i == 0:
                age_index(d, 8)                                 # run 1 is a week old for run 3
    finally:
        for w in procs.values():
            w.stop()
    index = json.loads(open(os.path.join(d, "index.json")).read())
    # run 1's three entries went (8 days > --keep-days 7) with their files; runs 2 and 3 stay
    entries = index["entries"]
    assert len(entries) == 6, [(e["pid"], e["time"]) for e in entries]
    assert {e["python"].split()[0][:4] for e in entries} == {"3.9.", "3.12", "3.11"}
    listed = {f["path"] for e in entries for f in e["files"].values()}
    on_disk = {os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs}
    assert on_disk - listed == {"index.json", ".lock", "notes/mine.txt"}, on_disk - listed
    assert len(index["runs"]) == 3 and index["runs"][-1]["targets"] == 3
    for e in entries:
        assert re.fullmatch(r"[^/]+/\d{4}-\d\d-\d\d/\d{6}-%d-[\w.-]+\.(svg|pb\.gz|folded)" % e["pid"],
                            e["files"]["svg"]["path"].replace(".svg", ".folded")), e["files"]
        assert e["cmdline"].endswith(TAG) and e["top"] and e["on_cpu_ns"] > 0
    # the one that exited mid-run kept what was collected: less than the 2 s
    # of its two threads, more than nothing; the long ones all of it
    gone = [e for e in entries if e["gone_at_end"]]
    assert len(gone) == 2 and all(e["python"].startswith("3.11") for e in gone), gone
    assert all(0.1e9 <= e["on_cpu_ns"] + e["off_cpu_ns"] <= 0.9 * 2 * e["duration_s"] * 1e9
               for e in gone), gone
    for e in entries:
        if not e["gone_at_end"]:
            # main + releaser, the whole recording each
            assert abs(e["on_cpu_ns"] + e["off_cpu_ns"] - 2 * e["duration_s"] * 1e9) <= 0.02e9, e
    # the pprof files: go reads them, totals those of the folded files
    go = go_or_skip()
    for e in entries:
        folded = open(os.path.join(d, e["files"]["folded"]["path"])).read().splitlines()
        folded_us = sum(int(ln.rsplit(" ", 1)[1]) for ln in folded)
        pb = os.path.join(d, e["files"]["pprof"]["path"])
        wall_ns = sum(v[2] for v, _ in raw_samples(go_pprof(go, pb, "-raw")))
        assert abs(wall_ns / 1000 - folded_us) <= len(folded), (wall_ns, folded_us)
        assert wall_ns == from_pprof(open(pb, "rb").read()).total_ns()
        assert wall_ns == e["on_cpu_ns"] + e["off_cpu_ns"]
    # the report, in a real browser
    res = subprocess.run(pyoffcpu_cmd("report", d), env=env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    page = os.path.join(d, "report.html")
    dom = dump_dom(page)
    sections = re.findall(r'<section class="proc( hidden)?" data-process="([^"]+)"', dom)
    assert len(sections) >= 2 and all(not h for h, _ in sections), sections
    rows = re.findall(r'<tr class="snap( hidden)?" data-day="([^"]+)" data-process="([^"]+)"', dom)
    assert len(rows) == 6 and not any(h for h, _, _ in rows), rows
    links = re.findall(r'<a href="([^"]+)">(svg|pprof|folded)</a>', dom)
    assert len(links) == 18 and all(os.path.exists(os.path.join(d, h)) for h, _ in links), links
    assert dom.count('<g class="bar"') == 6
    # a filter by process hides the others' rows, in the browser too
    name = sections[0][1]
    dom = dump_dom(page, "#process=" + name)
    rows = re.findall(r'<tr class="snap( hidden)?" data-day="[^"]+" data-process="([^"]+)"', dom)
    assert rows and all(bool(h) == (p != name) for h, p in rows), rows


def test_snapshot_gpu_finds_the_stand_in_with_nvml_installed_and_no_gpu(tmp_path, bpf, gpu_standin):
    """--gpu picks the process that holds the stand-in device open (and no
    other Python process here), with nvidia-ml-py importable but no driver:
    the entry has the device, no NVML facts, and nothing is printed."""
    pid, path = gpu_standin
    target = tmp_path / "nvml"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--target", str(target), "nvidia-ml-py"], capture_output=True, text=True)
    e = env()
    if pip.returncode == 0:
        e["PYTHONPATH"] = str(target) + os.pathsep + e.get("PYTHONPATH", "")
    d = str(tmp_path / "snaps")
    res = subprocess.run(pyoffcpu_cmd("snapshot", "--dir", d, "--gpu", "-d", "1"), env=e,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res
    entries = json.loads(open(os.path.join(d, "index.json")).read())["entries"]
    assert [x["pid"] for x in entries] == [pid], entries
    assert entries[0]["gpu"] == {"devices": [path]}


def test_the_printed_cron_line_runs_as_printed(tmp_path, bpf):
    """The crontab line, run the way cron runs it (sh -c, a bare
    environment): a snapshot in the directory it names, nothing printed."""
    python = python_or_skip("pyenv-3.11")
    tag = f"cronline-tag-{os.getpid()}"
    w = Workload(python, "split.py", 300, tag)
    d = str(tmp_path / "snaps")
    try:
        res = subprocess.run(pyoffcpu_cmd("snapshot", "--print-cron", "--dir", d, "--match",
                                          "cronline-tag-[0-9]+", "-d", "1"), env=env(),
                             capture_output=True, text=True)
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith("*/"))
        command = line.split(None, 5)[5]
        res = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "HOME=/root", "SHELL=/bin/sh",
                              "/bin/sh", "-c", command], capture_output=True, text=True, timeout=180)
    finally:
        w.stop()
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", (command, res)
    entries = json.loads(open(os.path.join(d, "index.json")).read())["entries"]
    assert [x["pid"] for x in entries] == [w.pid]
