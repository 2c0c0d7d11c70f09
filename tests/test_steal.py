"""The hypervisor's steal over a recording (the summary's `steal:` note):
a thread's on-CPU time by the clock includes what was stolen while it was
on a CPU (docs/offcpu-sampling.md), so the summary says how much there was."""
import subprocess
import sys

from pyoffcpu.collect.recording import Options, Recording
from pyoffcpu.kernel.procfs import cpu_times
from pyoffcpu.profile.summary import recording_notes, steal_note
from pyoffcpu.profile.merge import MergeStats


def test_the_note_says_the_share_and_stays_out_below_one_percent():
    assert steal_note(None) is None
    assert steal_note((10.0, 0.09)) is None             # 0.9% of the busy time
    assert steal_note((1.0, 0.01)) is None              # 1%, but one 10 ms tick
    note = steal_note((20.0, 0.5))
    assert note.startswith("steal: the hypervisor stole 2.5% of this machine's busy CPU time "
                           "while recording (0.50 of 20.00 CPU s"), note
    rec = Recording(Options())
    rec.cpu_steal = (20.0, 0.5)
    assert note in recording_notes(rec, MergeStats())
    rec.cpu_steal = (20.0, 0.0)
    assert not [n for n in recording_notes(rec, MergeStats()) if n.startswith("steal")]


def test_a_recording_reads_the_machines_busy_and_stolen_time_over_itself(bpf):
    """A target that spins through the whole recording keeps at least one
    CPU busy for all of it; the recording's figures lie between that and
    what /proc/stat says from before the session to after it."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.session import Session
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before = cpu_times()
        rec = Session(Options(pids=[spin.pid], duration=1.0, mode="wall"), plat.probe()).run()
        after = cpu_times()
    finally:
        spin.kill()
        spin.wait()
    busy, stolen = rec.cpu_steal
    assert 0.9 * rec.duration_s <= busy <= after.busy_s - before.busy_s, (busy, rec.duration_s)
    assert 0 <= stolen <= after.steal_s - before.steal_s
