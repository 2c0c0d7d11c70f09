"""Targets reads BPF's life log (bpf/pyoffcpu.h, struct life_event;
targets/lifelog.py) in order, stops at an entry still being written, and looks at everything again
(resync) when the ring went round: built on a buffer laid out as BPF's."""
import ctypes

from pyoffcpu.kernel import bpfdefs
from pyoffcpu.targets.processes import Targets

N = 16                                  # ring entries (BPF's is LIFE_LOG)
EVENT = bpfdefs.struct_type("life_event")


class Ring:
    def __init__(self):
        self.buf = bytearray(N * ctypes.sizeof(EVENT))
        self.count = bytearray(8)       # life_total, as its mmap shows it
        self.total = 0

    @property
    def total(self):
        return int.from_bytes(self.count, "little")

    @total.setter
    def total(self, n):
        self.count[:] = n.to_bytes(8, "little")

    def write(self, kind, tgid, arg=0, finish=True):
        """As log_life() does: seq 0, the fields, then index + 1."""
        idx, self.total = self.total, self.total + 1
        e = EVENT.from_buffer(self.buf, (idx % N) * ctypes.sizeof(EVENT))
        e.seq, e.kind, e.tgid, e.arg = 0, kind, tgid, arg
        if finish:
            e.seq = idx + 1
        return e, idx


def targets(ring):
    t = Targets(bpf=None, rec=None, unwinder=None, write_targets=lambda pids: None)
    seen = []
    t._on_exec = lambda pid, n: seen.append(("exec", pid, n))
    t._on_fork = lambda child, parent, execs: seen.append(("fork", child, parent, execs))
    t.retire = lambda tgt: seen.append(("exit", tgt))
    t._resync = lambda: seen.append(("resync", t._life.seen))
    t._life._maps = (ring.count, ring.buf, N, ctypes.sizeof(EVENT))
    return t, seen


def test_events_are_handled_once_each_in_order():
    ring = Ring()
    t, seen = targets(ring)
    ring.write(bpfdefs.LIFE_EXEC, 100, 1)
    ring.write(bpfdefs.LIFE_FORK, 101, 100 | 1 << 32)
    t.check_life()
    t.check_life()                      # nothing new: nothing again
    ring.write(bpfdefs.LIFE_EXEC, 101, 1)
    t.check_life()
    assert seen == [("exec", 100, 1), ("fork", 101, 100, 1), ("exec", 101, 1)]


def test_an_entry_being_written_is_read_at_the_next_look():
    ring = Ring()
    t, seen = targets(ring)
    ring.write(bpfdefs.LIFE_EXEC, 100, 1)
    half, idx = ring.write(bpfdefs.LIFE_EXEC, 200, 1, finish=False)
    ring.write(bpfdefs.LIFE_EXEC, 300, 1)
    t.check_life()
    assert seen == [("exec", 100, 1)]   # not past the unfinished one
    half.seq = idx + 1
    t.check_life()
    assert seen == [("exec", 100, 1), ("exec", 200, 1), ("exec", 300, 1)]


def test_a_ring_that_went_round_is_a_resync():
    ring = Ring()
    t, seen = targets(ring)
    for pid in range(N // 2 + 1):       # more than half of the ring since the last look
        ring.write(bpfdefs.LIFE_EXEC, 1000 + pid, 1)
    t.check_life()
    assert seen == [("resync", N // 2 + 1)]
    ring.write(bpfdefs.LIFE_EXEC, 7, 2)
    t.check_life()
    assert seen[-1] == ("exec", 7, 2)


def test_an_entry_rewritten_by_a_later_round_is_a_resync():
    ring = Ring()
    t, seen = targets(ring)
    ring.write(bpfdefs.LIFE_EXEC, 100, 1)
    t.check_life()
    for pid in range(5):
        ring.write(bpfdefs.LIFE_EXEC, 200 + pid, 1)
    # the slot of the next entry to read now holds one from the next round
    e = EVENT.from_buffer(ring.buf, 1 * ctypes.sizeof(EVENT))
    e.seq = 1 + N + 1
    t.check_life()
    assert seen == [("exec", 100, 1), ("resync", ring.total)]


def test_an_exit_retires_a_known_target_once():
    ring = Ring()
    t, seen = targets(ring)

    class Tgt:
        retired = False
    tgt = Tgt()
    t.by_pid[100] = tgt
    ring.write(bpfdefs.LIFE_EXIT, 100)
    ring.write(bpfdefs.LIFE_EXIT, 555)  # not a target
    t.check_life()
    assert seen == [("exit", tgt)] and t.exits_seen == 1
