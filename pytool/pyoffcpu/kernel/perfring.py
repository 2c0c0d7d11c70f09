"""The perf buffers of BPF_MAP_TYPE_PERF_EVENT_ARRAY maps, read in Python
with nothing but the standard library (no C library to install).

A buffer is one ring per online CPU: a perf event (PERF_COUNT_SW_BPF_OUTPUT,
PERF_SAMPLE_RAW) whose fd is the map's element at key = cpu, so that a BPF
program's perf_submit on that CPU lands in its ring; the ring is mmap'd,
one metadata page (struct perf_event_mmap_page) then 2^n pages of records.
The kernel writes records and moves data_head; the reader reads them and
moves data_tail.  A record is a struct perf_event_header {u32 type; u16
misc; u16 size}: PERF_RECORD_SAMPLE then u32 size and the raw bytes the
program sent (the u32 and the bytes padded to 8 together: the size counts
the padding), PERF_RECORD_LOST then u64 id and u64 count.  A record can
wrap around the ring's end: its two parts are joined.  A ring whose
numbers make no sense (a record of size 0, or larger than what is there)
is read no further: what is left in it is dropped and counted as lost,
so that a read always ends.

PerfBuffers holds a program's buffers and the wait on them: one epoll set
over the per-CPU fds of the buffers that wake it, waited on with libc's
epoll_wait, which a signal ends (EINTR) even when its handler only sets a
flag: Python's select.epoll would retry it (PEP 475) until the timeout.

The rings are mapped with libc's mmap (Python's mmap would hold a dup of
every fd) and read through a ctypes char array over them: struct reads
them in place, and a slice of it is the bytes handed to the callback.
"""
from __future__ import annotations

import ctypes as ct
import fcntl
import mmap
import os
import select
import struct
import sys
import time
import traceback
from typing import Callable, List, Optional, Tuple

from .bpfsys import (BPF_ANY, MAP_DELETE_ELEM, MAP_UPDATE_ELEM, PERF_COUNT_SW_BPF_OUTPUT,
                     PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_ENABLE, PERF_SAMPLE_RAW, PERF_TYPE_SOFTWARE,
                     map_elem, online_cpus, perf_event_open)

PERF_RECORD_LOST, PERF_RECORD_SAMPLE = 2, 9
PAGE = mmap.PAGESIZE
HEAD_OFF, TAIL_OFF, DATA_OFF = 1024, 1032, 1040     # in struct perf_event_mmap_page
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_HDR = struct.Struct("<IHH")                        # struct perf_event_header
_HDR_RAW = struct.Struct("<IHHI")                   # ... and a sample's raw size
_DATA = struct.Struct("<QQ")                        # data_offset, data_size

_libc = ct.CDLL(None, use_errno=True)
_libc.mmap.restype = ct.c_void_p
_libc.mmap.argtypes = [ct.c_void_p, ct.c_size_t, ct.c_int, ct.c_int, ct.c_int, ct.c_long]
_libc.munmap.restype = ct.c_int
_libc.munmap.argtypes = [ct.c_void_p, ct.c_size_t]
_MAP_FAILED = ct.c_void_p(-1).value


class _EpollEvent(ct.Structure):
    """struct epoll_event (packed on x86-64)."""
    _pack_ = 1
    _fields_ = [("events", ct.c_uint32), ("data", ct.c_uint64)]


def epoll_wait(epfd: int, timeout: int) -> int:
    """libc's epoll_wait for one event, timeout in ms (-1: forever): -1
    when a signal ended it (EINTR), which Python's select.epoll would hide."""
    ev = _EpollEvent()
    return _libc.epoll_wait(epfd, ct.byref(ev), 1, timeout)


def _callback_failed(fn) -> None:
    """What ctypes did for an exception in a callback of the C reader this
    replaces: said, and the records go on (a recording outlives one bad
    record)."""
    print(f"Exception ignored in perf buffer callback {fn!r}:", file=sys.stderr)
    traceback.print_exc()


def read_ring(buf, base: int, size: int, cpu: int, callback: Callable[[int, bytes], None],
              lost_cb: Optional[Callable[[int], None]] = None) -> Tuple[int, int]:
    """Every record between data_tail and data_head of the ring in buf (the
    metadata page at 0, the records at [base, base + size)): callback(cpu,
    raw bytes) for each sample, lost_cb(count) for each PERF_RECORD_LOST;
    data_tail moved past them, also when a callback raises.  buf: what
    slices to bytes (a ctypes char array, as the rings are read).  Returns
    (samples, broken): broken counts the records given up on (a malformed
    sample, or the rest of a ring whose numbers make no sense), also
    passed to lost_cb."""
    head = _U64.unpack_from(buf, HEAD_OFF)[0]       # first: the records before it are written
    tail = _U64.unpack_from(buf, TAIL_OFF)[0]
    if head == tail:
        return 0, 0
    n = broken = 0
    end = base + size
    last = end - 8                                  # a header there has its raw size after the wrap
    hdr, hdr_raw, u32 = _HDR.unpack_from, _HDR_RAW.unpack_from, _U32.unpack_from
    try:
        if head - tail > size or head < tail or tail & 7:
            broken, tail = 1, head
        while tail < head:
            off = base + tail % size
            if off < last:                          # the header and a sample's raw size, at once
                kind, _, rsize, raw = hdr_raw(buf, off)
            else:
                kind, _, rsize = hdr(buf, off)
                raw = -1
            if rsize < 8 or rsize & 7 or rsize > head - tail:
                broken, tail = broken + 1, head     # the ring is read no further
                break
            tail += rsize
            if off + rsize <= end:
                rec, o = buf, off
            else:                                   # wraps: its two parts, joined
                rec, o = buf[off:end] + buf[base:base + off + rsize - end], 0
            if kind == PERF_RECORD_SAMPLE:
                if raw < 0 and rsize >= 12:
                    raw = u32(rec, o + 8)[0]
                if rsize < 12 or raw > rsize - 12:
                    broken += 1
                    continue
                n += 1
                try:
                    callback(cpu, rec[o + 12:o + 12 + raw])
                except Exception:                   # noqa: BLE001 (said; the records go on)
                    _callback_failed(callback)
            elif kind == PERF_RECORD_LOST and rsize >= 24 and lost_cb is not None:
                try:
                    lost_cb(_U64.unpack_from(rec, o + 16)[0])
                except Exception:                   # noqa: BLE001
                    _callback_failed(lost_cb)
    finally:
        _U64.pack_into(buf, TAIL_OFF, tail)
    if broken and lost_cb is not None:
        try:
            lost_cb(broken)
        except Exception:                           # noqa: BLE001
            _callback_failed(lost_cb)
    return n, broken


def ring_layout(buf, length: int) -> Tuple[int, int]:
    """(data_offset, data_size) of a ring mapped in length bytes: the
    metadata page's, else (older kernels: 0) the page after it and the rest."""
    off, size = _DATA.unpack_from(buf, DATA_OFF)
    if not off or not size:
        off, size = PAGE, length - PAGE
    if off < HEAD_OFF + 16 or size <= 0 or size & 7 or off + size > length:
        raise OSError(0, f"perf ring of {length} bytes: data at {off}, {size} bytes")
    return off, size


class _Ring:
    __slots__ = ("cpu", "fd", "addr", "length", "buf", "base", "size")

    def __init__(self, cpu: int, fd: int):
        self.cpu, self.fd, self.addr, self.length = cpu, fd, 0, 0
        self.buf = None
        self.base = self.size = 0


class PerfBuffer:
    """One map's rings, one per online CPU (those the map has a key for).
    Raises OSError (nothing left open)."""

    def __init__(self, map_fd: int, callback: Callable[[int, bytes], None], page_cnt: int = 8,
                 lost_cb: Optional[Callable[[int], None]] = None, wakes: bool = True,
                 max_entries: Optional[int] = None):
        if page_cnt <= 0 or page_cnt & (page_cnt - 1):
            raise ValueError("page_cnt must be a power of two")
        self.map_fd, self.callback, self.lost_cb, self.wakes = map_fd, callback, lost_cb, wakes
        self.rings: List[_Ring] = []
        self.broken = 0                 # records given up on (read_ring)
        self.armed = False              # its fds in PerfBuffers' epoll set
        try:
            for cpu in online_cpus():
                if max_entries is None or cpu < max_entries:
                    self._open(cpu, page_cnt)
        except BaseException:
            self.close()
            raise

    def _open(self, cpu: int, page_cnt: int) -> None:
        fd = perf_event_open(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_BPF_OUTPUT, 1, 0, -1, cpu, -1,
                             sample_type=PERF_SAMPLE_RAW, wakeup_events=1)
        r = _Ring(cpu, fd)
        self.rings.append(r)
        length = (1 + page_cnt) * PAGE
        addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            e = ct.get_errno()
            raise OSError(e, f"mmap of the perf ring of CPU {cpu}: {os.strerror(e)}")
        r.addr, r.length = addr, length
        r.buf = (ct.c_char * length).from_address(addr)
        r.base, r.size = ring_layout(r.buf, length)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
        map_elem(MAP_UPDATE_ELEM, self.map_fd, ct.c_uint32(cpu), ct.c_uint32(fd), BPF_ANY)

    def fds(self) -> List[int]:
        return [r.fd for r in self.rings]

    def read(self) -> int:
        """Every record of every ring, read; how many samples."""
        n = 0
        cb, lost = self.callback, self.lost_cb
        for r in self.rings:
            if r.buf is not None:
                got, broken = read_ring(r.buf, r.base, r.size, r.cpu, cb, lost)
                n += got
                self.broken += broken
        return n

    def close(self) -> None:
        """Out of the map, unmapped, disabled and closed."""
        rings, self.rings = self.rings, []
        for r in rings:
            try:
                map_elem(MAP_DELETE_ELEM, self.map_fd, ct.c_uint32(r.cpu))
            except OSError:
                pass
            r.buf = None
            if r.addr:
                _libc.munmap(r.addr, r.length)
                r.addr = 0
            try:
                fcntl.ioctl(r.fd, PERF_EVENT_IOC_DISABLE, 0)
            except OSError:
                pass
            os.close(r.fd)


class PerfBuffers:
    """A program's perf buffers and the wait on them (see the module's doc)."""

    def __init__(self):
        self.buffers: List[PerfBuffer] = []
        self._epoll: Optional[select.epoll] = None
        self._waking: List[PerfBuffer] = []

    def open(self, map_fd: int, callback: Callable[[int, bytes], None], page_cnt: int = 8,
             lost_cb: Optional[Callable[[int], None]] = None, wakes: bool = True,
             max_entries: Optional[int] = None) -> PerfBuffer:
        """A buffer for the map (PerfBuffer), in the wait from now on unless
        wakes=False: read at every poll, but a record in it does not end a
        poll's wait (the buffers wake it when none does)."""
        b = PerfBuffer(map_fd, callback, page_cnt, lost_cb, wakes, max_entries)
        self.buffers.append(b)
        try:
            self._arm()
        except BaseException:
            self.buffers.pop()
            b.close()
            raise
        return b

    def _arm(self) -> None:
        """The epoll set holds the fds of the buffers that wake it."""
        waking = [b for b in self.buffers if b.wakes] or list(self.buffers)
        if self._epoll is None:
            self._epoll = select.epoll()
        for b in self.buffers:
            if b.armed != (b in waking):
                for fd in b.fds():
                    if b.armed:
                        self._epoll.unregister(fd)
                    else:
                        self._epoll.register(fd, select.EPOLLIN)
                b.armed = not b.armed
        self._waking = waking

    def poll(self, timeout: int = -1) -> None:
        """What is there already, read; if nothing came in a buffer that
        wakes, a wait of up to timeout ms (-1: until a record or a signal,
        0: none), then every buffer read."""
        if not self.buffers:
            if timeout > 0:
                time.sleep(timeout / 1000)
            return
        if not sum(b.read() for b in self._waking) and timeout != 0 and self._epoll is not None:
            epoll_wait(self._epoll.fileno(), int(timeout))
        for b in self.buffers:
            b.read()

    def close(self) -> None:
        buffers, self.buffers, self._waking = self.buffers, [], []
        try:
            for b in buffers:
                b.close()
        finally:
            if self._epoll is not None:
                self._epoll.close()
                self._epoll = None
