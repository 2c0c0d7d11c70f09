"""bpf(2) and perf_event_open(2), called directly: maps made and read one
element or a batch at a time, programs loaded (the kernel's verifier runs),
raw tracepoints and perf events opened; the CPUs they run on.  The
constants are uapi/linux/bpf.h's and perf_event.h's, under bcc's names."""
from __future__ import annotations


import ctypes as ct
import os
import struct
from typing import List, Tuple




# program types (uapi/linux/bpf.h), under bcc.BPF's names
KPROBE, TRACEPOINT, PERF_EVENT, RAW_TRACEPOINT = 2, 5, 7, 17
# perf_event_open(2)
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK, PERF_COUNT_SW_BPF_OUTPUT = 0, 10
PERF_SAMPLE_RAW = 1 << 10
BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2

_NR_BPF, _NR_PERF_EVENT_OPEN = 321, 298          # x86_64
(_MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY,
 _PROG_LOAD) = range(6)
_OBJ_GET_INFO_BY_FD, _RAW_TRACEPOINT_OPEN = 15, 17
MAP_LOOKUP_BATCH, MAP_LOOKUP_AND_DELETE_BATCH, MAP_DELETE_BATCH = 24, 25, 27
LD_IMM64 = 0x18
PSEUDO_MAP_FD, PSEUDO_MAP_VALUE = 1, 2
PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_SET_BPF = 0x2400, 0x2401, 0x40042408
_PERF_FLAG_FD_CLOEXEC = 8
_ATTR_SIZE = 128                        # bytes of union bpf_attr passed (the rest is zero)

BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PROG_ARRAY, BPF_MAP_TYPE_PERF_EVENT_ARRAY, BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_STACK_TRACE = range(1, 8)
BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_LRU_PERCPU_HASH, BPF_MAP_TYPE_ARRAY_OF_MAPS = 9, 10, 12
BPF_F_MMAPABLE, BPF_F_INNER_MAP = 1 << 10, 1 << 12
INNER_SUFFIX = "_inner"                 # an array of maps X takes the maps of X_inner's kind
# bcc names programs without these prefixes (and at most 15 characters)
_NAME_PREFIXES = ("kprobe__", "kretprobe__", "tracepoint__", "raw_tracepoint__")
AUTOLOAD_PREFIX = "raw_tracepoint__"


class BpfError(Exception):
    """A load failed; the message is one line."""




# -- system calls ---------------------------------------------------------------------------------
_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


def _sys(nr: int, *args) -> int:
    r = _libc.syscall(ct.c_long(nr), *args)
    if r < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def bpf_call(cmd: int, attr) -> int:
    return _sys(_NR_BPF, ct.c_long(cmd), attr, ct.c_long(ct.sizeof(attr)))


def new_attr() -> ct.Array:
    return ct.create_string_buffer(_ATTR_SIZE)


def _addr(obj) -> int:
    return ct.addressof(obj) if obj is not None else 0


def map_create(mtype: int, key_size: int, value_size: int, max_entries: int, flags: int,
                name: str, inner_fd: int = 0) -> int:
    a = new_attr()
    struct.pack_into("<IIIIII", a, 0, mtype, key_size, value_size, max_entries, flags, inner_fd)
    struct.pack_into("16s", a, 28, name.encode()[:15])
    return bpf_call(_MAP_CREATE, a)


def create_array(name: str, value_size: int, max_entries: int, flags: int = 0) -> int:
    """A new BPF array map (u32 keys); its fd.  Raises OSError."""
    return map_create(BPF_MAP_TYPE_ARRAY, 4, value_size, max_entries, flags, name)


_MAP_UPDATE_BATCH = 26


def update_batch(fd: int, keys: List[int], values: List[int]) -> None:
    """u32 keys -> u32 values in one BPF_MAP_UPDATE_BATCH: for an array of
    maps, one wait for the programs that may hold an old slot (~9 ms here)
    instead of one per slot.  Raises OSError (then update one by one)."""
    n = len(keys)
    if not n:
        return
    ka = (ct.c_uint32 * n)(*keys)
    va = (ct.c_uint32 * n)(*values)
    a = new_attr()
    # in_batch, out_batch, keys, values, count, map_fd, elem_flags, flags
    struct.pack_into("<QQQQIIQQ", a, 0, 0, 0, ct.addressof(ka), ct.addressof(va), n, fd, 0, 0)
    bpf_call(_MAP_UPDATE_BATCH, a)


def map_elem(cmd: int, fd: int, key, value=None, flags: int = 0) -> int:
    a = new_attr()
    struct.pack_into("<I4xQQQ", a, 0, fd, _addr(key), _addr(value), flags)
    return bpf_call(cmd, a)


def update_elem(fd: int, key, value, flags: int = BPF_ANY) -> bool:
    """bpf_map_update_elem; False when the kernel refuses (BPF_NOEXIST: the key is there)."""
    try:
        map_elem(MAP_UPDATE_ELEM, fd, key, value, flags)
        return True
    except OSError:
        return False


def lookup_elem(fd: int, key, value) -> bool:
    """bpf_map_lookup_elem into value; False when the key is not there."""
    try:
        map_elem(MAP_LOOKUP_ELEM, fd, key, value)
        return True
    except OSError:
        return False


def map_info(fd: int) -> Tuple[int, int, int, int, int, str]:
    """(type, key_size, value_size, max_entries, flags, name) of a map fd."""
    info = ct.create_string_buffer(88)
    a = new_attr()
    struct.pack_into("<IIQ", a, 0, fd, len(info), ct.addressof(info))
    bpf_call(_OBJ_GET_INFO_BY_FD, a)
    mtype, _id, ks, vs, me, flags = struct.unpack_from("<6I", info, 0)
    return mtype, ks, vs, me, flags, info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")


def _kernel_name(func: str) -> str:
    """The name the kernel keeps (15 characters): bcc's section prefix off,
    and sched_process_ shortened so that exec and exit stay apart."""
    for p in _NAME_PREFIXES:
        if func.startswith(p):
            func = func[len(p):]
            break
    if func.startswith("sched_process_"):
        func = "sched_proc_" + func[len("sched_process_"):]
    return func[:15]


def prog_load(ptype: int, insns: bytes, license: bytes, kern_version: int, name: str,
               log_level: int = 0, log_size: int = 0) -> Tuple[int, str]:
    """(fd, verifier log); raises OSError with the log in .log."""
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license)
    log = ct.create_string_buffer(log_size) if log_level else None
    a = new_attr()
    struct.pack_into("<IIQQIIQII16s", a, 0, ptype, len(insns) // 8, ct.addressof(code),
                     ct.addressof(lic), log_level, log_size if log else 0, _addr(log),
                     kern_version, 0, _kernel_name(name).encode())
    try:
        fd = bpf_call(_PROG_LOAD, a)
    except OSError as e:
        e.log = log.value.decode(errors="replace") if log else ""
        raise
    return fd, (log.value.decode(errors="replace") if log else "")


def raw_tracepoint_open(tp: str, prog_fd: int) -> int:
    name = ct.create_string_buffer(tp.encode())
    a = new_attr()
    struct.pack_into("<QI", a, 0, ct.addressof(name), prog_fd)
    return bpf_call(_RAW_TRACEPOINT_OPEN, a)


def perf_event_open(ev_type: int, config: int, period: int, freq: int, pid: int, cpu: int,
                     group_fd: int, sample_type: int = 0, wakeup_events: int = 0) -> int:
    """A perf event's fd, disabled (PERF_EVENT_IOC_ENABLE starts it).
    wakeup_events: a poll of the fd wakes every that many records of its
    ring (perfring.py's per-CPU buffers); sample_type: PERF_SAMPLE_*."""
    attr = ct.create_string_buffer(112)          # PERF_ATTR_SIZE_VER5
    flags = 1                                    # disabled, until the program is set
    if freq:
        flags |= 1 << 10                         # freq: sample_freq in the period's place
    if pid > 0:
        flags |= 1 << 1                          # inherit (as bcc does for one process)
    struct.pack_into("<IIQQQ", attr, 0, ev_type, len(attr), config, freq or period, sample_type)
    struct.pack_into("<QI", attr, 40, flags, wakeup_events)
    return _sys(_NR_PERF_EVENT_OPEN, attr, ct.c_long(pid), ct.c_long(cpu), ct.c_long(group_fd),
                ct.c_long(_PERF_FLAG_FD_CLOEXEC))


def _cpu_list(path: str) -> List[int]:
    with open(path) as f:
        text = f.read().strip()
    out: List[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def online_cpus() -> List[int]:
    return _cpu_list("/sys/devices/system/cpu/online")


def possible_cpus() -> List[int]:
    return _cpu_list("/sys/devices/system/cpu/possible")


class Function:
    def __init__(self, bpf, name: bytes, fd: int, log: str = ""):     # bpf: collect.bpfload.Program
        self.bpf = bpf
        self.name = name
        self.fd = fd
        self.log = log                  # the verifier's log, with log_level
