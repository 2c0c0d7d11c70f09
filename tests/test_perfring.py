"""The perf buffers' reader (kernel/perfring.py): the ring parser on rings
laid out by hand (records that wrap the end, LOST records, a header whose
size makes no sense), the wait a signal ends, the poll's order, and, as
root, a real ring a BPF program writes to (BPF_PROG_TEST_RUN of an XDP
program: no bcc, no tracepoint)."""
import ctypes as ct
import os
import select
import signal
import struct
import time

import pytest

from pyoffcpu.kernel import bpfsys, perfring
from pyoffcpu.kernel.perfring import PAGE, PerfBuffers, read_ring

SIZE = 256                                  # the data part of the rings built here


class Ring:
    """A ring as the kernel lays it out: the metadata page, then SIZE bytes."""

    def __init__(self, size=SIZE, tail=0):
        self.size = size
        self.mem = bytearray(PAGE + size)
        self.buf = (ct.c_char * len(self.mem)).from_buffer(self.mem)
        struct.pack_into("<QQQQ", self.mem, 1024, tail, tail, PAGE, size)

    @property
    def head(self):
        return struct.unpack_from("<Q", self.mem, 1024)[0]

    @property
    def tail(self):
        return struct.unpack_from("<Q", self.mem, 1032)[0]

    def put(self, record: bytes):
        """record written at head (wrapping the end), head moved past it."""
        h = self.head
        for i, b in enumerate(record):
            self.mem[PAGE + (h + i) % self.size] = b
        struct.pack_into("<Q", self.mem, 1024, h + len(record))

    def read(self, lost=None, cpu=3):
        got = []
        n = read_ring(self.buf, PAGE, self.size, cpu, lambda c, d: got.append((c, d)),
                      lost.append if lost is not None else None)
        return n, got


def sample(payload: bytes, raw=None) -> bytes:
    """A PERF_RECORD_SAMPLE as the kernel writes it: the u32 and the raw
    bytes padded to 8 together, the u32 counting the padding (raw: another)."""
    padded = payload.ljust(-(-(4 + len(payload)) // 8) * 8 - 4, b"\0")
    size = 8 + 4 + len(padded)
    return struct.pack("<IHHI", 9, 0, size, len(padded) if raw is None else raw) + padded


def lost(count: int) -> bytes:
    return struct.pack("<IHHQQ", 2, 0, 24, 77, count)


def test_several_records_are_read_in_order_and_the_tail_moved():
    r = Ring()
    for p in (b"a" * 4, b"b" * 8, b"c" * 20):
        r.put(sample(p))
    n, got = r.read()
    assert n == (3, 0)
    # the raw size the kernel reports counts the padding: 4 + 8 -> 16
    assert got == [(3, b"aaaa"), (3, b"b" * 8 + b"\0" * 4), (3, b"c" * 20)]
    assert r.tail == r.head == 16 + 24 + 32
    assert r.read() == ((0, 0), [])


def test_exactly_the_raw_size_given_is_handed_over():
    r = Ring()
    r.put(sample(b"xyz12345", raw=5))
    assert r.read() == ((1, 0), [(3, b"xyz12")])


def test_a_record_that_wraps_the_end_is_joined():
    r = Ring(tail=3 * SIZE + 232)           # 24 bytes before the end, in the ring's 4th lap
    r.put(sample(b"0123456789abcdefghijklmnopqr"))      # 8 + 32 bytes: 16 of it wrap
    r.put(sample(b"next"))
    n, got = r.read()
    assert n == (2, 0)
    assert got == [(3, b"0123456789abcdefghijklmnopqr"), (3, b"next")]
    assert r.tail == 3 * SIZE + 232 + 40 + 16


def test_a_header_in_the_last_8_bytes_has_its_size_after_the_wrap():
    r = Ring(tail=SIZE - 8)
    r.put(sample(b"wrapped!" * 2 + b"tail"))
    assert r.read() == ((1, 0), [(3, b"wrapped!" * 2 + b"tail")])
    assert r.tail == SIZE - 8 + 32


def test_a_lost_record_is_counted_and_the_next_one_read():
    r = Ring()
    r.put(sample(b"one!"))
    r.put(lost(17))
    r.put(sample(b"two!"))
    counts = []
    n, got = r.read(lost=counts)
    assert n == (2, 0) and counts == [17]
    assert [d for _, d in got] == [b"one!", b"two!"]


def test_other_record_types_are_skipped():
    r = Ring()
    r.put(struct.pack("<IHH", 5, 0, 16) + b"\0" * 8)       # PERF_RECORD_THROTTLE-like
    r.put(sample(b"kept"))
    assert r.read() == ((1, 0), [(3, b"kept")])


@pytest.mark.parametrize("size", [0, 4, 12, SIZE + 8, 0xfff8])
def test_a_header_whose_size_makes_no_sense_ends_the_read_of_the_ring(size):
    r = Ring()
    r.put(sample(b"good"))
    r.put(struct.pack("<IHH", 9, 0, size) + b"\0" * 8)
    r.put(sample(b"never"))
    counts = []
    n, got = r.read(lost=counts)
    assert n == (1, 1) and got == [(3, b"good")] and counts == [1]
    assert r.tail == r.head                 # the rest dropped: the next read starts afresh
    assert r.read() == ((0, 0), [])


def test_a_record_longer_than_what_is_there_ends_the_read():
    r = Ring()
    rec = sample(b"12345678901234567890")
    r.put(rec[:16])                         # head in the middle of it
    n, got = r.read(lost=[])
    assert n == (0, 1) and got == [] and r.tail == r.head == 16


def test_a_head_more_than_a_ring_ahead_is_not_read():
    r = Ring()
    struct.pack_into("<Q", r.mem, 1024, SIZE + 8)
    assert r.read() == ((0, 1), [])
    assert r.tail == SIZE + 8


def test_a_sample_whose_raw_size_overruns_its_record_is_skipped():
    r = Ring()
    r.put(sample(b"abcd", raw=100))
    r.put(sample(b"fine"))
    counts = []
    n, got = r.read(lost=counts)
    assert n == (1, 1) and got == [(3, b"fine")] and counts == [1]


def test_a_callback_that_raises_is_said_and_the_records_go_on(capsys):
    r = Ring()
    r.put(sample(b"bad!"))
    r.put(sample(b"good"))
    got = []

    def cb(cpu, data):
        if data == b"bad!":
            raise ValueError("a consumer's bug")
        got.append(data)
    assert read_ring(r.buf, PAGE, SIZE, 0, cb) == (2, 0)
    assert got == [b"good"]
    assert "a consumer's bug" in capsys.readouterr().err


def test_a_keyboard_interrupt_in_a_callback_ends_the_read_past_its_record():
    r = Ring()
    r.put(sample(b"one!"))
    r.put(sample(b"two!"))

    def cb(cpu, data):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        read_ring(r.buf, PAGE, SIZE, 0, cb)
    assert r.tail == 16                     # the record it came in is read, the next is not
    assert r.read() == ((1, 0), [(3, b"two!")])


def test_the_wait_ends_at_a_signal_whose_handler_only_sets_a_flag():
    """SIGTERM's handler in a session only sets a flag: libc's epoll_wait
    returns at it (EINTR), where select.epoll would wait out the timeout."""
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *_: seen.append(1))
    rfd, wfd = os.pipe()
    ep = select.epoll()
    try:
        ep.register(rfd, select.EPOLLIN)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        assert perfring.epoll_wait(ep.fileno(), 5000) == -1
        assert time.monotonic() - t0 < 2 and seen
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        ep.close()
        os.close(rfd)
        os.close(wfd)


class FakeBuffer:
    """A PerfBuffer's face to PerfBuffers: a pipe for its fd, and the number
    of records each read finds."""

    def __init__(self, wakes, records=()):
        self.wakes, self.armed = wakes, False
        self.rfd, self.wfd = os.pipe()
        self.records = list(records)
        self.reads = 0

    def fds(self):
        return [self.rfd]

    def read(self):
        self.reads += 1
        return self.records.pop(0) if self.records else 0

    def close(self):
        os.close(self.rfd)
        os.close(self.wfd)


def buffers(*fakes):
    pb = PerfBuffers()
    for f in fakes:
        pb.buffers.append(f)
        pb._arm()
    return pb


def test_a_poll_with_records_there_does_not_wait():
    a, quiet = FakeBuffer(True, [2]), FakeBuffer(False)
    pb = buffers(a, quiet)
    t0 = time.monotonic()
    pb.poll(5000)
    assert time.monotonic() - t0 < 1
    assert a.reads == 2 and quiet.reads == 1
    pb.close()


def test_a_buffer_that_does_not_wake_is_read_but_never_ends_the_wait():
    a, quiet = FakeBuffer(True), FakeBuffer(False)
    pb = buffers(a, quiet)
    assert a.armed and not quiet.armed
    os.write(quiet.wfd, b"x")               # ready, but not in the epoll set
    t0 = time.monotonic()
    pb.poll(300)
    assert time.monotonic() - t0 >= 0.25
    assert quiet.reads == 1
    os.write(a.wfd, b"x")                   # the waking one ends it at once
    t0 = time.monotonic()
    pb.poll(5000)
    assert time.monotonic() - t0 < 1
    pb.close()


def test_buffers_that_none_wake_are_waited_on_all():
    quiet = FakeBuffer(False)
    pb = buffers(quiet)
    assert quiet.armed
    os.write(quiet.wfd, b"x")
    t0 = time.monotonic()
    pb.poll(5000)
    assert time.monotonic() - t0 < 1
    a = FakeBuffer(True)                    # one that wakes: the others are out of the set
    pb.buffers.append(a)
    pb._arm()
    assert a.armed and not quiet.armed
    pb.close()


def test_no_buffers_a_poll_sleeps_its_timeout():
    t0 = time.monotonic()
    PerfBuffers().poll(100)
    assert time.monotonic() - t0 >= 0.09


# -- a real ring, as root -----------------------------------------------------------------------
_PROG_TEST_RUN, _XDP = 10, 6


def _insn(code, dst=0, src=0, off=0, imm=0):
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def xdp_output(map_fd: int, words: int) -> bytes:
    """An XDP program that sends words u64s (i, i+1, ...) with
    bpf_perf_event_output to the map, at key = the CPU it runs on."""
    code = _insn(0xbf, 6, 1)                                  # r6 = ctx
    for i in range(words):
        code += _insn(0x7a, 10, 0, -8 * words + 8 * i, 0x1000 + i)    # *(u64 *)(r10 - ..) = imm
    code += _insn(0xbf, 1, 6)                                 # r1 = ctx
    code += _insn(0x18, 2, 1, 0, map_fd) + _insn(0)           # r2 = the map
    code += _insn(0xb4, 3, 0, 0, -1)                          # w3 = BPF_F_CURRENT_CPU
    code += _insn(0xbf, 4, 10) + _insn(0x07, 4, 0, 0, -8 * words)   # r4 = the words
    code += _insn(0xb7, 5, 0, 0, 8 * words)                   # r5 = their size
    code += _insn(0x85, 0, 0, 0, 25)                          # bpf_perf_event_output
    code += _insn(0xb7, 0, 0, 0, 2) + _insn(0x95)             # return XDP_PASS
    return code


def run_xdp(prog_fd: int, repeat: int) -> None:
    packet = ct.create_string_buffer(64)
    a = bpfsys.new_attr()
    struct.pack_into("<IIIIQQII", a, 0, prog_fd, 0, len(packet), 0, ct.addressof(packet), 0,
                     repeat, 0)
    bpfsys.bpf_call(_PROG_TEST_RUN, a)


@pytest.fixture
def real_ring():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    ncpu = max(bpfsys.possible_cpus()) + 1
    map_fd = bpfsys.map_create(bpfsys.BPF_MAP_TYPE_PERF_EVENT_ARRAY, 4, 4, ncpu, 0, "ptest")
    words = 11                                                # 88 bytes, as a timeline event
    try:
        prog_fd, _ = bpfsys.prog_load(_XDP, xdp_output(map_fd, words), b"GPL", 0, "ptest")
    except OSError as e:
        os.close(map_fd)
        pytest.skip(f"the XDP program did not load: {e}")
    pb = PerfBuffers()
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})     # every record in one ring: exact counts
    try:
        yield pb, map_fd, prog_fd, words
    finally:
        os.sched_setaffinity(0, cpus)
        pb.close()
        os.close(prog_fd)
        os.close(map_fd)


def test_a_real_ring_filled_round_and_round_is_read_whole(real_ring):
    pb, map_fd, prog_fd, words = real_ring
    got, lost = [], []
    b = pb.open(map_fd, lambda cpu, d: got.append((cpu, d)), page_cnt=1, lost_cb=lost.append)
    assert [r.size for r in b.rings] == [PAGE] * len(bpfsys.online_cpus())
    assert all(r.base == PAGE for r in b.rings)
    per = PAGE // (8 + 4 + 8 * words + 4)                     # records a ring holds
    expect = b"".join(struct.pack("<Q", 0x1000 + i) for i in range(words))
    total = 0
    for _ in range(5):                      # round the ring several times: records wrap its end
        run_xdp(prog_fd, per - 1)
        total += per - 1
        pb.poll(1000)
    assert lost == [] and b.broken == 0
    assert len(got) == total
    # the raw size counts the padding to 8, which the kernel skips (stale bytes)
    assert all(len(d) == 8 * words + 4 and d[:8 * words] == expect for _, d in got)
    assert {c for c, _ in got} == os.sched_getaffinity(0)
    run_xdp(prog_fd, 3 * per)               # more than the ring holds: the kernel counts the rest
    pb.poll(0)
    assert len(got) == total + per and lost == []
    run_xdp(prog_fd, 1)                     # ... and says so before the next record
    pb.poll(0)
    assert lost == [2 * per] and len(got) == total + per + 1 and b.broken == 0


# -- the consumers: bytes in, a short record read without a crash -------------------------------
def test_timeline_keeps_the_event_without_the_padding_and_drops_a_short_one():
    from pyoffcpu.collect.timeline import EVENT, TimelineBuffer
    tl = TimelineBuffer(0, lambda ns: None)
    ev = EVENT.pack(1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0, b"comm")
    tl.on_event(0, ev + b"\xff" * 4)
    tl.on_event(0, ev[:40])
    assert bytes(tl.pending) == ev


def test_loop_wakes_take_the_tgid_and_skip_a_short_record():
    from types import SimpleNamespace

    from pyoffcpu.collect.session import Session
    s = SimpleNamespace(targets=SimpleNamespace(woken=[]))
    Session._on_loop_wake(s, 0, struct.pack("<I", 4321) + b"\0" * 4)
    Session._on_loop_wake(s, 0, b"\1\2")
    assert s.targets.woken == [4321]


@pytest.mark.parametrize("kind", range(1, 6))
def test_a_short_crash_record_of_each_kind_is_read_as_zeros(kind):
    from pyoffcpu.collect.crashcapture import CrashCapture, _T
    c = object.__new__(CrashCapture)
    c._pending = {}
    hdr = _T("crash_hdr")()
    hdr.kind, hdr.len = kind, 64
    c._on_record(0, bytes(hdr)[:ct.sizeof(hdr) - 1] if kind != 1 else bytes(hdr))
    c._on_record(0, b"\0")
    births = object.__new__(CrashCapture)
    births.births = []
    births._on_birth(0, b"\1")
    assert births.births[0].kind == 1
