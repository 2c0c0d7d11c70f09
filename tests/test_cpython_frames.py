"""The merger's Python side, version by version, on frame records as BPF makes
them ((code address, offset, flags) innermost first; see bpf/pyoffcpu.h):
groups cut at entry frames, hidden incomplete frames, offsets to lines, and
stacks that cannot be trusted."""
import pytest

from pyoffcpu.cpython.code import CodeInfo
from pyoffcpu.profile.merge import Merger
from pyoffcpu.kernel.bpfdefs import PYF_ENTRY, PYS_TRUNCATED
from pyoffcpu.collect.recording import Options, PyStack, Recording

PID = 99
# lnotab (<= 3.9): (addr_incr, line_incr) pairs; line 10 from byte 0, 11 from byte 4
LNOTAB = bytes([0, 0, 4, 1])
# 3.10 linetable: (sdelta, ldelta): bytes 0-3 line 10, bytes 4-7 line 11
LINETABLE310 = bytes([4, 0, 4, 1])
# 3.11+ location table: unit 0 line 10, units 1-3 line 11 (code 13: line delta only)
LOCATIONS = bytes([0x80 | (13 << 3), 0x00, 0x80 | (13 << 3) | 2, 0x02])


class Version:
    def __init__(self, minor):
        self.minor = minor
        self.binary = "libpython"


def merger(minor, frames, table, flags=0, firsttraceable=0, unreadable=()):
    rec = Recording(Options())
    rec.pythons[PID] = Version(minor)
    for code, _, _ in frames:
        if code in unreadable:
            rec.code[(PID, code)] = None
        else:
            rec.code[(PID, code)] = CodeInfo("f%d" % code, "/m.py", 10, table, firsttraceable)
    rec.pystacks[1] = PyStack(PID, flags, frames)
    return Merger(rec, symbolizer=None)


def names(groups):
    return [[(f.name, f.line) for f in g] for g in groups]


@pytest.mark.parametrize("minor,table,offset", [((3, 7), LNOTAB, 4), ((3, 9), LNOTAB, 4),
                                                ((3, 10), LINETABLE310, 2)])
def test_frame_objects_one_group_each(minor, table, offset):
    # <= 3.10: every frame is its own _PyEval_EvalFrameDefault; 3.10 counts f_lasti
    # in code units, 3.7-3.9 in bytes
    frames = [(1, offset, PYF_ENTRY), (2, 0, PYF_ENTRY), (3, -1, PYF_ENTRY)]
    groups, truncated = merger(minor, frames, table).python_groups(1)
    assert names(groups) == [[("f1", 11)], [("f2", 10)], [("f3", 10)]]
    assert not truncated


def test_311_groups_end_with_the_entry_frame():
    frames = [(1, 2, 0), (2, 6, PYF_ENTRY), (3, 0, PYF_ENTRY | 1)]
    groups, _ = merger((3, 11), frames, LOCATIONS).python_groups(1)
    assert names(groups) == [[("f1", 11), ("f2", 11)], [("f3", 10)]]


def test_311_hidden_entry_frame_still_closes_its_group():
    # f2 has not started (offset < 2 * _co_firsttraceable): hidden, but it is the
    # outermost frame of its eval call, so the group ends there all the same
    frames = [(1, 6, 0), (2, 0, PYF_ENTRY), (3, 6, PYF_ENTRY)]
    groups, _ = merger((3, 11), frames, LOCATIONS, firsttraceable=1).python_groups(1)
    assert names(groups) == [[("f1", 11)], [("f3", 11)]]


@pytest.mark.parametrize("minor", [(3, 12), (3, 13), (3, 14)])
def test_owner_3_frames_close_groups_and_are_dropped(minor):
    shim = 3                                    # 3.12/3.13 CSTACK, 3.14 INTERPRETER
    frames = [(1, 6, 0), (2, 2, 1), (9, 0, shim), (3, 0, 0), (9, 0, shim)]
    groups, _ = merger(minor, frames, LOCATIONS).python_groups(1)
    assert names(groups) == [[("f1", 11), ("f2", 11)], [("f3", 10)]]


def test_generator_frames_are_never_incomplete():
    frames = [(1, 0, 1), (2, 0, 0), (9, 0, 3)]
    groups, _ = merger((3, 13), frames, LOCATIONS, firsttraceable=4).python_groups(1)
    assert names(groups) == [[("f1", 10)]]


def test_depth_limit_marks_truncated():
    frames = [(1, 6, 0)] * 5
    groups, truncated = merger((3, 12), frames, LOCATIONS, flags=PYS_TRUNCATED).python_groups(1)
    assert truncated and len(groups[0]) == 5


def test_unreadable_code_object_cuts_the_stack():
    frames = [(1, 6, 0), (2, 6, 0), (7, 0, 0), (3, 6, 0), (9, 0, 3)]
    m = merger((3, 12), frames, LOCATIONS, unreadable={7})
    groups, truncated = m.python_groups(1)
    assert names(groups) == [[("f1", 11), ("f2", 11)]] and truncated
    assert m.stats.torn_stacks == 1
    assert all(not f.name.startswith("[unknown") for g in groups for f in g)
