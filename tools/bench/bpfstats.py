"""BPF-side measurements of another process's programs and maps (root only).

- kernel.bpf_stats_enabled: turned on for the runs that read program run
  times, back to its first value otherwise and at the end.
- Program run time: /proc/PID/fdinfo/FD of each bpf-prog fd of the profiler
  holds run_time_ns and run_cnt (counted while the sysctl is on); the name
  comes from BPF_OBJ_GET_INFO_BY_FD on a copy of the fd (pidfd_getfd).
- First sample: a copy of the profiler's `agg` map fd, polled with
  BPF_MAP_GET_NEXT_KEY until it holds an entry: the moment the first sample
  (on-CPU) or closed off-CPU interval is in the kernel's aggregation map.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Dict, Optional, Tuple

from harness import parse_fdinfo

SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
NR_BPF = 321                # x86_64
NR_PIDFD_GETFD = 438
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_GET_INFO_BY_FD = 15
PROG_TYPES = {5: "tracepoint", 7: "perf_event"}


class StatsSysctl:
    """kernel.bpf_stats_enabled, on only while a measurement needs it: it adds
    two clock reads to every run of every BPF program, which the slowdown pairs
    must not pay. `on()` sets it, `off()` puts back the value found first."""

    def __init__(self):
        self.original: Optional[str] = None
        try:
            with open(SYSCTL) as f:
                self.original = f.read().strip()
        except OSError:
            pass

    @property
    def available(self) -> bool:
        return self.original is not None

    def _write(self, value: str) -> bool:
        try:
            with open(SYSCTL, "w") as f:
                f.write(value)
            return True
        except OSError:
            return False

    def on(self) -> bool:
        return self.available and self._write("1")

    def off(self):
        if self.available:
            self._write(self.original)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.off()


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    return _libc.syscall(NR_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))


def steal_fd(pidfd: int, fd: int) -> int:
    """A copy of another process's fd in this one (pidfd_getfd); -1 on failure."""
    return _libc.syscall(NR_PIDFD_GETFD, pidfd, fd, 0)


def _obj_name(fd: int, name_off: int, info_size: int) -> str:
    info = ctypes.create_string_buffer(info_size)
    attr = ctypes.create_string_buffer(16)
    ctypes.c_uint32.from_buffer(attr, 0).value = fd
    ctypes.c_uint32.from_buffer(attr, 4).value = info_size
    ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(info)
    if _bpf(BPF_OBJ_GET_INFO_BY_FD, attr) != 0:
        return ""
    return info.raw[name_off:name_off + 16].split(b"\0", 1)[0].decode(errors="replace")


def map_name(fd: int) -> str:
    # struct bpf_map_info: type, id, key_size, value_size, max_entries, map_flags, name[16]
    return _obj_name(fd, 24, 88)


def prog_name(fd: int) -> str:
    # struct bpf_prog_info: ... name[16] at offset 64
    return _obj_name(fd, 64, 232)


def map_has_entries(fd: int) -> bool:
    attr = ctypes.create_string_buffer(32)
    key = ctypes.create_string_buffer(256)
    ctypes.c_uint32.from_buffer(attr, 0).value = fd
    ctypes.c_uint64.from_buffer(attr, 8).value = 0          # NULL: the first key
    ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(key)
    if _bpf(BPF_MAP_GET_NEXT_KEY, attr) == 0:
        return True
    e = ctypes.get_errno()
    if e != errno.ENOENT:
        raise OSError(e, os.strerror(e))
    return False


def _bpf_fds(pid: int, kind: str):
    """The fds of `pid` that are BPF objects of `kind` (bpf-prog, bpf-map)."""
    want = f"anon_inode:{kind}"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                out.append(int(fd))
        except OSError:
            pass
    return sorted(out)


def new_map_fds(pid: int, pidfd: int, checked: set):
    """(their fd, our copy) for each bpf-map fd of `pid` not yet in `checked`
    (which it extends); the caller owns, and closes, the copies."""
    for fd in _bpf_fds(pid, "bpf-map"):
        if fd in checked:
            continue
        checked.add(fd)
        mine = steal_fd(pidfd, fd)
        if mine >= 0:
            yield fd, mine


class ProgStats:
    """Reads run_cnt / run_time_ns of every BPF program a process holds."""

    def __init__(self, pid: int):
        self.pid = pid
        self.names: Dict[int, str] = {}
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            self.pidfd = -1

    def _name(self, fd: int, info: Dict[str, str]) -> str:
        name = self.names.get(fd)
        if name is None:
            name = ""
            if self.pidfd >= 0:
                mine = steal_fd(self.pidfd, fd)
                if mine >= 0:
                    try:
                        name = prog_name(mine)
                    finally:
                        os.close(mine)
            if not name:
                t = int(info.get("prog_type", "-1"))
                name = PROG_TYPES.get(t, f"prog_type {t}")
            self.names[fd] = name
        return name

    def read(self) -> Dict[str, Tuple[int, int]]:
        """{program name: (run_cnt, run_time_ns)}, summed over same-named fds."""
        out: Dict[str, Tuple[int, int]] = {}
        for fd in _bpf_fds(self.pid, "bpf-prog"):
            try:
                with open(f"/proc/{self.pid}/fdinfo/{fd}") as f:
                    info = parse_fdinfo(f.read())
            except OSError:
                continue
            if "run_cnt" not in info:
                continue
            name = self._name(fd, info)
            c, n = out.get(name, (0, 0))
            out[name] = (c + int(info["run_cnt"]), n + int(info["run_time_ns"]))
        return out

    def close(self):
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class FirstSampleProbe:
    """Polls the profiler's `agg` map (a copy of its fd) for its first entry."""

    def __init__(self, pid: int, map_name_: str = "agg"):
        self.pid = pid
        self.want = map_name_
        self.fd = -1
        self.checked = set()
        self.pidfd = os.pidfd_open(pid)

    def poll(self) -> bool:
        """True once the map holds an entry."""
        if self.fd < 0:
            for _, mine in new_map_fds(self.pid, self.pidfd, self.checked):
                if map_name(mine) == self.want:
                    self.fd = mine
                    break
                os.close(mine)
            if self.fd < 0:
                return False
        return map_has_entries(self.fd)

    def close(self):
        for fd in (self.fd, self.pidfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.pidfd = -1


BPF_MAP_LOOKUP_ELEM = 1
# map types whose entries come and go (hash maps, stack traces): counted key by key;
# arrays always hold max_entries and are left out (the drops array is read instead)
COUNTED_MAP_TYPES = {1: "hash", 5: "percpu_hash", 7: "stack_trace", 9: "lru_hash", 10: "lru_percpu_hash"}
PERCPU_ARRAY = 6


def map_info(fd: int) -> Optional[Tuple[int, int, int, int, str]]:
    """(type, key_size, value_size, max_entries, name) of a map fd, None on failure."""
    info = ctypes.create_string_buffer(88)
    attr = ctypes.create_string_buffer(16)
    ctypes.c_uint32.from_buffer(attr, 0).value = fd
    ctypes.c_uint32.from_buffer(attr, 4).value = 88
    ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(info)
    if _bpf(BPF_OBJ_GET_INFO_BY_FD, attr) != 0:
        return None
    u32 = [ctypes.c_uint32.from_buffer(info, off).value for off in (0, 8, 12, 16)]
    name = info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")
    return u32[0], u32[1], u32[2], u32[3], name


def count_keys(fd: int, key_size: int, limit: int) -> int:
    """Distinct keys of a hash or stack-trace map, walked with
    BPF_MAP_GET_NEXT_KEY. The owner deletes entries meanwhile (a hash map's
    walk starts over when its current key is gone): the walk stops at the
    first key it has seen before, and after `limit` steps."""
    attr = ctypes.create_string_buffer(32)
    cur = ctypes.create_string_buffer(max(8, key_size))
    nxt = ctypes.create_string_buffer(max(8, key_size))
    ctypes.c_uint32.from_buffer(attr, 0).value = fd
    ctypes.c_uint64.from_buffer(attr, 8).value = 0          # NULL: the first key
    ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(nxt)
    seen = set()
    for _ in range(limit):
        if _bpf(BPF_MAP_GET_NEXT_KEY, attr) != 0:
            e = ctypes.get_errno()
            if e == errno.ENOENT:
                break
            raise OSError(e, os.strerror(e))
        k = nxt.raw[:key_size]
        if k in seen:
            break
        seen.add(k)
        ctypes.memmove(cur, nxt, key_size)
        ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(cur)
    return len(seen)


def possible_cpus() -> int:
    """Number of possible CPUs (the size of a per-CPU value)."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            text = f.read().strip()
    except OSError:
        return os.cpu_count() or 1
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


class MapCounter:
    """Occupancy of another process's BPF maps, read from outside: copies of
    its bpf-map fds (pidfd_getfd), hash and stack-trace maps counted key by
    key, and one per-CPU u64 array (`drops`) summed over the CPUs. The copies
    keep the maps alive: close() as soon as the readings are done."""

    def __init__(self, pid: int, drops_map: str = "drops"):
        self.pid = pid
        self.drops_map = drops_map
        self.maps: Dict[int, Tuple[int, int, int, int, int, str]] = {}   # their fd: (our fd, info...)
        self.checked = set()
        self.ncpu = possible_cpus()
        self.pidfd = os.pidfd_open(pid)

    def _scan(self):
        for fd, mine in new_map_fds(self.pid, self.pidfd, self.checked):
            info = map_info(mine)
            if info is None or not (info[0] in COUNTED_MAP_TYPES
                                    or (info[0] == PERCPU_ARRAY and info[4] == self.drops_map)):
                os.close(mine)
                continue
            self.maps[fd] = (mine, *info)

    def read(self) -> Tuple[Dict[str, Tuple[int, int]], Dict[int, int]]:
        """({map name: (entries, max_entries)}, {drop index: count summed over CPUs})."""
        if self.pidfd >= 0:
            self._scan()
        entries: Dict[str, Tuple[int, int]] = {}
        drops: Dict[int, int] = {}
        for mine, typ, ksz, vsz, cap, name in self.maps.values():
            try:
                if typ == PERCPU_ARRAY:
                    drops = self._read_percpu_u64(mine, vsz, cap)
                else:
                    n = count_keys(mine, ksz, cap + 1024)
                    old = entries.get(name, (0, 0))
                    entries[name] = (old[0] + n, old[1] + cap)
            except OSError:
                continue
        return entries, drops

    def _read_percpu_u64(self, fd: int, value_size: int, n: int) -> Dict[int, int]:
        stride = (value_size + 7) // 8 * 8
        val = ctypes.create_string_buffer(stride * self.ncpu)
        key = ctypes.c_uint32()
        attr = ctypes.create_string_buffer(32)
        ctypes.c_uint32.from_buffer(attr, 0).value = fd
        ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(key)
        ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(val)
        out = {}
        for i in range(n):
            key.value = i
            if _bpf(BPF_MAP_LOOKUP_ELEM, attr) != 0:
                continue
            out[i] = sum(ctypes.c_uint64.from_buffer(val, c * stride).value for c in range(self.ncpu))
        return out

    def close(self):
        for v in self.maps.values():
            os.close(v[0])
        self.maps.clear()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
