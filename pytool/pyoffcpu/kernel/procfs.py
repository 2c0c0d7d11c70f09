"""What /proc says about a process or thread: small readers that never raise."""
from __future__ import annotations

import os
import time
from typing import Dict, List, NamedTuple, Optional


def read_text(path: str, limit: int = 64 << 20) -> Optional[str]:
    """A /proc file's text, at most ``limit`` bytes of it (a process sizes
    its command line and maps), None when it cannot be read (the task is
    gone).  Read in 64 KiB pieces through a bare descriptor: -a reads
    these files many times a second, and a buffered file object costs
    three more system calls, a `read(limit)` a 64 MiB buffer each time."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts, size = [], 0
        while size < limit:
            got = os.read(fd, min(65536, limit - size))
            if not got:
                break
            parts.append(got)
            size += len(got)
        return b"".join(parts).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def ns_id(status_path: str, host_id: int) -> int:
    """The id of a task in its own (innermost) PID namespace, from the NSpid
    line of /proc/.../status; 0 when it is the host's id or unknown."""
    for line in (read_text(status_path) or "").splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            inner = int(ids[-1]) if ids and ids[-1].isdigit() else 0
            return inner if inner != host_id else 0
    return 0


def stat_fields(stat_path: str) -> List[str]:
    """The fields of a /proc/.../stat file after the command name (which may
    hold spaces and parentheses): [0] the state, [1] the parent PID, [19]
    the start time; [] when it is gone."""
    return (read_text(stat_path) or "").rsplit(")", 1)[-1].split()


def proc_state(stat_path: str) -> str:
    """The state letter of a /proc/.../stat file ("" when it is gone)."""
    fields = stat_fields(stat_path)
    return fields[0] if fields else ""


def comm(pid: int, tid: Optional[int] = None) -> str:
    """The process's (or thread's) name, "?" when it is gone."""
    path = f"/proc/{pid}/comm" if tid is None else f"/proc/{pid}/task/{tid}/comm"
    return (read_text(path) or "?").strip() or "?"


def cmdline(pid: int) -> str:
    """The command line, its NULs as spaces; "" for a kernel thread or when gone."""
    return (read_text(f"/proc/{pid}/cmdline", 1 << 20) or "").replace("\0", " ").strip()


class Syscall(NamedTuple):
    """/proc/PID/task/TID/syscall of a thread that is not running: the call
    it is blocked in (nr -1: none, a fault or an interrupt), its six
    arguments (none when nr is -1), and its user sp and pc."""
    nr: int
    args: tuple
    sp: int
    pc: int


def blocked_syscall(pid: int, tid: int) -> Optional[Syscall]:
    """What the kernel says a thread is blocked in; None when it is running,
    gone, or the file is not readable."""
    parts = (read_text(f"/proc/{pid}/task/{tid}/syscall") or "").split()
    if len(parts) < 3 or parts[0] == "running":
        return None
    try:
        nr = int(parts[0])
        args = tuple(int(p, 16) for p in parts[1:-2])
        return Syscall(nr, args, int(parts[-2], 16), int(parts[-1], 16))
    except ValueError:
        return None


def children_by_parent() -> Dict[int, List[int]]:
    """Every process's children (PIDs), by parent PID."""
    import os
    out: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat_fields(f"/proc/{name}/stat")
            if len(fields) > 1 and fields[1].isdigit():
                out.setdefault(int(fields[1]), []).append(int(name))
    return out


def process_alive(pid: int) -> bool:
    return proc_state(f"/proc/{pid}/stat") not in ("", "Z", "X")


def rss_kib() -> int:
    """This process's resident memory."""
    for line in (read_text("/proc/self/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_ticks(pid: int) -> int:
    """When a process started (clock ticks after boot, /proc/PID/stat field
    22): a PID and this name one process, however often the PID is reused.
    0 when it is gone (or a zombie: it has ended)."""
    fields = stat_fields(f"/proc/{pid}/stat")
    if len(fields) <= 19 or fields[0] in ("Z", "X") or not fields[19].isdigit():
        return 0
    return int(fields[19])


def uid_of(pid: int) -> Optional[int]:
    for line in (read_text(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


class CpuTimes(NamedTuple):
    """The machine's CPU time so far, all CPUs together (s, /proc/stat's
    first line): busy (user, nice, system, irq, softirq and steal) and, of
    that, stolen (the time the hypervisor ran something else while a vCPU
    had work: 0 on bare metal and where the kernel does not account it)."""
    busy_s: float
    steal_s: float


def cpu_times() -> Optional[CpuTimes]:
    """None where /proc/stat cannot be read or has no steal column."""
    fields = (read_text("/proc/stat", 4096) or "").split("\n", 1)[0].split()
    if len(fields) < 9 or fields[0] != "cpu" or not all(f.isdigit() for f in fields[1:9]):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    hz = os.sysconf("SC_CLK_TCK")
    return CpuTimes((user + nice + system + irq + softirq + steal) / hz, steal / hz)


def wall_time_of(monotonic_ns: int) -> float:
    """The unix time of an instant of CLOCK_MONOTONIC: the two clocks read
    side by side, the closest of three pairs (a pair far apart was
    interrupted between its reads)."""
    best_gap, offset = None, 0
    for _ in range(3):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best_gap is None or after - before < best_gap:
            best_gap, offset = after - before, wall - (before + after) // 2
    return (monotonic_ns + offset) / 1e9
