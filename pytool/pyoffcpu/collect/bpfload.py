"""Loads the BPF programs: those compiled when the package was built, else
this machine's cache of what bcc compiled, else bcc's compile now.

bcc compiles the BPF C with clang (seconds of CPU, and libbcc maps LLVM:
~65 MiB of RSS before anything is compiled, and it needs kernel headers).
What it produces is plain data: the instructions of each function after bcc's rewriting, whose
only references to this process are the maps' fds in `ld_imm64
src_reg=BPF_PSEUDO_MAP_FD imm=<fd>`, and the maps' attributes and key/leaf
type descriptions.  That is what the package ships (bpfobj/, made by `make
bpf-objects` with bcc, named by the sha256 of the source) and what the cache
holds; loading one imports nothing of bcc and needs no headers: the maps are created, their fds patched into the instructions, the
programs loaded (the kernel's verifier still runs) and attached with bpf(2)
and perf_event_open(2) directly.

The package's serve every kernel its verifier accepts them on: all that
depends on the kernel (its structs' offsets, from BTF), on the machine (its
CPUs: the perf event arrays are sized at load) and on the recording's
options is set at load time (bpf/loadconst.h).  Where they are refused, or
were built from another bpf/ (a changed tree), bcc compiles the text in a
child process (the compiler's memory leaves with it) that hands back the same
data; the entry is written and the programs are loaded from it the same way.

`load()` returns a `Program`: the part of bcc.BPF's interface the session and
the unwinder use (`[name]` tables with bcc's Key/Leaf ctypes, `load_func`,
`attach_perf_event`, `attach_raw_tracepoint` / `detach_raw_tracepoint`,
`perf_buffer_poll`, `funcs`, `cleanup`).  Functions named
`raw_tracepoint__<tp>` are loaded and attached by `load()`, as bcc does.

The cache: `$PYOFFCPU_CACHE_DIR/bpf` (`PYOFFCPU_CACHE_DIR=""`: no cache), else
`/var/cache/pyoffcpu/bpf` as root.  One file per key, written atomically
(mode 0600, directory 0700, both ours or not used: these programs run in the
kernel).  The key is the sha256 of everything the compile depends on: the
text, every cflag, the files of the -I directories, bcc's version and
library, and FORMAT; not the kernel: what the programs need of it (the
offsets of its structs, from BTF) and of the session (the sampling period)
are load-time constants (bpf/loadconst.h), written into the instructions
before the verifier sees them, so one entry serves every kernel.  A file
that is truncated, corrupt or for another key is compiled again, with a
one-line notice; so is one the verifier refuses.

The pieces: bpfsys.py (the system calls), perfring.py (the perf buffers'
rings, read in Python), tables.py (the maps as bcc shows them), progcache.py
(the cache's key and files, and bcc's compile); here, the Program they make
up and load().
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import struct
import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..kernel.bpfsys import (AUTOLOAD_PREFIX, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_LRU_HASH,
                     BPF_MAP_TYPE_PERF_EVENT_ARRAY, BPF_MAP_TYPE_STACK_TRACE, BpfError, Function,
                     KPROBE, PERF_EVENT, PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_ENABLE,
                     PERF_EVENT_IOC_SET_BPF, RAW_TRACEPOINT, TRACEPOINT, map_create, online_cpus,
                     perf_event_open, possible_cpus, prog_load, raw_tracepoint_open)
from .progcache import (CacheError, cache_key, check_entry, compile_in_child, default_cache_dir, one_line,
                        patch_consts, patch_kfuncs, read_entry, safe_dir, shipped_entry, write_entry)
from ..kernel.perfring import PerfBuffers
from .tables import TABLE_TYPES, Table, check_sizes, ctype_of


# -- the loaded programs ----------------------------------------------------------------------------
def _b(name) -> bytes:
    return name if isinstance(name, bytes) else str(name).encode()


class Program:
    """What bcc.BPF offered the session, over one compiled entry."""

    KPROBE, TRACEPOINT, PERF_EVENT, RAW_TRACEPOINT = KPROBE, TRACEPOINT, PERF_EVENT, RAW_TRACEPOINT
    Function = Function
    _perf: Optional[PerfBuffers] = None     # the perf buffers, from the first one opened

    def __init__(self, entry: dict, log_level: int = 0, consts: Optional[Dict[str, int]] = None):
        self.entry = entry
        self.consts = dict(consts or {})    # the load-time constants (bpf/loadconst.h)
        self.log_level = log_level
        self.origin = "compiled"        # or "package" (shipped), "cache" (this machine's)
        self.funcs: Dict[bytes, Function] = {}
        self.tables: Dict[bytes, Table] = {}
        self.raw_tracepoint_fds: Dict[bytes, int] = {}
        self.open_perf_events: Dict[tuple, Dict[int, int]] = {}
        self._specs = {m["name"]: m for m in entry["maps"]}
        self._progs = {p["name"]: p for p in entry["programs"]}
        self._map_fds: Dict[str, int] = {}
        self.load_errors: Dict[bytes, Exception] = {}   # optional programs that did not load
        self.cast_refused: List[str] = []   # programs loaded without KERNEL_CAST: the verifier refused it
        self._lock = threading.Lock()
        try:        # an array of maps after the template of its maps
            for m in sorted(entry["maps"], key=lambda m: m.get("inner") is not None):
                inner = self._map_fds[m["inner"]] if m.get("inner") else 0
                self._map_fds[m["name"]] = map_create(m["type"], m["key_size"], m["value_size"],
                                                       m["max_entries"], m["flags"], m["name"],
                                                       inner)
        except OSError as e:
            self.cleanup()
            raise BpfError(f"cannot create BPF map {m['name']}: {e.strerror}") from None

    @property
    def from_cache(self) -> bool:
        """Loaded without a compile (from the package or the cache)."""
        return self.origin != "compiled"

    # -- programs
    def _insns(self, name: str, cast: bool = True) -> bytes:
        """Its instructions to load: map fds and load-time constants written
        in; with cast=False, KERNEL_CAST 0 (task_struct read by the helper)."""
        p = self._progs[name]
        code = bytearray(base64.b64decode(p["insns"]))
        for idx, mname in p["maps"]:
            struct.pack_into("<i", code, idx * 8 + 4, self._map_fds[mname])
        consts = self.consts if cast else dict(self.consts, KERNEL_CAST=0)
        patch_consts(code, p["consts"], consts)
        if consts.get("KERNEL_CAST"):
            patch_kfuncs(code, p.get("kfuncs", ()), consts)
        return bytes(code)

    def _casts(self, name: str) -> bool:
        """Does the program, as _insns makes it, read kernel structs by plain
        loads (KERNEL_CAST 1 where it reads the constant: its kfunc calls,
        and the loads from pointers helpers return typed)?"""
        return bool(self.consts.get("KERNEL_CAST")
                    and any(c == "KERNEL_CAST" for _, c in self._progs[name]["consts"]))

    def load_func(self, func_name, prog_type: int, device=None, attach_type: int = -1) -> Function:
        key = _b(func_name)
        with self._lock:
            if key in self.funcs:
                return self.funcs[key]
            if key in self.load_errors:         # verified once already, and refused
                raise self.load_errors[key]
        name = key.decode()
        if name not in self._progs:
            raise Exception(f"Unknown program {name}")
        insns = self._insns(name)
        license = self.entry["license"].encode()
        kv = self.entry.get("kern_version", 0)
        level = self.log_level
        size = (16 << 20) if level & 3 else (1 << 16)
        try:
            try:
                fd, log = _verified(prog_type, insns, license, kv, name, level, size)
            except OSError as e:
                if e.errno == 1 or not self._casts(name):
                    raise
                # A kernel whose verifier refuses the kfunc here (its BTF
                # names it, yet this program type may not call it): the
                # helper's reads, as where BTF has no such kfunc
                insns = self._insns(name, cast=False)
                fd, log = _verified(prog_type, insns, license, kv, name, level, size)
                self.cast_refused.append(name)
        except OSError as e:
            log = getattr(e, "log", "")
            if not log and e.errno not in (1,):         # the verifier's reason, for the message
                try:
                    prog_load(prog_type, insns, license, kv, name, 1, 16 << 20)
                except OSError as e2:
                    log = getattr(e2, "log", "")
            lines = [ln for ln in log.strip().splitlines() if ln.strip()]
            why = f" (verifier: {lines[-1].strip()})" if lines else ""
            if e.errno == 1:
                raise Exception("Need super-user privileges to run") from None
            raise Exception(f"Failed to load BPF program {name}: {e.strerror}{why}") from None
        fn = Function(self, key, fd, log)
        with self._lock:
            if key in self.funcs:               # loaded by another thread meanwhile
                os.close(fd)
                return self.funcs[key]
            self.funcs[key] = fn
        return fn

    def load_funcs_parallel(self, specs: Sequence[Tuple[str, int]], optional: Iterable[str] = (),
                            meanwhile: Optional[Callable[["Program"], None]] = None) -> None:
        """Load several programs at once (the verifier runs in the calling
        thread, and ctypes lets go of the GIL meanwhile).  A program named in
        optional that fails is kept in load_errors (load_func raises it)
        instead of failing the call.  meanwhile(self): work of the caller's
        done in this thread while the verifier runs in the others (the maps
        exist; no program runs yet).  What it raises is raised after the
        programs are loaded."""
        errors: List[BaseException] = []
        optional = {_b(n) for n in optional}

        def one(name, ptype):
            try:
                self.load_func(name, ptype)
            except Exception as e:               # noqa: BLE001 (kept or re-raised below)
                if _b(name) in optional:
                    with self._lock:
                        self.load_errors[_b(name)] = e
                else:
                    errors.append(e)
            except BaseException as e:           # noqa: BLE001 (re-raised below)
                errors.append(e)
        mine = specs[:0] if meanwhile is not None else specs[:1]
        threads = [threading.Thread(target=one, args=s) for s in specs[len(mine):]]
        for t in threads:
            t.start()
        for s in mine:
            one(*s)
        failed = None
        if meanwhile is not None:
            try:
                meanwhile(self)
            except BaseException as e:      # noqa: BLE001 (raised once the threads are done)
                failed = e
        for t in threads:
            t.join()
        if failed is not None:
            raise failed
        if errors:
            raise errors[0]

    def function_names(self) -> List[str]:
        return list(self._progs)

    def attach_raw_tracepoint(self, tp=b"", fn_name=b""):
        tp = _b(tp)
        if tp in self.raw_tracepoint_fds:
            raise Exception(f"Raw tracepoint {tp.decode()} has been attached")
        fn = self.load_func(fn_name, RAW_TRACEPOINT)
        try:
            self.raw_tracepoint_fds[tp] = raw_tracepoint_open(tp.decode(), fn.fd)
        except OSError as e:
            raise Exception(f"Failed to attach BPF to raw tracepoint {tp.decode()}: {e.strerror}") from None
        return self

    def detach_raw_tracepoint(self, tp=b""):
        tp = _b(tp)
        if tp not in self.raw_tracepoint_fds:
            raise Exception(f"Raw tracepoint {tp.decode()} is not attached")
        os.close(self.raw_tracepoint_fds.pop(tp))

    def attach_perf_event(self, ev_type=-1, ev_config=-1, fn_name=b"", sample_period=0,
                          sample_freq=0, pid=-1, cpu=-1, group_fd=-1):
        if (sample_period > 0) == (sample_freq > 0):
            raise Exception("exactly one of sample_period and sample_freq")
        fn = self.load_func(fn_name, PERF_EVENT)
        fds = self.open_perf_events.setdefault((ev_type, ev_config), {})
        for c in ([cpu] if cpu >= 0 else online_cpus()):
            try:
                fd = perf_event_open(ev_type, ev_config, sample_period, sample_freq, pid, c, group_fd)
            except OSError as e:
                raise Exception(f"Failed to open perf event on CPU {c}: {e.strerror}") from None
            fds[c] = fd
            try:
                fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, fn.fd)
                fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
            except OSError as e:
                raise Exception(f"Failed to attach BPF to perf event: {e.strerror}") from None

    def detach_perf_event(self, ev_type=-1, ev_config=-1):
        for fd in self.open_perf_events.pop((ev_type, ev_config), {}).values():
            try:
                fcntl.ioctl(fd, PERF_EVENT_IOC_DISABLE, 0)
            except OSError:
                pass
            os.close(fd)

    def perf_buffers(self) -> PerfBuffers:
        """The perf buffers of the maps (PerfEventArray.open_perf_buffer), this Program's."""
        if self._perf is None:
            self._perf = PerfBuffers()
        return self._perf

    def perf_buffer_poll(self, timeout: int = -1):
        """The records of every perf buffer, read (kernel/perfring.py
        PerfBuffers.poll): at once if some are there, else after a wait of
        up to timeout ms (-1: forever) that a record or a signal ends."""
        self.perf_buffers().poll(timeout)

    # -- maps
    def __getitem__(self, name):
        key = _b(name)
        t = self.tables.get(key)
        if t is None:
            sname = key.decode()
            if sname not in self._specs:
                raise KeyError(name)
            spec = self._specs[sname]
            cls = TABLE_TYPES.get(spec["type"])
            if cls is None:
                raise Exception(f"map {sname}: type {spec['type']} not supported")
            t = self.tables[key] = cls(self, sname, spec, self._map_fds[sname])
        return t

    def __contains__(self, name):
        return _b(name).decode() in self._specs

    def cleanup(self):
        """Detach everything and close every fd (idempotent)."""
        for tp in list(self.raw_tracepoint_fds):
            os.close(self.raw_tracepoint_fds.pop(tp))
        for ev in list(self.open_perf_events):
            self.detach_perf_event(*ev)
        if self._perf is not None:
            self._perf.close()
            self._perf = None
        for name in list(self.funcs):
            os.close(self.funcs.pop(name).fd)
        for name in list(self._map_fds):
            os.close(self._map_fds.pop(name))
        self.tables.clear()


VERIFY_TRIES = 8


def _verified(*args):
    """prog_load, again when the verifier gave up because a signal came for
    this thread (EAGAIN: it checks for one as it goes; a helper's SIGCHLD
    during a background verification was enough), as libbpf does.  The
    thread blocks the signals the session handles meanwhile, so they go to
    another."""
    import errno
    import signal
    blocked = {signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM}
    main = threading.current_thread() is threading.main_thread()
    old = None if main else signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        for attempt in range(VERIFY_TRIES):
            try:
                return prog_load(*args)
            except OSError as e:
                if e.errno != errno.EAGAIN or attempt == VERIFY_TRIES - 1:
                    raise
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


# -- load -------------------------------------------------------------------------------------------------
def load(text: str, cflags: Sequence[str], *, skip: Iterable[str] = (),
         preload: Sequence[Tuple[str, int]] = (), optional: Sequence[Tuple[str, int]] = (),
         notices: Optional[List[str]] = None, cache_dir: Optional[str] = "default",
         log_level: int = 0, sizes: Optional[Dict[str, int]] = None,
         consts: Optional[Dict[str, int]] = None,
         meanwhile: Optional[Callable[["Program"], None]] = None, may_compile: bool = True) -> Program:
    """The programs of text compiled with cflags: the package's (shipped),
    else this machine's cache, else compiled by bcc (may_compile=False: not;
    BpfError instead), with every raw_tracepoint__<tp> function attached
    except the tps in skip, and the (function, program type) pairs of preload and optional
    loaded too, all at once (the verifier takes most of a start: in parallel
    they take the time of the slowest where there are cores enough).  A
    failure of an optional program is kept for load_func to raise.  sizes
    (map name -> entries) makes hash and stack maps smaller than the source
    says, for what this session needs: the kernel reserves a preallocated
    map's memory whole.  A map's size is not in the instructions, so the
    cached programs serve every size; an array's may also grow.  consts:
    the values of the load-time constants the programs use (NAME -> int,
    bpf/loadconst.h), set in their instructions before the verifier runs:
    what depends on the kernel or the session, so that one compiled entry
    serves them all.  meanwhile: the caller's work, done
    while the verifier runs (load_funcs_parallel).  Raises BpfError (one
    line) or what bcc raises on a miss."""
    notices = notices if notices is not None else []
    start = (skip, preload, optional, log_level, sizes, meanwhile, consts)
    refused = None
    try:
        entry = shipped_entry(text, cflags)
    except CacheError as e:
        notices.append(f"BPF programs shipped in the package: {e}; compiled with bcc")
        entry = None
    if entry is not None:
        try:
            prog = _start(entry, *start)
            prog.origin = "package"
            return prog
        except Exception as e:                          # noqa: BLE001 (compiled below)
            if "super-user" in str(e):
                raise
            refused = one_line(e)
            notices.append(f"the BPF programs shipped in the package did not load on this kernel "
                           f"({refused}); compiled with bcc")
    try:
        return _cached_or_compiled(text, cflags, cache_dir, notices, start, may_compile)
    except BpfError as e:
        if refused and "not installed" in str(e):
            raise BpfError(f"the shipped programs did not load on this kernel ({refused}), and {e} "
                           "to compile them for it") from None
        raise


def _cached_or_compiled(text, cflags, cache_dir, notices, start, may_compile=True) -> Program:
    """The programs from this machine's cache, else compiled with bcc (and
    cached)."""
    directory = default_cache_dir() if cache_dir == "default" else cache_dir
    key = cache_key(text, cflags) if directory else None
    path = os.path.join(directory, key + ".bpf") if key else None
    if path and not safe_dir(directory):
        path = None
    entry = None
    if path:
        try:
            entry = read_entry(path, key)
        except CacheError as e:
            notices.append(f"BPF program cache {path}: {e}; compiled again")
    if entry is not None:
        try:
            prog = _start(entry, *start)
            prog.origin = "cache"
            return prog
        except Exception as e:                          # noqa: BLE001 (compiled again below)
            if not may_compile:
                raise BpfError(f"the cache's ({path}) did not load ({one_line(e)})") from None
            notices.append(f"BPF programs from the cache {path} did not load ({one_line(e)}); "
                           "compiled again")
    if not may_compile:
        raise BpfError("none compiled for this source, in the package or the cache")
    entry = compile_in_child(text, cflags)
    entry["key"] = key
    check_entry(entry, key)
    prog = _start(entry, *start)
    if path:
        write_entry(directory, path, entry)
    return prog


RESIZABLE = (BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_STACK_TRACE)   # made smaller
MAX_ARRAY_ENTRIES = 1 << 16     # an array (its index checked at each lookup) may be made larger,
                                # never smaller (the source indexes what it declares)


def _resized(entry: dict, sizes: Optional[Dict[str, int]]) -> dict:
    """entry with the maps of sizes made that many entries, and each perf
    event array one per possible CPU of this machine (bcc sizes them for
    the machine that compiled them); the entry itself is left as it is."""
    sizes = dict(sizes or {})
    ncpus = None
    for m in entry["maps"]:
        if m["type"] == BPF_MAP_TYPE_PERF_EVENT_ARRAY and m["name"] not in sizes:
            ncpus = ncpus or max(possible_cpus()) + 1
            if m["max_entries"] != ncpus:
                sizes[m["name"]] = ncpus
    if not sizes:
        return entry
    maps = []
    for m in entry["maps"]:
        n = sizes.get(m["name"])
        if n is not None:
            if not (m["type"] in RESIZABLE and 0 < n <= m["max_entries"]
                    or m["type"] == BPF_MAP_TYPE_ARRAY and m["max_entries"] <= n <= MAX_ARRAY_ENTRIES
                    or m["type"] == BPF_MAP_TYPE_PERF_EVENT_ARRAY and 0 < n <= MAX_ARRAY_ENTRIES):
                raise ValueError(f"map {m['name']}: cannot be given {n} entries")
            m = dict(m, max_entries=n)
        maps.append(m)
    return dict(entry, maps=maps)


def _start(entry: dict, skip: Iterable[str], preload: Sequence[Tuple[str, int]],
           optional: Sequence[Tuple[str, int]], log_level: int,
           sizes: Optional[Dict[str, int]] = None,
           meanwhile: Optional[Callable[["Program"], None]] = None,
           consts: Optional[Dict[str, int]] = None) -> Program:
    entry = _resized(entry, sizes)
    for m in entry["maps"]:                     # every type decodes, before anything is made
        try:
            check_sizes(m["name"], ctype_of(json.loads(m["key_desc"])),
                         ctype_of(json.loads(m["leaf_desc"])), m)
        except ValueError as e:
            raise CacheError(f"map {m['name']}: {e}") from None
    prog = Program(entry, log_level, consts)
    try:
        skip = set(skip)
        auto = [n for n in prog.function_names()
                if n.startswith(AUTOLOAD_PREFIX) and n[len(AUTOLOAD_PREFIX):] not in skip]
        specs = [(n, RAW_TRACEPOINT) for n in auto] + list(preload) + list(optional)
        prog.load_funcs_parallel(specs, optional=[n for n, _ in optional], meanwhile=meanwhile)
        for n in auto:
            prog.attach_raw_tracepoint(tp=n[len(AUTOLOAD_PREFIX):], fn_name=n)
    except BaseException:
        prog.cleanup()
        raise
    return prog
