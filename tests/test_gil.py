"""The GIL's state from BPF's keys into the profile (no BPF: a Recording
built by hand): per-thread GIL times, and the [gil not held] marker on a
Python frame that ran on a CPU without the GIL."""
from pyoffcpu.kernel import bpfdefs, syscalls
from pyoffcpu.cpython.code import CodeInfo
from pyoffcpu.profile.merge import build_profile
from pyoffcpu.profile.model import GIL_NOT_HELD
from pyoffcpu.collect.recording import Options, PyStack, Recording

PID = 300
LOCATIONS = bytes([0x80 | (13 << 3), 0x00])     # 3.11+: unit 0, line 10


class Version:
    minor = (3, 11)
    binary = "libpython"
    version_str = "3.11.7"


def kind(state, gil):
    return state | (gil << bpfdefs.GIL_SHIFT)


def recording(stacks):
    rec = Recording(Options())
    rec.pythons[PID] = Version()
    rec.code[(PID, 1)] = CodeInfo("spin", "/app.py", 10, LOCATIONS, 0)
    rec.pystacks[7] = PyStack(PID, 0, [(1, 0, bpfdefs.PYF_ENTRY)])
    for (tid, state, gil), ns in stacks.items():
        rec.stacks[(PID, tid, -1, -1, 7, kind(state, gil))] = [1, ns]
    return rec


def test_times_by_gil_state_and_the_marker_on_python_without_it():
    on, rq = bpfdefs.KIND_ONCPU, bpfdefs.KIND_RUNQUEUE
    held, free, unknown = bpfdefs.GIL_HELD, bpfdefs.GIL_FREE, bpfdefs.GIL_UNKNOWN
    rec = recording({(1, on, held): 700, (1, on, free): 200, (1, on, unknown): 50,
                     (1, rq, held): 30, (1, rq, free): 20,
                     (2, on, unknown): 500, (2, rq, unknown): 100})
    prof, _ = build_profile(rec, symbolizer=None)
    g = prof.gil[1]
    assert (g.held_on_ns, g.released_ns, g.unknown_on_ns, g.held_off_ns, g.waiting_ns) == (
        700, 200, 50, 30, 0)
    assert g.held_ns == 730
    # a thread whose state was never read has no GIL times
    assert 2 not in prof.gil
    # the same stack on a CPU without the GIL ends in the marker, its time apart;
    # with it (or not known) it does not; nothing is lost or added
    marked = {k: ns for k, ns in prof.weights.items() if k.frames[-1] == GIL_NOT_HELD}
    assert list(marked.values()) == [200] and all(k.tid == 1 for k in marked)
    assert [f.name for f in next(iter(marked)).frames] == ["spin", GIL_NOT_HELD.name]
    assert prof.total_ns(tid=1) == 1000 and prof.total_ns(tid=2) == 600
    # the GIL bits never reach the reasons: runqueue whatever the state
    assert prof.off_cpu_by_reason() == {1: {"runqueue": 50}, 2: {"runqueue": 100}}


def test_gil_bits_leave_the_state_and_the_system_call_alone():
    from pyoffcpu.profile import reasons
    k = syscalls.with_sys(bpfdefs.KIND_SLEEP, 202) | (bpfdefs.GIL_HELD << bpfdefs.GIL_SHIFT)
    assert bpfdefs.kind_gil(k) == bpfdefs.GIL_HELD
    assert syscalls.split_kind(bpfdefs.without_gil(k)) == (bpfdefs.KIND_SLEEP, 202)
    assert syscalls.split_kind(k) == (bpfdefs.KIND_SLEEP, 202)
    assert bpfdefs.on_cpu(bpfdefs.KIND_ONCPU | (bpfdefs.GIL_FREE << bpfdefs.GIL_SHIFT))
    assert not bpfdefs.on_cpu(k)


class FakeMemory:
    """Words at addresses; anything else cannot be read."""

    def __init__(self, words):
        self.words = words

    def u64(self, addr):
        from pyoffcpu.kernel.memory import MemoryError_
        if addr not in self.words:
            raise MemoryError_(addr)
        return self.words[addr]

    def read(self, addr, n):
        import struct
        return b"".join(struct.pack("<Q", self.u64(a)) for a in range(addr, addr + n, 8))[:n]


def process(minor, free_threaded=False, **offsets):
    from pyoffcpu.cpython.detect import PythonProcess
    from pyoffcpu.cpython.offsets_table import OFFSETS
    o = dict(OFFSETS[min(minor, (3, 13))], **offsets)
    return PythonProcess(PID, minor + (0,), "python", 0x1000, o, free_threaded=free_threaded)


def with_(base, more):
    return {**base, **more}


def test_gil_layout_is_checked_on_the_live_process():
    """Where BPF reads the GIL: 3.11 in _PyRuntime, 3.12+ through the
    interpreter; refused on a free-threaded build, on a layout whose
    `locked` is not 8 bytes after last_holder, and on memory whose `locked`
    is not 0 or 1 or whose locked GIL's holder is no thread state."""
    from pyoffcpu.cpython.detect import gil_layout
    p = process((3, 11))
    o = p.offsets
    gil = 0x1000 + o["runtime_gil"]
    interp, ts = 0x9000, 0xA000
    base = {0x1000 + o["runtime_interpreters_head"]: interp, interp + o["interp_threads_head"]: ts,
            ts + o["tstate_next"]: 0, interp + o["interp_next"]: 0}
    lay, why = gil_layout(p, FakeMemory(with_(base, {gil + 8: ts, gil + 16: 1})))
    assert (lay.addr, lay.interp_ceval_gil, lay.holder, why) == (gil, -1, 8, "")
    assert gil_layout(p, FakeMemory(with_(base, {gil + 8: 0xBAD, gil + 16: 1})))[0] is None
    assert gil_layout(p, FakeMemory(with_(base, {gil + 8: 0, gil + 16: 7})))[0] is None
    assert gil_layout(p, FakeMemory(with_(base, {gil + 8: 0xBAD, gil + 16: 0})))[0] is not None
    assert gil_layout(process((3, 11), gil_locked=20), FakeMemory(base))[0] is None
    assert "free-threaded" in gil_layout(process((3, 13), free_threaded=True), FakeMemory(base))[1]
    # 3.12: through the main interpreter's ceval.gil; not initialised yet is fine
    p = process((3, 12))
    o = p.offsets
    base = {0x1000 + o["runtime_interpreters_head"]: interp, interp + o["interp_threads_head"]: ts,
            ts + o["tstate_next"]: 0, interp + o["interp_next"]: 0}
    lay, why = gil_layout(p, FakeMemory(with_(base, {interp + o["interp_ceval_gil"]: 0x5000,
                                                      0x5008: ts, 0x5010: 1})))
    assert (lay.addr, lay.interp_ceval_gil, why) == (0, o["interp_ceval_gil"], "")
    assert gil_layout(p, FakeMemory(with_(base, {interp + o["interp_ceval_gil"]: 0})))[0] is not None


def test_a_stack_whose_frames_cannot_be_built_is_counted_and_the_rest_stands(monkeypatch):
    """One process's data that merge does not expect (here: a code object
    whose reading raises) gives [frames not read] for that stack, counted
    and named in the recording's notes; every other stack is as it was
    (issue 43: one bad process never ends a recording, a top or a snapshot)."""
    from pyoffcpu.profile import merge
    from pyoffcpu.profile.model import FRAMES_NOT_READ
    from pyoffcpu.profile.summary import recording_notes
    on, held = bpfdefs.KIND_ONCPU, bpfdefs.GIL_HELD
    rec = recording({(1, on, held): 700, (2, on, held): 300})
    real = merge.Merger._frames_for

    def broken_for_thread_2(self, tgid, ustack, kstack, pyhash, ns):
        if ns == 300:
            raise KeyError("co_qualname")
        return real(self, tgid, ustack, kstack, pyhash, ns)
    monkeypatch.setattr(merge.Merger, "_frames_for", broken_for_thread_2)
    prof, stats = build_profile(rec, symbolizer=None)
    assert {k.tid: [f.name for f in k.frames] for k in prof.weights} == {
        1: ["spin"], 2: [FRAMES_NOT_READ.name]}
    assert prof.total_ns(tid=1) == 700 and prof.total_ns(tid=2) == 300
    assert (stats.failed_stacks, stats.failed_ns) == (1, 300)
    note = [n for n in recording_notes(rec, stats) if "could not be built" in n]
    assert note and "KeyError: 'co_qualname' in test_gil.py:" in note[0], note
