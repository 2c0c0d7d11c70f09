"""Reads of a target's memory through /proc/PID/mem treat an address no read
can reach (>= 2**63, negative, a range past 2**64, a size no buffer holds) as
a failed read, never an exception that escapes: such addresses come from
garbage pointers in torn structures.  The reads are of this test process."""
import ctypes
import dataclasses
import os
import struct
import threading
import time

import pytest

from pyoffcpu.native import libc
from pyoffcpu.cpython import detect, walker
from pyoffcpu.cpython.code import CodeReader
from pyoffcpu.kernel.memory import MemoryError_, ProcessMemory
from pyoffcpu.native.unwind import loader, walk
from pyoffcpu.native.unwind import table as T

HIGH = 1 << 63
BAD_ADDRESSES = [HIGH, HIGH + 8, (1 << 64) - 8, (1 << 64) - 1, 1 << 64, 1 << 70, -1, -(1 << 63), 0]

# a real, readable buffer of this process
SECRET = b"pyoffcpu memory test"
_buf = ctypes.create_string_buffer(SECRET, 4096)
GOOD = ctypes.addressof(_buf)


@pytest.fixture
def mem():
    m = ProcessMemory(os.getpid())
    yield m
    m.close()


def test_a_good_read_works(mem):
    assert mem.read(GOOD, len(SECRET)) == SECRET
    assert mem.u64(GOOD) == struct.unpack_from("<Q", SECRET)[0]


@pytest.mark.parametrize("addr", BAD_ADDRESSES, ids=hex)
def test_out_of_range_address_is_a_failed_read(mem, addr):
    for read in (lambda: mem.read(addr, 8), lambda: mem.read(addr, 1),
                 lambda: mem.u64(addr), lambda: mem.i64(addr),
                 lambda: mem.u32(addr), lambda: mem.i32(addr)):
        with pytest.raises(MemoryError_):
            read()


@pytest.mark.parametrize("addr,size", [
    (HIGH - 4, 8),                  # starts below 2**63, ends above it
    ((1 << 64) - 8, 16),            # addr + size past 2**64
    (GOOD, 1 << 64),                # a size that overflows the address space
    (GOOD, (1 << 64) - GOOD + 1),
    (GOOD, 1 << 62),                # fits the range, no buffer holds it
    (GOOD, -1),
    (GOOD, -(1 << 64)),
])
def test_size_out_of_range_is_a_failed_read(mem, addr, size):
    with pytest.raises(MemoryError_):
        mem.read(addr, size)


def test_unwind_memory_reader_fails_softly():
    read = walk.memory_reader(os.getpid())
    try:
        assert read(GOOD) == struct.unpack_from("<Q", SECRET)[0]
        for addr in BAD_ADDRESSES + [HIGH - 4, (1 << 64) - 4]:
            assert read(addr) is None, hex(addr)
    finally:
        read.close()


class OneRule:
    """An unwind table with one rule per pc (a stand-in for T.UnwindTable)."""
    base = 0

    def __init__(self, rules):
        self.rules = rules

    def lookup(self, vaddr):
        return self.rules.get(vaddr, (0, 16, T.UR_RSP, -2))


def test_walk_ends_at_a_garbage_saved_rbp():
    """A saved rbp of 2**63 on the stack, then a frame whose CFA is rbp-based:
    the CFA is past 2**63 and the walk ends there, incomplete."""
    a, b = 0x2000, 0x3001
    stack = (ctypes.c_uint64 * 2)(HIGH, b)      # [sp]: saved rbp, [sp+8]: return address
    sp = ctypes.addressof(stack)
    table = OneRule({a: (0, 16, T.UR_RSP, -2),              # CFA = sp + 16, rbp at CFA - 16
                     b - 1: (0, 16, T.UR_RBP, -2)})         # CFA = rbp + 16
    regions = [(0x1000, 0x100000, 0, table)]
    read = walk.memory_reader(os.getpid())
    try:
        pcs, flags = walk.walk(regions, a, sp, None, read)
        assert pcs == [a, b] and flags & walk.NST_INCOMPLETE, (pcs, flags)
        # and with an rbp of (1 << 64) - 8 passed in directly
        pcs, flags = walk.walk([(0x1000, 0x100000, 0, OneRule({a: (0, 16, T.UR_RBP, 0)}))],
                               a, sp, (1 << 64) - 8, read)
        assert pcs == [a] and flags & walk.NST_INCOMPLETE, (pcs, flags)
    finally:
        read.close()


def test_walk_follows_rbx_in_the_leaf_and_a_cfa_kept_in_the_frame():
    """The realigned kernel's rule (CFA = rbx + 24, the leaf only), then GCC's
    DRAP rule (CFA = the word at rbp - 8, the caller's rbp the word at rbp),
    then an rbp-based frame that needs that rbp: exact, as BPF walks them."""
    a, b, c = 0x2000, 0x3001, 0x4001
    w = (ctypes.c_uint64 * 16)()
    base = ctypes.addressof(w)
    w[2] = b                    # leaf: CFA = rbx + 24 = base + 24, its return address at base + 16
    w[4] = base + 64            # b: CFA kept at rbp - 8 (rbp = base + 40)
    w[5] = base + 96            # b: the caller's rbp, at rbp
    w[7] = c                    # b's return address, at its CFA - 8
    w[13] = 0                   # c: CFA = rbp + 16 = base + 112, return address 0: the end
    table = OneRule({a: (0, 24, T.UR_RBX, 0), b - 1: (0, -8, T.UR_DRAP, T.RBP_AT_RBP),
                     c - 1: (0, 16, T.UR_RBP, 0)})
    regions = [(0x1000, 0x100000, 0, table)]
    read = walk.memory_reader(os.getpid())
    try:
        pcs, flags = walk.walk(regions, a, base + 8, base + 40, read, bx=base)
        assert pcs == [a, b, c] and not flags & walk.NST_INCOMPLETE, (pcs, flags)
        # rbx not known (a blocked thread's registers from /proc): the walk stops
        pcs, flags = walk.walk(regions, a, base + 8, base + 40, read)
        assert pcs == [a] and flags & walk.NST_INCOMPLETE, (pcs, flags)
        # the rbx rule in a caller's frame: rbx is not the frame's there
        table.rules[a] = (0, 16, T.UR_RSP, 0)
        table.rules[b - 1] = (0, 24, T.UR_RBX, 0)
        pcs, flags = walk.walk(regions, a, base + 8, None, read, bx=base)
        assert pcs == [a, b] and flags & walk.NST_INCOMPLETE, (pcs, flags)
    finally:
        read.close()


def wait_until_blocked(t):
    """Until thread `t` of this process sits in a system call that
    /proc/PID/task/TID/syscall shows (what the blocked-thread walk reads)."""
    deadline = time.monotonic() + 10
    while walk.blocked_registers(os.getpid(), t.native_id) is None:
        if time.monotonic() > deadline:
            pytest.skip("cannot read /proc/PID/task/TID/syscall (ptrace access)")
        time.sleep(0.01)


def test_walk_blocked_survives_a_cfa_past_2_63():
    """walk_blocked of a real blocked thread of this process, with a rule that
    puts its CFA above 2**63 (what a garbage stack pointer gives)."""
    r, w = os.pipe()
    t = threading.Thread(target=os.read, args=(r, 1), daemon=True)
    t.start()
    try:
        wait_until_blocked(t)
        u = loader.NativeUnwinder(None, tables=False)
        for off in (HIGH, (1 << 64) - 1, -(1 << 64)):
            every_pc = OneRule({})
            every_pc.lookup = lambda vaddr, off=off: (0, off, T.UR_RSP, 0)
            u._regions[os.getpid()] = [(1, HIGH, 0, every_pc)]
            pcs, flags = u.walk_blocked(os.getpid(), t.native_id)
            assert len(pcs) == 1 and flags & walk.NST_INCOMPLETE, (hex(off), pcs, flags)
    finally:
        os.write(w, b"x")
        t.join(5)
        os.close(r)
        os.close(w)


# -- CPython structures of this process ------------------------------------------
@pytest.fixture(scope="module")
def this_python():
    try:
        pp = detect.find_python(os.getpid())
    except (detect.NotPython, detect.Unsupported) as e:
        pytest.skip(f"the test interpreter cannot be profiled: {e}")
    return pp


@pytest.fixture
def reader(this_python, mem):
    pp = this_python
    return CodeReader(mem, pp.minor, pp.offsets, pp.code_type)


def a_function_with_a_name():
    return 1


def test_code_reader_reads_a_real_code_object(reader):
    info = reader.code(id(a_function_with_a_name.__code__))
    assert info is not None and info.name.endswith("a_function_with_a_name"), info
    assert info.filename == __file__


@pytest.mark.parametrize("addr", BAD_ADDRESSES, ids=hex)
def test_code_reader_garbage_pointer_is_no_code(reader, addr):
    assert reader.code(addr) is None
    assert reader.code(addr) is None        # cached


class Struct:
    """A zeroed block of this process's memory standing in for a C struct."""

    def __init__(self, size=4096):
        self.buf = ctypes.create_string_buffer(size)
        self.addr = ctypes.addressof(self.buf)

    def set(self, offset, value, fmt="<Q"):
        assert offset >= 0
        struct.pack_into(fmt, self.buf, offset, value & ((1 << 64) - 1) if fmt == "<Q" else value)
        return self


@pytest.mark.parametrize("garbage", [HIGH, (1 << 64) - 8, (1 << 64) - 1])
def test_code_object_with_garbage_fields(this_python, reader, garbage):
    """A code object (its type checks out) whose name, file or line table
    pointer is garbage is no code, not an exception."""
    o = this_python.offsets
    name = o["code_qualname"] if o["code_qualname"] >= 0 else o["code_name"]
    for field in (name, o["code_filename"], o["code_linetable"]):
        code = Struct()
        if this_python.code_type:
            code.set(o["object_type"], this_python.code_type)
        code.set(field, garbage)
        assert reader.code(code.addr) is None


def _fake_thread_state(pp, tid, frame, keep):
    """A PyThreadState with thread id `tid` whose current frame is `frame`."""
    o, ts = pp.offsets, Struct()
    keep.append(ts)
    if o["tstate_native_thread_id"] >= 0:
        ts.set(o["tstate_native_thread_id"], tid)
    else:
        pthread = Struct()
        keep.append(pthread.set(libc.GLIBC_236.tid, tid, "<i"))
        ts.set(o["tstate_thread_id"], pthread.addr)
    if pp.minor <= (3, 10):
        ts.set(o["tstate_frame"], frame)
    elif o["tstate_cframe"] >= 0:
        cframe = Struct()
        keep.append(cframe.set(o["cframe_current_frame"], frame))
        ts.set(o["tstate_cframe"], cframe.addr)
    else:
        ts.set(o["tstate_current_frame"], frame)
    return ts


def test_thread_snapshot_garbage_runtime(this_python):
    for runtime in (HIGH, (1 << 64) - 8):
        assert walker.all_thread_stacks(dataclasses.replace(this_python, runtime=runtime)) == {}


def test_thread_snapshot_skips_garbage_frames(this_python, reader):
    """An interpreter with three threads: one whose frame pointer is 2**63, one
    with no frame, one whose frame's code pointer is 2**63.  The first is left
    out, the others are walked; the garbage code object reads as no code."""
    pp, o, keep = this_python, this_python.offsets, []
    frame = Struct()
    code_field = o["frame_code"] if pp.minor <= (3, 10) else o["iframe_code"]
    frame.set(code_field, HIGH)
    if pp.minor > (3, 10):
        frame.set(o["iframe_instr"], HIGH + o["code_code_adaptive"] + 6)
    threads = [_fake_thread_state(pp, 4001, HIGH, keep),
               _fake_thread_state(pp, 4002, 0, keep),
               _fake_thread_state(pp, 4003, frame.addr, keep)]
    for ts, nxt in zip(threads, threads[1:]):
        ts.set(o["tstate_next"], nxt.addr)
    interp = Struct().set(o["interp_threads_head"], threads[0].addr)
    runtime = Struct().set(o["runtime_interpreters_head"], interp.addr)
    stacks = walker.all_thread_stacks(dataclasses.replace(pp, runtime=runtime.addr))
    assert set(stacks) == {4002, 4003}, stacks
    assert stacks[4002] == ([], False)
    frames, truncated = stacks[4003]
    assert [f[0] for f in frames] == [HIGH] and not truncated
    assert reader.code(frames[0][0]) is None


def blocked_in_a_named_function(fd):
    os.read(fd, 1)


def test_thread_snapshot_of_this_process(this_python, reader):
    """The real snapshot still works: a thread of this process blocked in a
    Python function is walked to it (a running thread's frames move under
    the walk: blocked threads are what the snapshot is for)."""
    if this_python.tss_key < 0:
        pytest.skip("thread states not found")
    r, w = os.pipe()
    t = threading.Thread(target=blocked_in_a_named_function, args=(r,), daemon=True)
    t.start()
    try:
        wait_until_blocked(t)
        stacks = walker.all_thread_stacks(this_python)
    finally:
        os.write(w, b"x")
        t.join(5)
        os.close(r)
        os.close(w)
    frames, _ = stacks[t.native_id]
    names = [info.name for info in map(reader.code, (f[0] for f in frames)) if info]
    assert names and names[0].endswith("blocked_in_a_named_function"), names
