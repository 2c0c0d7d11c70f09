"""A thread's end where no switch shows it.  In cpu mode sched_switch is not
attached: each thread's exit is stamped by sched_process_exit (TH_EXITING),
and that stamp ends it.  Before, nothing ended a thread in cpu mode: every
thread stayed alive in the profile until the end of the recording, and a
thread-per-request server filled BPF's thread map (16,384 entries here)
within seconds, after which new threads went unrecorded ("thread map
full")."""
import json

import pytest

from conftest import Workload, python_or_skip

EVERY_S, SPIN_S, RUN_S = 0.04, 0.01, 6.0
DURATION_S = 3.0
TOLERANCE_S = 0.02      # a thread's exit comes microseconds after its function returns


@pytest.mark.parametrize("label", ["pyenv-3.12", "debian-3.11"])
def test_cpu_mode_ends_each_thread_at_its_exit(label, bpf):
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    w = Workload(python_or_skip(label), "thread_churn.py", EVERY_S, SPIN_S, RUN_S)
    try:
        # --keep-tids: each thread apart, with its own end
        rec = Session(Options(pids=[w.pid], duration=DURATION_S, mode="cpu", frequency=997,
                              fold_threads=False), plat.probe()).run()
        out, _ = w.proc.communicate(timeout=RUN_S + 30)
    finally:
        w.stop()
    ends = json.loads(next(line for line in out.splitlines() if line.startswith("ends ")).split(" ", 1)[1])
    # the threads that ended well inside the recording: each spun 10 ms of
    # CPU at 997 Hz (about ten samples), so each is in the profile
    inside = {tid: at - rec.start_time for tid, at in ends
              if 0.2 < at - rec.start_time < DURATION_S - 0.3}
    assert len(inside) >= 0.5 * (DURATION_S - 0.5) / (EVERY_S + SPIN_S), len(inside)
    for tid, end_s in inside.items():
        t = rec.threads.get(tid)
        assert t is not None, (tid, sorted(rec.threads))
        assert t.exited, (tid, t)
        assert t.samples > 0
        assert 0 <= t.last_ns / 1e9 - end_s < TOLERANCE_S, (tid, t.last_ns / 1e9, end_s)
    assert "thread map full" not in rec.drops


def test_cpu_mode_folds_every_ended_thread_into_its_group(bpf):
    """The default (threads folded): each ended thread joins a group, the
    ones no sample landed in (most of these, at 99 Hz) by the drains'
    shortcut (fold_unsampled), and the groups hold as many threads as
    ended inside the recording (one either way at each edge)."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    w = Workload(python_or_skip("pyenv-3.12"), "thread_churn.py", 0.004, 0.0005, RUN_S)
    try:
        rec = Session(Options(pids=[w.pid], duration=DURATION_S, mode="cpu"), plat.probe()).run()
        out, _ = w.proc.communicate(timeout=RUN_S + 30)
    finally:
        w.stop()
    ends = json.loads(next(line for line in out.splitlines() if line.startswith("ends ")).split(" ", 1)[1])
    inside = sum(1 for _, at in ends if 0 < at - rec.start_time < rec.duration_s)
    groups = [t for tid, t in rec.threads.items() if tid < 0]
    # kept alone: only a thread still alive at the end (one churn thread at most)
    alone = [tid for tid, t in rec.threads.items() if tid > 0 and tid != w.pid and t.exited]
    assert inside > 300
    assert abs(sum(g.threads for g in groups) - inside) <= 2, (sum(g.threads for g in groups), inside)
    assert not alone
