"""--off-cpu sampled (the default) against the exact answer, with real BPF
(docs/offcpu-sampling.md; the arithmetic alone: tests/test_waits.py).

* Short waits: tests/workloads/two_callers.py with 100 us blocks, 30/70
  between two lines by construction, against the workload's own clock of
  the same window: sampled, line A's share within 3 sigma of it, sigma as
  the docs compute it; --off-cpu exact within 0.5 pp.
* One recording both ways (PYOFFCPU_OFFCPU=shadow: every switch-out takes
  its stack as --off-cpu exact does, and the sampled path runs beside it):
  every thread's off-CPU time, and its time per kind of wait, the same to
  the nanosecond in both profiles; every wait of 1/F or more under the same
  stack at the same length.
* A wait still open at the end has the stack it waits with; a thread
  without rseq is captured at its switch-outs.
"""
import collections
import math
import os
import subprocess
import time

import pytest

from conftest import (TwoCallers, Workload, env, pyoffcpu_cmd, python_or_skip, record_folded,
                      source_line)
from pyoffcpu.kernel import bpfdefs
from pyoffcpu.profile import waits
from pyoffcpu.profile.model import FrameKind

SECONDS = 4
SHORT_LABELS = ["pyenv-3.12", "debian-3.11", "debian-3.14"]


def _short_split(label, tmp_path):
    """One sampled recording of the 100 us blocks: (line A's share, the
    workload's own share, expected samples n)."""
    tmp_path.mkdir()
    split = TwoCallers.record(label, tmp_path, SECONDS, "-F", "999", block_s=0.0001)
    split.check_whole(SECONDS)
    assert "sampled of" in split.stderr, split.stderr
    return split.share_a, split.truth_a, (split.a + split.b) / 1e9 * 999, split.explain()


def _sigma(truth, n):
    p = truth / 100
    return 100 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("label", SHORT_LABELS)
def test_short_waits_split_within_3_sigma_of_the_truth(label, tmp_path, bpf):
    """100 us blocks at -F 999 (T = 1 ms): each block's stack is taken with
    probability d/T; the caller's exact blocked time is split over the
    lines by the stacks sampled.  n = E/T samples are expected for E of
    short waits, and the share's sigma is sqrt(p(1-p)/n).

    An unbiased estimate still lands outside 3 sigma in 0.27% of
    recordings (CI met one: 3.03 sigma; 12 recordings here gave z with a
    standard deviation of 1.09).  So a first recording outside 3 sigma gets
    a second, and the two pooled (twice the samples) are held to 3 of
    their sigma: an unbiased estimator then fails ~0.05% of the time, and a
    bias of 3 sigma is still caught (pooled, it is 4.2 sigma)."""
    share, truth, n, why = _short_split(label, tmp_path / "1")
    sigma = _sigma(truth, n)
    print(f"{label}: {n:.0f} samples expected, sigma {sigma:.2f} pp, off by {share - truth:+.2f} pp")
    assert 3 * sigma <= 5, sigma            # a test that can fail: the bound is tight enough
    if abs(share - truth) <= 3 * sigma:
        return
    share2, truth2, n2, why2 = _short_split(label, tmp_path / "2")
    pooled = (share * n + share2 * n2) / (n + n2)
    pooled_truth = (truth * n + truth2 * n2) / (n + n2)
    pooled_sigma = _sigma(pooled_truth, n + n2)
    print(f"{label}, again: off by {share2 - truth2:+.2f} pp; pooled {pooled - pooled_truth:+.2f} pp, "
          f"sigma {pooled_sigma:.2f}")
    assert abs(pooled - pooled_truth) <= 3 * pooled_sigma, (why, why2, sigma, pooled_sigma)


@pytest.mark.parametrize("label", SHORT_LABELS)
def test_exact_mode_splits_short_waits_to_half_a_point(label, tmp_path, bpf):
    split = TwoCallers.record(label, tmp_path, SECONDS, "--off-cpu", "exact", block_s=0.0001)
    split.check_whole(SECONDS)
    assert "taken at every switch" in split.stderr, split.stderr
    assert abs(split.share_a - split.truth_a) <= 0.5, split.explain()


def test_threads_without_rseq_are_captured_at_their_switch_outs(tmp_path, bpf):
    """glibc.pthread.rseq=0: no rseq area, no rseq_update for the workload's
    threads: their waits' stacks are taken at the switch-out, exactly."""
    split = TwoCallers.record("debian-3.11", tmp_path, SECONDS, block_s=0.0001,
                              workload_env={"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    split.check_whole(SECONDS)
    assert "wait stack not taken" not in split.stderr, split.stderr
    assert abs(split.share_a - split.truth_a) <= 1, split.explain()


def _kind_totals(stacks):
    """(tid, state and system call) -> off-CPU ns."""
    out = collections.Counter()
    for k, (_c, ns) in stacks.items():
        if not bpfdefs.on_cpu(k[5]):
            out[(k[1], k[5] & ((1 << bpfdefs.GIL_SHIFT) - 1))] += ns
    return out


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_one_recording_both_ways(label, bpf, monkeypatch):
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    monkeypatch.setenv("PYOFFCPU_OFFCPU", "shadow")
    w = Workload(python_or_skip(label), "waits.py", 30)
    try:
        names = {int(ln.split()[2]): ln.split()[1] for ln in w.lines if ln.startswith("tid ")}
        rec = Session(Options(pids=[w.pid], duration=SECONDS, mode="wall"), plat.probe()).run()
    finally:
        w.stop()
    assert rec.offcpu == "shadow"
    period = int(1e9 // rec.options.frequency)
    exact, _w, ce = waits.resolve(rec.stacks, rec.wakes, "shadow", period, view="exact")
    sampled, _w, cs = waits.resolve(rec.stacks, rec.wakes, "shadow", period, view="sampled")
    print(f"\n{label}: exact {ce}, sampled {cs}")
    assert cs.exact > 100 and cs.short > 0, cs
    # every thread's time per kind of wait (and so its off-CPU time): the same
    kx, ks = _kind_totals(exact), _kind_totals(sampled)
    assert kx == ks, sorted(set(kx.items()) ^ set(ks.items()))
    # the waits of 1/F or more, taken at their switch-in: under the stack the
    # switch-out took, at the same length, to the nanosecond.  Where every
    # wait at a stack was that long, the two views hold the same key.
    long_keys = {k[:5] + (k[5] & ~waits.KIND_FLAGS,): v for k, v in rec.stacks.items()
                 if k[5] & waits.KIND_SHADOW and not k[5] & (waits.KIND_SAMPLED | waits.KIND_SHORT)
                 and not bpfdefs.on_cpu(k[5])}
    no_stack = bpfdefs.value("USTACK_NO_STACK")
    for k, v in long_keys.items():
        if k[2] == no_stack:
            continue                    # a capture lost (counted): below
        assert k in exact and exact[k][0] >= v[0] and exact[k][1] >= v[1], (k, exact.get(k), v)
        if exact[k][0] == v[0]:
            assert exact[k] == v, (k, exact[k], v)
    # ... which is nearly all the time of the threads that wait 50 ms at a time
    tids = {tid for tid, name in names.items() if name in ("sleeper", "selector", "writer", "reader")}
    assert len(tids) == 4, names
    whole = sum(ns for (tid, _k), ns in kx.items() if tid in tids)
    covered = sum(v[1] for k, v in long_keys.items() if k[1] in tids and k[2] != no_stack)
    lost = sum(v[1] for k, v in long_keys.items() if k[1] in tids and k[2] == no_stack)
    print(f"{label}: long waits {covered / 1e9:.3f} s of {whole / 1e9:.3f} s, {lost / 1e6:.1f} ms lost")
    assert covered >= 0.95 * whole, (covered, whole)
    # an owed stack is lost only where this VM's kernel skips the tracepoint for
    # a switch (seen: one 50 ms wait in 5 s now and then): not for a whole thread
    assert lost <= 0.03 * whole, (lost, whole, rec.drops)


def test_a_wait_open_at_the_end_has_its_stack(tmp_path, bpf):
    """The blocker starts waiting on an Event a second in and waits until
    after the end: BPF never sees that wait end; its stack is read before
    the end mark, while it waits."""
    w = Workload(python_or_skip("debian-3.11"), "open_wait.py", 1.0)
    out = tmp_path / "out.folded"
    try:
        tid = int(w.lines[0].split()[2])
        p = subprocess.Popen(pyoffcpu_cmd("-p", str(w.pid), "-d", "3", "-o", str(out)),
                             env=env(), stderr=subprocess.PIPE, text=True)
        from conftest import wait_for_recording
        wait_for_recording(p)
        os.kill(w.pid, 10)              # SIGUSR1: 1 s of 10 ms sleeps, then the wait
        stderr = p.stderr.read()
        assert p.wait(timeout=60) == 0, stderr
    finally:
        w.stop()
    from pyoffcpu.profile.model import from_folded
    prof = from_folded(out.read_text())
    line = source_line("open_wait.py", "# OPEN WAIT")
    at_line = unknown = 0
    for k, ns in prof.weights.items():
        if k.tid != tid or k.off_cpu is None:
            continue
        if any(f.kind is FrameKind.PYTHON and f.name == "blocker" and f.line == line for f in k.frames):
            at_line += ns
        if any(f.name == "[stack unknown]" for f in k.frames):
            unknown += ns
    print(f"\nblocker: {at_line / 1e9:.3f} s at the open wait, {unknown / 1e6:.1f} ms unknown")
    assert 1.3e9 <= at_line <= 2.2e9, (at_line, stderr)
    assert unknown <= 0.01e9, (unknown, stderr)
