"""Native stacks walked in BPF from .eh_frame tables, with real processes
built without frame pointers: the order of C and Python frames, C threads,
GIL waits, libraries loaded later, and how often the native stack matches
the Python one."""
import os
import signal
import subprocess

import pytest

from conftest import (WORKLOADS, Workload, env, pyoffcpu_cmd, python_or_skip, record_folded,
                      wait_for_recording)
from pyoffcpu.profile.model import FrameKind, from_folded

DURATION = 5.0
SHARE = 0.95


def names(key):
    return [f.name for f in key.frames]


def python_names(key):
    return [f.name for f in key.frames if f.kind is FrameKind.PYTHON]


def in_order(seq, wanted):
    """Indexes of wanted in seq, in that order (root first), or None."""
    out = []
    start = 0
    for w in wanted:
        try:
            i = seq.index(w, start)
        except ValueError:
            return None
        out.append(i)
        start = i + 1
    return out


def build_extension(tmp_path_factory, fp_flag):
    """tests/workloads/native_chain.c built against pyenv 3.11's headers."""
    python = python_or_skip("pyenv-3.11")
    include = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    out = tmp_path_factory.mktemp("ext") / "native_chain.so"
    subprocess.run(["gcc", "-O2", fp_flag, "-shared", "-fPIC", f"-I{include}",
                    "-o", str(out), os.path.join(WORKLOADS, "native_chain.c"), "-lpthread"],
                   check=True)
    return python, str(out)


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """Without frame pointers: only the .eh_frame tables can walk it."""
    return build_extension(tmp_path_factory, "-fomit-frame-pointer")


# with frame pointers, the tables say CFA = rbp + 16: rbp from the registers
@pytest.fixture(scope="module", params=["-fomit-frame-pointer", "-fno-omit-frame-pointer"])
def chain_recording(request, tmp_path_factory, bpf):
    python, so = build_extension(tmp_path_factory, request.param)
    w = Workload(python, "native_chain.py", so, DURATION + 60)   # outlives start-up; killed after
    ctid = int(w.lines[0].split()[1])
    try:
        res, prof = record_folded(tmp_path_factory.mktemp("chain"), "-p", str(w.pid),
                                  "-d", str(DURATION), "--mode", "wall")
    finally:
        w.stop()
    return w, ctid, res, prof


def oncpu_main(w, prof):
    return {k: ns for k, ns in prof.weights.items() if k.tid == w.pid and k.off_cpu is None}


def test_c_chain_sits_above_its_python_caller(chain_recording):
    w, _, res, prof = chain_recording
    case = {k: ns for k, ns in oncpu_main(w, prof).items() if "spin_case" in python_names(k)}
    total = sum(case.values())
    assert total > 0.5e9, res.stderr
    good = 0
    for k, ns in case.items():
        seq = names(k)
        idx = in_order(seq, ["spin_case", "nc_outer", "nc_middle", "nc_inner"])
        # the Python caller is the innermost Python frame: nothing Python above the chain
        if idx and python_names(k)[-1] == "spin_case":
            good += ns
    assert good >= SHARE * total, (good / total, res.stderr)


def test_python_callback_sits_above_the_c_chain_that_called_it(chain_recording):
    w, _, res, prof = chain_recording
    case = {k: ns for k, ns in oncpu_main(w, prof).items() if "py_callback" in python_names(k)}
    total = sum(case.values())
    assert total > 0.5e9, res.stderr
    good = sum(ns for k, ns in case.items()
               if in_order(names(k), ["callback_case", "cb_outer", "cb_middle", "cb_inner",
                                      "py_callback"]))
    assert good >= SHARE * total, (good / total, res.stderr)


def test_c_thread_has_full_native_stacks_and_no_python(chain_recording):
    _, ctid, res, prof = chain_recording
    mine = {k: ns for k, ns in prof.weights.items() if k.tid == ctid}
    assert mine, res.stderr
    assert not any(python_names(k) for k in mine)
    on = {k: ns for k, ns in mine.items() if k.off_cpu is None}
    on_total = sum(on.values())
    good = sum(ns for k, ns in on.items()
               if in_order(names(k), ["start_thread", "th_outer", "th_middle", "th_inner"]))
    assert on_total > 0.5e9 and good >= SHARE * on_total, (good, on_total)
    # the nanosleep half: off-CPU, asleep, under the same chain
    sleep = {k: ns for k, ns in mine.items()
             if any(n in ("nanosleep", "__nanosleep", "clock_nanosleep") for n in names(k))}
    sleep_total = sum(sleep.values())
    sleep_off = sum(ns for k, ns in sleep.items() if k.off_cpu is not None)
    assert sleep_off >= 0.98 * sleep_total
    assert 0.35 <= sleep_off / sum(mine.values()) <= 0.6, (sleep_off, sum(mine.values()))
    chained = sum(ns for k, ns in sleep.items()
                  if k.off_cpu is not None and in_order(names(k), ["th_outer", "th_middle", "th_inner"]))
    assert chained >= SHARE * sleep_off


def test_library_loaded_during_the_recording_is_unwound(extension, tmp_path, bpf):
    python, so = extension
    w = Workload(python, "native_chain.py", so, 65, "--late")    # outlives start-up; killed after
    out = tmp_path / "late.folded"
    try:
        p = subprocess.Popen(pyoffcpu_cmd("-o", str(out), "-p", str(w.pid), "-d", "5"),
                             env=env(), stderr=subprocess.PIPE, text=True)
        wait_for_recording(p)
        os.kill(w.pid, signal.SIGUSR1)      # dlopen of native_chain.so now
        ctid = None
        while True:
            line = w.proc.stdout.readline().strip()
            if line.startswith("cthread"):
                ctid = int(line.split()[1])
            if line == "loaded" or not line:
                break
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        w.stop()
    prof = from_folded(out.read_text())
    case = {k: ns for k, ns in prof.weights.items()
            if k.tid == w.pid and k.off_cpu is None and "spin_case" in python_names(k)}
    total = sum(case.values())
    good = sum(ns for k, ns in case.items()
               if in_order(names(k), ["spin_case", "nc_outer", "nc_middle", "nc_inner"]))
    # the tables are loaded within about a second of the dlopen; enough
    # on-CPU time to tell (less of it on a loaded machine: not the point)
    assert total > 0.4e9 and good >= 0.75 * total, (good, total)
    c = {k: ns for k, ns in prof.weights.items() if k.tid == ctid and k.off_cpu is None}
    assert sum(ns for k, ns in c.items() if in_order(names(k), ["th_outer", "th_middle", "th_inner"])) \
        >= 0.75 * sum(c.values())


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_native_stacks_match_the_python_stacks(label, bpf):
    """On-CPU samples inside Python: the eval frames of the native stack pair
    one to one with the Python groups (no fallback)."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.kernel import bpfdefs
    from pyoffcpu.native import symbols
    from pyoffcpu.profile.merge import Merger
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    python = python_or_skip(label)
    w = Workload(python, "split.py", DURATION + 60)
    try:
        rec = Session(Options(pids=[w.pid], duration=DURATION, mode="wall"), plat.probe()).run()
    finally:
        w.stop()
    merger = Merger(rec, symbols.Symbolizer())
    on_py = on_matched = 0
    for (tgid, tid, us, ks, ph, kind), (count, ns) in rec.stacks.items():
        if not bpfdefs.on_cpu(kind) or not ph:
            continue
        before = merger.stats.matched_ns
        merger.frames_for(tgid, us, ks, ph, ns)
        on_py += count
        if merger.stats.matched_ns > before:
            on_matched += count
    assert on_py > 50, on_py           # enough samples to tell (fewer on a loaded machine)
    assert on_matched >= SHARE * on_py, (on_matched, on_py, rec.drops)


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_thread_waiting_for_the_gil_shows_take_gil(label, tmp_path, bpf):
    """Two threads spinning in Python: the time each sleeps is spent waiting
    for the GIL, and its native stack says so (take_gil; Debian's is
    take_gil.lto_priv.0, a static function named by python3.11-dbg)."""
    python = python_or_skip(label)
    if label == "debian-3.11" and not _has_debug_file(python):
        pytest.skip("take_gil is a static function: needs python3.11-dbg (make test installs it)")
    w = Workload(python, "gil_contention.py", DURATION + 60)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "3", "--mode", "off")
    finally:
        w.stop()
    # asleep, not preempted (runqueue time is the machine being busy): the
    # waits of a thread under take_gil, named gil
    asleep = {k: ns for k, ns in prof.weights.items()
              if k.tid != w.pid and k.off_cpu not in (None, "runqueue")
              and "spinner" in python_names(k)}
    total = sum(asleep.values())
    gil = sum(ns for k, ns in asleep.items()
              if in_order(names(k), ["spinner"]) and any(n.startswith("take_gil") for n in names(k)))
    assert total > 0.5e9, res.stderr
    assert gil >= 0.9 * total, (gil / total, res.stderr)
    assert all(k.off_cpu == "gil" for k in asleep
               if any(n.startswith("take_gil") for n in names(k))), {k.off_cpu for k in asleep}


def _has_debug_file(python):
    from pyoffcpu.native.symbols import ElfSymbols
    return ElfSymbols(os.path.realpath(python)).debug_file is not None


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_threads_blocked_since_before_the_start_get_native_stacks(label, tmp_path, bpf):
    """BPF never sees these threads leave the CPU: their native stacks are
    walked in user space from /proc/PID/task/TID/syscall with the same
    tables, and merge with their Python stacks like any other."""
    python = python_or_skip(label)
    w = Workload(python, "idle_threads.py", 3)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "2")
    finally:
        w.stop()
    assert "fell back for 0%" in res.stderr, res.stderr
    for tid in {k.tid for k in prof.weights}:
        keys = [k for k in prof.weights if k.tid == tid]
        for k in keys:
            seq = names(k)
            # (a static build's _start is in the interpreter: plumbing, left out)
            roots = ("_start", "__libc_start_main") if tid == w.pid else ("clone3",)
            want = ["main", "clock_nanosleep"] if tid == w.pid else ["parked", "Condition.wait"]
            assert seq[0] in roots and in_order(seq, want), seq
            # the native wait is at the leaf end, under the Python frames
            assert k.frames[-2].kind is FrameKind.NATIVE, seq


def test_native_walk_deeper_than_the_limit_keeps_its_innermost_frames(bpf):
    """40 levels of Python recursion through sorted() (over 200 native
    frames): every sample and every switch-out walks the full MAX_NATIVE_DEPTH
    of innermost frames, then stops, marked truncated.  A tail-call chain the
    kernel cut short (33 calls at most) would stop earlier, at a multiple of
    the frames one program run takes."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.kernel import bpfdefs
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "deep_native.py", 60)
    try:
        rec = Session(Options(pids=[w.pid], duration=3, mode="wall"), plat.probe()).run()
    finally:
        w.stop()
    depth = bpfdefs.MAX_NATIVE_DEPTH
    seen = {"on": 0, "off": 0}
    for (tgid, tid, us, ks, ph, kind), (count, ns) in rec.stacks.items():
        if tid != w.pid or us not in rec.native_flags:
            continue
        py = rec.pystacks.get(ph)
        if py is None or len(py.frames) < 80:
            continue                    # not in the recursion (the start, the end)
        pcs, flags = rec.ustacks[us], rec.native_flags[us]
        assert len(pcs) == depth and flags & bpfdefs.NST_TRUNCATED, (len(pcs), flags, kind)
        seen["on" if bpfdefs.on_cpu(kind) else "off"] += count
    assert seen["on"] > 20 and seen["off"] > 20, seen


def test_without_tables_first_the_unwinder_comes_in_after_the_start_and_says_when(tmp_path, bpf):
    """The default start: the unwinder's programs are verified while the
    recording starts.  A notice gives when they came in; before, stacks are
    frame-pointer ones (the merge falls back for them), after, walked from
    tables: the fallback's share is about the notice's time over the
    recording's, and the split's time is all there."""
    import re
    python = python_or_skip("pyenv-3.11")
    duration = 4.0
    w = Workload(python, "split.py", duration + 60)
    try:
        tables = tmp_path / "warm"                  # the tables made once, so only the programs wait
        tables.mkdir(mode=0o700)
        record_folded(tmp_path, "-p", str(w.pid), "-d", "1", name="fill.folded",
                      env_extra={"PYOFFCPU_CACHE_DIR": str(tables)})
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", str(duration),
                                  env_extra={"PYOFFCPU_TABLES_FIRST": "0", "PYOFFCPU_CACHE_DIR": str(tables)})
    finally:
        w.stop()
    m = re.search(r"native stacks from \.eh_frame tables after the first ([\d.]+) s of the recording",
                  res.stderr)
    assert m, res.stderr
    late = float(m.group(1))
    assert 0 < late < 1.5, late
    fell = re.search(r"merge fell back for (\d+)% of the Python time", res.stderr)
    share = int(fell.group(1)) if fell else 0
    assert share <= 100 * late / duration + 5, (share, late, res.stderr)
    main = sum(ns for k, ns in prof.weights.items() if k.tid == w.pid)
    assert abs(main / 1e9 - duration) <= 0.03 * duration
    walked = sum(ns for k, ns in prof.weights.items()
                 if k.tid == w.pid and any(f.kind is FrameKind.NATIVE for f in k.frames))
    assert walked >= 0.9 * main, (walked, main)
