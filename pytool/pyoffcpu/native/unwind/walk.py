"""The BPF unwinder's rules, in user space: native stacks of threads that are
already blocked when the recording starts (BPF only walks a thread when it
leaves the CPU).  /proc/PID/task/TID/syscall gives a blocked thread's user
sp and pc; rbp is not known there, so a frame whose CFA is rbp-based before
any callee has restored rbp ends the walk (it is marked incomplete)."""
from __future__ import annotations

import bisect
import os
import struct
from typing import Callable, List, Optional, Sequence, Tuple

from ...kernel.memory import readable_range
from ...kernel.procfs import blocked_syscall
from . import table as T

from ...kernel.bpfdefs import MAX_NATIVE_DEPTH as MAX_DEPTH
from ...kernel.bpfdefs import METHOD_FP, METHOD_PROLOGUE, METHOD_TABLE, METHODS, with_methods
from ...kernel.bpfdefs import (NST_FRAMEPOINTER, NST_INCOMPLETE, NST_PENDING, NST_PROLOGUE,
                                NST_TRUNCATED, NST_UNMAPPED)

# (start, end, runtime address of table pc 0, table) per executable mapping;
# table None: it is still being made (build.py), the walk stops there;
# NO_TABLE: a file without a table, walked by frame pointer.  A pc in no
# region is in anonymous memory (JIT code): the walk ends there, as BPF's.
NO_TABLE = False
Region = Tuple[int, int, int, object]
STACK_SNAPSHOT = 512 << 10          # bytes of a blocked thread's stack kept for a later walk


def blocked_registers(pid: int, tid: int) -> Optional[Tuple[int, int]]:
    """(pc, sp) in user space of a blocked thread; None when it runs."""
    sc = blocked_syscall(pid, tid)
    return (sc.pc, sc.sp) if sc is not None and sc.pc and sc.sp else None


def walk(regions: Sequence[Region], pc: int, sp: int, bp: Optional[int],
         read_u64: Callable[[int], Optional[int]], bx: Optional[int] = None) -> Tuple[List[int], int]:
    """(pcs innermost first, NST_* flags with the frames of each method), as
    bpf/unwind.c walks them (bp, bx: the leaf's rbp and rbx, None when not
    known)."""
    pcs, flags, methods = _walk(regions, pc, sp, bp, read_u64, bx)
    return pcs, with_methods(flags, methods)


def _walk(regions, pc, sp, bp, read_u64, bx):
    methods = [0] * METHODS
    regions = sorted(regions, key=lambda r: r[0])
    starts = [r[0] for r in regions]
    pcs: List[int] = []
    flags = 0
    while True:
        if len(pcs) >= MAX_DEPTH:
            return pcs, flags | NST_TRUNCATED, methods
        leaf = not pcs
        pcs.append(pc)
        lookup = pc if leaf else pc - 1
        i = bisect.bisect_right(starts, lookup) - 1
        region = regions[i] if i >= 0 and lookup < regions[i][1] else None
        rbp_at: Optional[int] = 0       # the caller's rbp at CFA + rbp_at; 0: unchanged; None: lost
        at_rbp = False                  # ... or the word at this frame's rbp (RBP_AT_RBP)
        method = METHOD_TABLE
        if region is not None and region[3] is None:
            return pcs, flags | NST_PENDING, methods
        if region is None and regions:
            return pcs, flags | NST_UNMAPPED | NST_INCOMPLETE, methods
        if region is not None and region[3] is not NO_TABLE:
            _, _, base, table = region
            _, off, kind, rbp = table.lookup(lookup - base + table.base)
            if kind & T.UR_DERIVED:
                kind &= ~T.UR_DERIVED
                flags |= NST_PROLOGUE
                method = METHOD_PROLOGUE
            if kind == T.UR_END:
                return pcs, flags, methods
            if kind == T.UR_RSP:
                cfa = sp + off
            elif kind == T.UR_RBP and bp is not None:
                cfa = bp + off
            elif kind == T.UR_PLT:
                cfa = sp + off + (8 if (lookup & 15) >= (rbp & 0xFF) else 0)
                rbp = 0
            elif kind == T.UR_DRAP and bp is not None:
                cfa = read_u64(bp + off)
                if cfa is None:
                    return pcs, flags | NST_INCOMPLETE, methods
            elif kind == T.UR_RBX and leaf and bx is not None:
                cfa = bx + off
            else:
                return pcs, flags | NST_INCOMPLETE, methods
            at_rbp = rbp == T.RBP_AT_RBP
            rbp_at = None if rbp == T.RBP_LOST else 0 if at_rbp else rbp * 8
        else:
            if bp is None or bp <= sp or bp - sp > (8 << 20):
                return pcs, flags | NST_INCOMPLETE, methods
            flags |= NST_FRAMEPOINTER
            method = METHOD_FP
            cfa = bp + 16
            rbp_at = -16
        if cfa <= sp and not leaf:
            return pcs, flags | NST_INCOMPLETE, methods
        ra = read_u64(cfa - 8)
        if ra is None:
            return pcs, flags | NST_INCOMPLETE, methods
        if rbp_at is None:
            bp = None
        elif at_rbp:
            bp = read_u64(bp)
        elif rbp_at:
            bp = read_u64(cfa + rbp_at)
        if ra == 0:
            return pcs, flags, methods
        methods[method] += 1
        pc, sp = ra, cfa


def stack_snapshot(pid: int, sp: int) -> Optional[bytes]:
    """The bytes of a stack from sp up to the end of the mapping holding sp
    (at most STACK_SNAPSHOT): with the registers, everything a walk of a
    thread that has not run since reads, so it can be walked later, once
    the tables are ready, and give what a walk now would have."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                lo, _, rest = line.partition("-")
                hi = rest.split(None, 1)[0]
                start, end = int(lo, 16), int(hi, 16)
                if start <= sp < end:
                    break
            else:
                return None
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        return os.pread(fd, min(end - sp, STACK_SNAPSHOT), sp)
    except (OSError, OverflowError):
        return None
    finally:
        os.close(fd)


def snapshot_reader(sp: int, data: bytes) -> Callable[[int], Optional[int]]:
    """read_u64 over a stack_snapshot taken at sp: a word outside it is not
    known (the walk ends there, it never reads the live stack instead)."""
    def read_u64(addr: int) -> Optional[int]:
        off = addr - sp
        if off < 0 or off + 8 > len(data):
            return None
        return struct.unpack_from("<Q", data, off)[0]
    return read_u64


def memory_reader(pid: int):
    """read_u64 over /proc/PID/mem; call .close() when done."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def read_u64(addr: int) -> Optional[int]:
        # a CFA or saved rbp from a garbage register can be any 64-bit value
        # (or negative after an offset): not readable, the walk ends there
        if not readable_range(addr, 8):
            return None
        try:
            data = os.pread(fd, 8, addr)
        except (OSError, OverflowError):
            return None
        return struct.unpack("<Q", data)[0] if len(data) == 8 else None
    read_u64.close = lambda: os.close(fd)
    return read_u64
