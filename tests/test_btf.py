"""Tests for pyoffcpu.btf: synthetic blobs, and the running kernel's BTF
checked against what a BPF program reads from the current task."""

import ctypes
import os
import struct
import threading
import time

import pytest

from pyoffcpu.kernel.btf import Btf, BtfError

VMLINUX = "/sys/kernel/btf/vmlinux"


# ---------------------------------------------------------------------------
# A tiny BTF writer, so the parser is tested on known layouts.
# ---------------------------------------------------------------------------
class BlobBuilder:
    def __init__(self, endian="<"):
        self.e = endian
        self.strings = bytearray(b"\0")
        self.types = bytearray()
        self.count = 0

    def s(self, name):
        if not name:
            return 0
        off = len(self.strings)
        self.strings += name.encode() + b"\0"
        return off

    def _rec(self, name, kind, vlen, kflag, size_or_type, extra=b""):
        info = (kflag << 31) | (kind << 24) | vlen
        self.types += struct.pack(self.e + "III", self.s(name), info,
                                  size_or_type) + extra
        self.count += 1
        return self.count

    def int_(self, name, size):
        return self._rec(name, 1, 0, 0, size,
                         struct.pack(self.e + "I", size * 8))

    def ptr(self, to):
        return self._rec("", 2, 0, 0, to)

    def array(self, elem, index, n):
        return self._rec("", 3, 0, 0, 0,
                         struct.pack(self.e + "III", elem, index, n))

    def composite(self, kind, name, size, members, kflag=0):
        extra = b"".join(struct.pack(self.e + "III", self.s(n), t, o)
                         for n, t, o in members)
        return self._rec(name, kind, len(members), kflag, size, extra)

    def enum(self, name, values):
        extra = b"".join(struct.pack(self.e + "Ii", self.s(n), v)
                         for n, v in values)
        return self._rec(name, 6, len(values), 0, 4, extra)

    def enum64(self, name, values):
        extra = b"".join(struct.pack(self.e + "III", self.s(n), v & 0xffffffff,
                                     v >> 32) for n, v in values)
        return self._rec(name, 19, len(values), 0, 8, extra)

    def simple(self, kind, name, type_id):
        return self._rec(name, kind, 0, 0, type_id)

    def func_proto(self, ret, params):
        extra = b"".join(struct.pack(self.e + "II", self.s(n), t)
                         for n, t in params)
        return self._rec("", 13, len(params), 0, ret, extra)

    def var(self, name, t):
        return self._rec(name, 14, 0, 0, t, struct.pack(self.e + "I", 1))

    def datasec(self, name, entries):
        extra = b"".join(struct.pack(self.e + "III", *x) for x in entries)
        return self._rec(name, 15, len(entries), 0, 64, extra)

    def decl_tag(self, name, t, idx):
        return self._rec(name, 17, 0, 0, t, struct.pack(self.e + "i", idx))

    def blob(self):
        hdr_len = 24
        hdr = struct.pack(self.e + "HBBIIIII", 0xEB9F, 1, 0, hdr_len, 0,
                          len(self.types), len(self.types), len(self.strings))
        return hdr + bytes(self.types) + bytes(self.strings)


def build_sample(endian="<"):
    b = BlobBuilder(endian)
    u32 = b.int_("unsigned int", 4)
    u64 = b.int_("long unsigned int", 8)
    u8 = b.int_("char", 1)
    # Unrelated kinds to be skipped.
    b.enum("color", [("RED", 0), ("GREEN", 1)])
    b.enum64("big", [("HUGE", 1 << 40)])
    fp = b.func_proto(u32, [("a", u32), ("b", u64)])
    b.simple(12, "some_func", fp)        # FUNC
    b.simple(7, "fwd_only", 0)           # FWD
    b.simple(16, "double", 8)            # FLOAT
    v = b.var("some_var", u32)
    b.datasec(".data", [(v, 0, 4)])
    b.decl_tag("tag", u32, -1)
    u64_td = b.simple(8, "u64_t", u64)           # TYPEDEF
    u64_cv = b.simple(9, "", b.simple(10, "", u64_td))  # VOLATILE CONST
    u64_tt = b.simple(18, "user", u64_cv)        # TYPE_TAG
    comm = b.array(u8, u32, 16)
    # struct inner { u64 a; u64 fsbase; }  (size 16)
    inner = b.composite(4, "inner", 16, [("a", u64, 0), ("fsbase", u64_tt, 64)])
    inner_td = b.simple(8, "inner_t", b.simple(11, "", inner))  # RESTRICT
    # anonymous union { u32 x; struct { u32 y; u32 z; }; }
    anon_s = b.composite(4, "", 8, [("y", u32, 0), ("z", u32, 32)])
    anon_u = b.composite(5, "", 8, [("x", u32, 0), ("", anon_s, 0)])
    # struct outer with bitfields (kind_flag): flag1:1 @bit 64, flag2:3 @65
    outer = b.composite(4, "outer", 64, [
        ("pid", u32, (0 << 24) | 0),
        ("tgid", u32, (0 << 24) | 32),
        ("flag1", u32, (1 << 24) | 64),
        ("flag2", u32, (3 << 24) | 65),
        ("", anon_u, 96),
        ("thread", inner_td, 256),
        ("comm", comm, 384),
    ], kflag=1)
    # Duplicate name: a second, different 'outer' with only 'other'.
    b.composite(4, "outer", 8, [("other", u64, 0)])
    return b.blob(), dict(u32=u32, u64=u64, outer=outer)


@pytest.mark.parametrize("endian", ["<", ">"])
def test_synthetic_layout(endian):
    blob, ids = build_sample(endian)
    btf = Btf(blob)
    assert btf.member_offset("outer", "pid") == 0
    assert btf.member_offset("outer", "tgid") == 4
    assert btf.member_offset("outer", "thread") == 32
    assert btf.member_offset("outer", "thread.fsbase") == 40
    assert btf.member_offset("outer", "thread.a") == 32
    # anonymous union, and an anonymous struct inside it
    assert btf.member_offset("outer", "x") == 12
    assert btf.member_offset("outer", "y") == 12
    assert btf.member_offset("outer", "z") == 16
    assert btf.member_offset("outer", "comm") == 48
    assert btf.member_offset("outer", "comm[5]") == 53
    # kind_flag bitfields
    info = btf.member_info("outer", "flag2")
    assert (info.bit_offset, info.bitfield_size) == (65, 3)
    assert btf.member_info("outer", "flag1").bitfield_size == 1
    assert btf.member_offset("outer", "flag1") == 8
    with pytest.raises(BtfError, match="bitfield"):
        btf.member_offset("outer", "flag2")
    # duplicate struct names: the one that has the member wins
    assert btf.member_offset("outer", "other") == 0
    assert btf.struct_size("inner") == 16
    assert btf.type_size(btf.member_info("outer", "thread.fsbase").type_id) == 8


def test_synthetic_errors():
    blob, _ = build_sample()
    btf = Btf(blob)
    with pytest.raises(BtfError, match="no struct or union named 'nope'"):
        btf.member_offset("nope", "pid")
    with pytest.raises(BtfError, match="has no member 'nope'"):
        btf.member_offset("outer", "thread.nope")
    with pytest.raises(BtfError, match="not a struct or union"):
        btf.member_offset("outer", "pid.x")
    with pytest.raises(BtfError, match="out of range"):
        btf.member_offset("outer", "comm[16]")
    with pytest.raises(BtfError):
        btf.member_offset("outer", "")
    with pytest.raises(BtfError, match="magic"):
        Btf(b"\0" * 64)
    with pytest.raises(BtfError):
        Btf.load("/nonexistent/btf")


def test_truncated_blob_rejected():
    blob, _ = build_sample()
    hdr = bytearray(blob[:24])
    struct.pack_into("<I", hdr, 12, struct.unpack_from("<I", hdr, 12)[0] - 4)
    with pytest.raises(BtfError):
        Btf(bytes(hdr) + blob[24:])


# ---------------------------------------------------------------------------
# The running kernel.
# ---------------------------------------------------------------------------
needs_vmlinux = pytest.mark.skipif(not os.path.exists(VMLINUX),
                                   reason="no kernel BTF")


@pytest.fixture(scope="module")
def vmlinux():
    return Btf.load()


@needs_vmlinux
def test_vmlinux_loads_fast():
    t0 = time.perf_counter()
    btf = Btf.load()
    btf.member_offset("task_struct", "thread.fsbase")
    btf.member_offset("task_struct", "tgid")
    assert time.perf_counter() - t0 < 1.0
    assert btf.type_count > 10000


@needs_vmlinux
def test_vmlinux_offsets_plausible(vmlinux):
    pid = vmlinux.member_offset("task_struct", "pid")
    tgid = vmlinux.member_offset("task_struct", "tgid")
    fsbase = vmlinux.member_offset("task_struct", "thread.fsbase")
    size = vmlinux.struct_size("task_struct")
    assert tgid == pid + 4
    assert 0 < pid < size
    assert vmlinux.member_offset("task_struct", "thread") < fsbase < size
    assert vmlinux.member_offset("thread_struct", "fsbase") == \
        fsbase - vmlinux.member_offset("task_struct", "thread")
    with pytest.raises(BtfError):
        vmlinux.member_offset("task_struct", "thread.no_such_field")


def _arch_get_fs():
    """FS base of the calling thread via arch_prctl(ARCH_GET_FS)."""
    libc = ctypes.CDLL(None, use_errno=True)
    out = ctypes.c_ulong(0)
    rc = libc.syscall(ctypes.c_long(158), ctypes.c_int(0x1003),
                      ctypes.byref(out))
    if rc != 0:
        raise OSError(ctypes.get_errno(), "arch_prctl(ARCH_GET_FS)")
    return out.value


BPF_PROG = r"""
BPF_HASH(seen, u32, struct sample);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    if ((pid_tgid >> 32) != TARGET_TGID)
        return 0;
    char *task = (char *)bpf_get_current_task();
    struct sample s = {};
    s.pid_tgid = pid_tgid;
    bpf_probe_read_kernel(&s.tgid, sizeof(s.tgid), task + TGID_OFF);
    bpf_probe_read_kernel(&s.pid, sizeof(s.pid), task + PID_OFF);
    bpf_probe_read_kernel(&s.fsbase, sizeof(s.fsbase), task + FSBASE_OFF);
    u32 tid = (u32)pid_tgid;
    seen.update(&tid, &s);
    return 0;
}
"""

BPF_HEADER = r"""
struct sample {
    u64 pid_tgid;
    u64 fsbase;
    u32 tgid;
    u32 pid;
};
"""


@needs_vmlinux
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF")
def test_vmlinux_offsets_match_running_task(vmlinux):
    bcc = pytest.importorskip("bcc")
    if not os.path.isdir("/sys/kernel/tracing/events/syscalls"):
        pytest.skip("no syscall tracepoints")
    offs = {
        "TGID_OFF": vmlinux.member_offset("task_struct", "tgid"),
        "PID_OFF": vmlinux.member_offset("task_struct", "pid"),
        "FSBASE_OFF": vmlinux.member_offset("task_struct", "thread.fsbase"),
        "TARGET_TGID": os.getpid(),
    }
    cflags = [f"-D{k}={v}" for k, v in offs.items()]
    try:
        prog = bcc.BPF(text=(BPF_HEADER + BPF_PROG).encode(), cflags=cflags)
    except Exception as e:  # pragma: no cover - environment problem
        pytest.skip(f"bcc cannot compile here: {e}")

    expected = {}

    def probe():
        expected[threading.get_native_id()] = _arch_get_fs()
        os.getppid()

    try:
        probe()
        t = threading.Thread(target=probe)
        t.start()
        t.join()
        seen = {k.value: v for k, v in prog[b"seen"].items()}
    finally:
        prog.cleanup()

    assert set(expected) <= set(seen), (expected, seen)
    fsbases = set()
    for tid, fs in expected.items():
        s = seen[tid]
        assert s.tgid == s.pid_tgid >> 32 == os.getpid()
        assert s.pid == (s.pid_tgid & 0xFFFFFFFF) == tid
        assert s.fsbase == fs, (hex(s.fsbase), hex(fs))
        fsbases.add(fs)
    assert len(fsbases) == 2  # two threads, two distinct TLS blocks


def test_the_word_index_and_the_struct_index_agree_and_refuse_the_same_blobs(monkeypatch):
    """The index of every type record is read as native words where the blob
    is in this machine's order, else record by record with struct: the same
    positions and kinds on vmlinux's BTF, and both refuse a type section cut
    inside a record."""
    import struct
    import sys
    from pyoffcpu.kernel import btf
    if not os.path.exists(btf.VMLINUX_BTF):
        pytest.skip("no kernel BTF")
    raw = open(btf.VMLINUX_BTF, "rb").read()
    fast = btf.Btf(raw)
    monkeypatch.setattr(btf.sys, "byteorder", "big" if sys.byteorder == "little" else "little")
    slow = btf.Btf(raw)
    assert fast._offsets == slow._offsets and fast._kinds == slow._kinds and fast.type_count > 1000
    hdr_len, type_off, type_len = struct.unpack_from("<III", raw, 4)
    cut = bytearray(raw)
    struct.pack_into("<I", cut, 12, type_len - 4)        # the section ends 4 bytes early
    for order in ("little", "big"):
        monkeypatch.setattr(btf.sys, "byteorder", order)
        with pytest.raises(btf.BtfError):
            btf.Btf(bytes(cut))
