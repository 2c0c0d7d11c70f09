"""The system calls a wait is told by: their numbers (x86_64) by what they
wait for, their names, and how a key's kind carries the one a thread
blocked in (bpf/pyoffcpu.h: the bits from SYS_SHIFT hold its number + 1,
SYS_OUTSIDE when the thread was in none, 0 when that cannot be told)."""
from __future__ import annotations

from typing import Optional

from . import bpfdefs

SYS_SLEEP = {35: "nanosleep", 230: "clock_nanosleep"}
SYS_LOCK = {202: "futex", 449: "futex_waitv", 65: "semop", 220: "semtimedop"}
SYS_POLL = {7: "poll", 23: "select", 232: "epoll_wait", 270: "pselect6", 271: "ppoll",
            281: "epoll_pwait", 441: "epoll_pwait2"}
SYS_IO = {0: "read", 1: "write", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev",
          40: "sendfile", 42: "connect", 43: "accept", 44: "sendto", 45: "recvfrom",
          46: "sendmsg", 47: "recvmsg", 275: "splice", 276: "tee", 288: "accept4",
          295: "preadv", 296: "pwritev", 299: "recvmmsg", 307: "sendmmsg", 327: "preadv2",
          328: "pwritev2", 208: "io_getevents", 426: "io_uring_enter", 74: "fsync",
          75: "fdatasync", 277: "sync_file_range"}
SYS_GPU = {16: "ioctl"} | SYS_POLL | {0: "read"}     # under a GPU library's frames

def syscall_name(nr: int) -> str:
    """The name of a system call the tables above know, else `syscall N`."""
    for table in (SYS_SLEEP, SYS_LOCK, SYS_POLL, SYS_IO):
        if nr in table:
            return table[nr]
    return f"syscall {nr}"


UNKNOWN = -1                        # Wait.sys: no user registers to tell


def split_kind(kind: int):
    """(KIND_*, Wait.sys) of a key's kind (see the module's doc)."""
    sys = (kind >> bpfdefs.SYS_SHIFT) & 0xFFFF      # not the GIL bits above it
    if sys == 0:
        return kind & 0xFF, UNKNOWN
    return kind & 0xFF, (None if sys == bpfdefs.SYS_OUTSIDE else sys - 1)


def with_sys(kind: int, sys: Optional[int]) -> int:
    """A key's kind with its system call (split_kind's inverse)."""
    if sys == UNKNOWN:
        return kind
    return kind | ((bpfdefs.SYS_OUTSIDE if sys is None else sys + 1) << bpfdefs.SYS_SHIFT)
